"""``tree_share_across_microbatches``: a GRPO group is one tree even when ``per_device_train_batch_size`` cuts it
(``True`` here; the default ``None`` turns it on where it can: ``test_default_shares_where_it_can``).

Micro-batches of 2 rows from groups of 4 completions, 2 accumulated micro-batches per optimizer step, 2 iterations
per generation (a new window recomputes its prompt pieces), beta > 0: TreeGRPOTrainer with the option moves every
parameter as TRL's GRPOTrainer does (same fixed completions; ~5e-15, closer than the packed tree pass, whose
float32 kernel gradients round differently: ~8e-7), logs the same metrics, and forwards each prompt once per
optimizer step in the policy pass. float64, RMSNorm in float64.
"""

from __future__ import annotations

import pytest
import torch
from accelerate.utils import DistributedType
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from hf_tree.models.introspection import backbone_of
from hf_tree.trl.grpo import TreeGRPOConfig, TreeGRPOTrainer
from hf_tree.trl.rloo import TreeRLOOConfig, TreeRLOOTrainer
from hf_tree.trl.shared_prompts import SharedPromptPolicyMixin
from tests.helpers import (
    FIXED_COMPLETIONS,
    FLOAT32_FLOOR,
    TRL_STEP_TOLERANCE,
    TRL_TOLERANCE,
    fixed_rollout,
    float32_floor_grad_error,
    hybrid_model,
    one_step,
    relative_error,
    saved_tiny_model,
    tiny_model,
    trainer_args,
    word_tokenizer,
    zero_reward,
)

# Groups of 4 cut into micro-batches of 2; 4 optimizer steps: 2 generations (one prompt each) x 2 iterations.
CUT = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, num_iterations=2, max_steps=4, beta=0.1)
SHARED = dict(tree_share_across_microbatches=True)
PACKED = dict(tree_share_across_microbatches=False)  # the per-micro-batch packed pass
# Logged values that are not functions of the weights and batches.
UNLOGGED = ("step_time", "tree/dedup_ratio", "epoch", "step")


def largest_update_error(updates: dict, reference: dict) -> float:
    assert updates.keys() == reference.keys()
    assert any(u.norm() > 0 for u in reference.values())
    return max(relative_error(updates[name], update) for name, update in reference.items())


# Logged metrics after the first update are functions of float32 weights that already differ by TRL_STEP_TOLERANCE;
# the KL (~ half the squared log-prob difference) doubles that relative difference and more (3.5e-6 seen).
LATER_STEP_TOLERANCE = 1e-5


def assert_same_logs(
    trainer,
    reference,
    update_tolerance: float = LATER_STEP_TOLERANCE,
    gradient_tolerance: float = TRL_STEP_TOLERANCE,
) -> None:
    """Every logged metric of ``reference`` (TRL) logged equal by ``trainer``, step by step: the first step's at
    ``TRL_TOLERANCE``, the gradient norm at ``gradient_tolerance``, the tolerance of the gradients it sums (TRL's
    float32 kernel gradients round differently when micro-batches mix groups: 5e-9 seen); ``update_tolerance``: how
    far every metric after the first update may differ."""
    ours, theirs = trainer.state.log_history, reference.state.log_history
    assert len(ours) == len(theirs)
    for step, (mine, their) in enumerate(zip(ours, theirs)):
        for key, value in their.items():
            if key in UNLOGGED or "runtime" in key or "per_second" in key:
                continue
            tolerance = gradient_tolerance if key == "grad_norm" else update_tolerance if step else TRL_TOLERANCE
            assert mine[key] == pytest.approx(value, rel=tolerance, abs=1e-12), key


def assert_clipping_active(trainer, max_grad_norm: float) -> None:
    """With clipping on, a step's gradient norm exceeded it: clipping rescaled an update compared."""
    if max_grad_norm:
        norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
        assert norms and max(norms) > max_grad_norm, norms


class TokenCounter:
    """Tokens the policy's backbone forwarded with gradients on (the policy pass; old-policy and reference passes
    run without)."""

    def __init__(self, trainer) -> None:
        self.tokens = 0
        model = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
        self.handle = backbone_of(model).register_forward_pre_hook(self.count, with_kwargs=True)

    def count(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if torch.is_grad_enabled() and ids is not None:
            self.tokens += ids.numel()


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory.mktemp("grpo_df"), torch.float64)


@pytest.fixture(scope="module")
def trl_runs(path):
    """TRL's GRPOTrainer per (loss_type, peft, gradient_checkpointing): the oracle, computed once."""
    runs = {}

    def run(loss_type: str, peft: bool, checkpointing: bool):
        key = (loss_type, peft, checkpointing)
        if key not in runs:
            runs[key] = one_step(
                GRPOTrainer, GRPOConfig, path, peft, loss_type=loss_type, gradient_checkpointing=checkpointing, **CUT
            )
        return runs[key]

    return run


@pytest.mark.parametrize(
    "checkpointing", [pytest.param(True, marks=pytest.mark.slow), False], ids=["checkpointing", "no_checkpointing"]
)
@pytest.mark.parametrize("peft", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["full", "lora"])
@pytest.mark.parametrize(
    "loss_type", ["grpo", *(pytest.param(t, marks=pytest.mark.slow) for t in ("dr_grpo", "dapo", "bnpo"))]
)
def test_shared_prompts_match_trl(path, trl_runs, monkeypatch, loss_type, peft, checkpointing):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    settings = dict(loss_type=loss_type, gradient_checkpointing=checkpointing, **CUT)
    trl, trl_updates = trl_runs(loss_type, peft, checkpointing)
    tree, updates = one_step(TreeGRPOTrainer, TreeGRPOConfig, path, peft, **settings, **SHARED)
    stats = tree.shared_prompt_stats
    assert stats.pieces == 4, "one prompt piece per optimizer step (a new window recomputes it)"
    base = tree.model.get_base_model() if peft else tree.model
    assert base.is_gradient_checkpointing == checkpointing
    error = largest_update_error(updates, trl_updates)
    print(f"\n{loss_type} peft={peft} checkpointing={checkpointing}: update error vs TRL {error:.2e}")
    tolerance = TRL_STEP_TOLERANCE
    if error > tolerance:  # TRL's float32 kernel rounds by more on some losses: dapo's packed pass 5e-6 from TRL
        _, packed_updates = one_step(TreeGRPOTrainer, TreeGRPOConfig, path, peft, **settings, **PACKED)
        tolerance = 2 * largest_update_error(packed_updates, trl_updates)
        assert error <= tolerance, error
    assert_same_logs(tree, trl, gradient_tolerance=tolerance)


OTHER_SETTINGS = {
    # A generation of 2 groups (8 rows) shuffled into 4 micro-batches, 2 optimizer steps: the lookahead stops at the
    # optimizer step's end; TRL runs no old-policy pass (num_iterations=1). Micro-batches then hold rows of both
    # groups and TRL's float32 kernel gradients round differently: 4e-8 from TRL (the packed pass: 5e-8).
    "two_steps_per_generation": dict(CUT, steps_per_generation=4, num_iterations=1, max_steps=2),
    # Per-sequence importance weights (GSPO) and the entropy quantile mask read the returned [B, T] tensors whole.
    "sequence_is_and_entropy_mask": dict(CUT, importance_sampling_level="sequence", top_entropy_quantile=0.5),
    # 3 accumulated micro-batches of 2 rows over 2 groups of 3 completions: a micro-batch holds the end of one group
    # and the start of the next
    "three_accumulation_steps_groups_of_3": dict(CUT, gradient_accumulation_steps=3, num_generations=3, max_steps=2),
    # one group of 6 completions (duplicates: the fixed rollout cycles through 4) cut into 3 micro-batches
    "groups_of_6": dict(CUT, gradient_accumulation_steps=3, num_generations=6, max_steps=2),
    # micro-batches of one row: every micro-batch is a piece of its group's prompt's subtree
    "batch_of_one": dict(CUT, per_device_train_batch_size=1, gradient_accumulation_steps=4, max_steps=2),
    # TRL's default clipping (max_grad_norm=1.0, every run's default here: exact_sgd_args), which the first update
    # exceeds (assert_clipping_active), and clipping off
    "clipped": dict(CUT, max_grad_norm=1.0, max_steps=2),
    "unclipped": dict(CUT, max_grad_norm=0.0, max_steps=2),
}


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) for name in OTHER_SETTINGS])
def test_other_settings_match_trl(path, monkeypatch, name):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    settings = OTHER_SETTINGS[name]
    trl, trl_updates = one_step(GRPOTrainer, GRPOConfig, path, False, **settings)
    tree, updates = one_step(TreeGRPOTrainer, TreeGRPOConfig, path, False, **settings, **SHARED)
    assert tree.shared_prompt_stats.pieces >= 1
    assert_clipping_active(trl, settings.get("max_grad_norm", 0.0))
    error = largest_update_error(updates, trl_updates)
    print(f"\n{name}: {tree.shared_prompt_stats.pieces} pieces, update error vs TRL {error:.2e}")
    assert error <= TRL_STEP_TOLERANCE, error
    assert_same_logs(tree, trl)


FIRST, SECOND = FIXED_COMPLETIONS  # the two prompts
# Options of the training loop and the data around the shared pass: (config settings, one_step_trainer's datasets).
LOOP_SETTINGS = {
    # TRL's evaluation between steps (eval_strategy="steps"): its passes run without gradients (the packed pass), then
    # training goes on with the shared one; eval_loss and every eval metric are logged equal
    "eval_during_training": (
        dict(CUT, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4),
        dict(eval_prompts=[FIRST, SECOND]),
    ),
    # two epochs over the two prompts (no max_steps): the sampler's epochs and the step count are TRL's
    "two_epochs": (dict(CUT, max_steps=-1, num_train_epochs=2), {}),
    # one prompt twice in the dataset: a generation of 2 groups with the same prompt tokens (8 rows in 4 micro-batches
    # of 2, 2 optimizer steps); the shared pass groups rows by prompt tokens, whichever group they come from
    "duplicate_prompts": (dict(CUT, steps_per_generation=4, num_iterations=1, max_steps=2), dict(prompts=[FIRST] * 2)),
    # completions without EOS leave the loss: TRL zeroes their completion mask, so their rows score no token (here
    # each group keeps one row, and a micro-batch without a scored row takes the packed pass's zero output)
    "mask_truncated_completions": (dict(CUT, mask_truncated_completions=True), {}),
}


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) for name in LOOP_SETTINGS])
def test_loop_and_data_options_match_trl(path, monkeypatch, name):
    """Each option run by TRL's GRPOTrainer and by TreeGRPOTrainer with the shared pass: the same updates and logs,
    and the option did what it says (so the comparison can fail)."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    settings, data = LOOP_SETTINGS[name]
    trl, trl_updates = one_step(GRPOTrainer, GRPOConfig, path, False, **data, **settings)
    tree, updates = one_step(TreeGRPOTrainer, TreeGRPOConfig, path, False, **data, **settings, **SHARED)
    pieces = tree.shared_prompt_stats.pieces
    error = largest_update_error(updates, trl_updates)
    print(f"\n{name}: {pieces} pieces, {tree.state.global_step} steps, update error vs TRL {error:.2e}")
    assert error <= TRL_STEP_TOLERANCE, error
    assert_same_logs(tree, trl)
    assert tree.state.global_step == trl.state.global_step
    if name == "eval_during_training":
        evals = [h for h in trl.state.log_history if "eval_loss" in h]
        assert len(evals) == 2 and pieces == 4  # after steps 2 and 4; training kept its shared pass
    elif name == "two_epochs":  # 2 prompts x 2 iterations, twice
        assert trl.state.epoch == pytest.approx(2.0) and trl.state.global_step == 8 and pieces == 8
    elif name == "duplicate_prompts":  # one prompt piece per optimizer step, shared by both groups' rows
        assert pieces == 2
    else:
        _, unmasked = one_step(GRPOTrainer, GRPOConfig, path, False, **CUT)
        assert largest_update_error(unmasked, trl_updates) > 1e-3


def test_prompts_run_once_per_optimizer_step(path, monkeypatch):
    """The policy pass forwards each prompt (minus its last token) once per optimizer step, not once per
    micro-batch: the packed pass forwards it in both micro-batches of a step."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    counts = {}
    for name, shared in (("packed", PACKED), ("shared", SHARED)):
        # without the one-time first-use checks, whose probe forwards (gradients on, no backward) would count too
        settings = dict(learning_rate=1.0, tree_self_check=False, **CUT, **shared)
        args = trainer_args(TreeGRPOConfig, path, torch.float64, **settings)
        trainer = TreeGRPOTrainer(
            path,
            zero_reward,
            args,
            train_dataset=Dataset.from_dict({"prompt": list(FIXED_COMPLETIONS)}),
            processing_class=word_tokenizer(),
            rollout_func=fixed_rollout,
        )
        counter = TokenCounter(trainer)
        trainer.train()
        counter.handle.remove()
        counts[name] = counter.tokens
    stats = trainer.shared_prompt_stats
    prompt_lengths = [len(p.split()) for p in FIXED_COMPLETIONS]  # one prompt per generation, 2 steps each
    saved = 2 * sum(length - 1 for length in prompt_lengths)  # per step: one of its two micro-batches' prompts
    assert counts["shared"] == stats.piece_tokens + stats.unit_tokens
    assert stats.piece_tokens == 2 * sum(length - 1 for length in prompt_lengths)
    assert counts["shared"] == counts["packed"] - saved


@pytest.mark.slow
def test_skipping_the_prompt_backward_is_wrong(path, trl_runs, monkeypatch):
    """Must fail: without the pieces' backward the prompt's gradient through its keys/values is lost."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    monkeypatch.setattr(SharedPromptPolicyMixin, "backward_shared_prompts", lambda self: self._shared_pieces.clear())
    _, trl_updates = trl_runs("grpo", False, True)
    _, updates = one_step(TreeGRPOTrainer, TreeGRPOConfig, path, False, gradient_checkpointing=True, **CUT, **SHARED)
    error = largest_update_error(updates, trl_updates)
    print(f"\nwithout the prompt backward: update error vs TRL {error:.2e}")
    assert error > 1e-3, error


def test_pieces_left_from_a_previous_step_are_refused(path, monkeypatch):
    """Pieces that missed their backward (a training loop without accelerate's sync_gradients on the last
    micro-batch) would silently drop gradient: the next optimizer step's pass raises instead."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    monkeypatch.setattr(SharedPromptPolicyMixin, "backward_shared_prompts", lambda self: None)
    with pytest.raises(RuntimeError, match="never backpropagated"):
        one_step(TreeGRPOTrainer, TreeGRPOConfig, path, False, **CUT, **SHARED)


@pytest.mark.slow  # ~55 s; the fast tier covers hybrids depth-first (test_depth_first.py) and in GRPO (hybrid trainers)
@pytest.mark.parametrize("family", ["qwen3_5_text", "bamba"])
@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_recurrent_hybrids_match_trl(tmp_path, monkeypatch, family, peft):
    """Hybrids with recurrent mixers (GatedDeltaNet, Mamba2): the piece also carries each recurrence's final state
    (``hf_tree.depth_first``'s ``("state", id)`` entries) and each convolution's inputs. Their float32 internals
    bound the comparison (``FLOAT32_FLOOR``, as tests/test_hybrid_trainers.py); the packed pass is as far from TRL."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    hybrid_model(family, attn="sdpa").save_pretrained(tmp_path)
    path = str(tmp_path)
    _, trl_updates = one_step(GRPOTrainer, GRPOConfig, path, peft, **CUT)
    _, packed_updates = one_step(TreeGRPOTrainer, TreeGRPOConfig, path, peft, **CUT, **PACKED)
    tree, updates = one_step(TreeGRPOTrainer, TreeGRPOConfig, path, peft, **CUT, **SHARED)
    assert tree.shared_prompt_stats.pieces == 4
    error, packed_error = (float32_floor_grad_error(u, trl_updates) for u in (updates, packed_updates))
    print(f"\n{family} peft={peft}: update error vs TRL {error:.2e} (packed pass: {packed_error:.2e})")
    assert max(error, packed_error) <= FLOAT32_FLOOR, (error, packed_error)  # both at the floor (bamba: 5.5e-5, 2.5e-5)
    with monkeypatch.context() as patch:  # must fail: the pieces' backward carries the recurrent states' gradient
        patch.setattr(SharedPromptPolicyMixin, "backward_shared_prompts", lambda self: self._shared_pieces.clear())
        _, skipped = one_step(TreeGRPOTrainer, TreeGRPOConfig, path, peft, **CUT, **SHARED)
    assert float32_floor_grad_error(skipped, trl_updates) > 1e-2


@pytest.mark.slow  # the shared-prompt passes RLOO shares with GRPO, whose fast test is test_shared_prompts_match_trl
@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("clipping", [0.0, 1.0], ids=["unclipped", "clipped"])
def test_rloo_shared_prompts_match_trl(path, monkeypatch, peft, clipping):
    """RLOO shares the mixin; it samples its own completions (same seed, same logits: the same ones). With TRL's
    default clipping (max_grad_norm=1.0) too."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    settings = dict(CUT, max_grad_norm=clipping)
    trl, trl_updates = one_step(RLOOTrainer, RLOOConfig, path, peft, rollout=False, **settings)
    tree, updates = one_step(TreeRLOOTrainer, TreeRLOOConfig, path, peft, rollout=False, **settings, **SHARED)
    assert tree.shared_prompt_stats.pieces == 4
    assert_clipping_active(trl, clipping)
    error = largest_update_error(updates, trl_updates)
    print(f"\nRLOO peft={peft} max_grad_norm={clipping}: update error vs TRL {error:.2e}")
    assert error <= TRL_STEP_TOLERANCE, error
    assert_same_logs(tree, trl)


@pytest.mark.slow
def test_default_shares_where_it_can(path, trl_runs, tmp_path, monkeypatch):
    """The default (``None``): on for groups cut across micro-batches (TRL's gradient checkpointing default),
    off without a shared prompt (a group per micro-batch), and off, without an error, where ``True`` is refused."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    _, trl_updates = trl_runs("grpo", False, True)
    settings = dict(loss_type="grpo", gradient_checkpointing=True, **CUT)
    tree, updates = one_step(TreeGRPOTrainer, TreeGRPOConfig, path, False, **settings)
    assert tree.args.tree_share_across_microbatches is None and tree.shared_prompt_stats.pieces == 4
    assert largest_update_error(updates, trl_updates) <= TRL_STEP_TOLERANCE
    whole = dict(CUT, per_device_train_batch_size=4, gradient_accumulation_steps=1)
    tree, _ = one_step(TreeGRPOTrainer, TreeGRPOConfig, path, False, **whole)
    assert tree._shares_prompts() and tree.shared_prompt_stats.pieces == 0  # nothing to share: the packed pass ran
    setup = dict(train_dataset=Dataset.from_dict({"prompt": ["w3"]}), processing_class=word_tokenizer())
    moe = tiny_model("mixtral", attn="tree_flash", router_aux_loss_coef=0.01)
    args = trainer_args(TreeGRPOConfig, str(tmp_path), torch.float64, beta=0.0)
    assert not TreeGRPOTrainer(moe, zero_reward, args, **setup)._shares_prompts()


def test_refusals(path, tmp_path, monkeypatch):
    setup = dict(train_dataset=Dataset.from_dict({"prompt": ["w3"]}), processing_class=word_tokenizer())
    with pytest.raises(ValueError, match="tree_share_across_microbatches.*tree_forward"):
        trainer_args(TreeGRPOConfig, path, torch.float64, tree_forward=False, **SHARED)
    with pytest.raises(ValueError, match="tree_share_across_microbatches.*reentrant"):
        trainer_args(
            TreeGRPOConfig,
            path,
            torch.float64,
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": True},
            **SHARED,
        )
    no_ref = dict(beta=0.0, **SHARED)  # model instances: no reference model to load by name
    moe = tiny_model("mixtral", attn="tree_flash", router_aux_loss_coef=0.01)
    with pytest.raises(ValueError, match="tree_share_across_microbatches.*router"):
        TreeGRPOTrainer(moe, zero_reward, trainer_args(TreeGRPOConfig, str(tmp_path), torch.float64, **no_ref), **setup)
    tree = TreeGRPOTrainer(path, zero_reward, trainer_args(TreeGRPOConfig, path, torch.float64, **SHARED), **setup)
    # what a 2-process launch (not DDP/FSDP2 here) or DeepSpeed would set
    for name, value, cause in (
        ("num_processes", 2, "2 processes"),
        ("distributed_type", DistributedType.DEEPSPEED, "DeepSpeed"),
    ):
        with monkeypatch.context() as patch:
            patch.setattr(type(tree.accelerator), name, property(lambda self, value=value: value))
            with pytest.raises(ValueError, match=f"tree_share_across_microbatches.*{cause}"):
                tree._check_shared_prompts()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    tree.model.train()  # the policy pass (training, gradients on, entropies)
    with torch.enable_grad(), pytest.raises(ValueError, match="tree_share_across_microbatches.*image"):
        tree._get_per_token_logps_and_entropies(
            tree.model, ids, torch.ones_like(ids), 2, compute_entropy=True, pixel_values=torch.zeros(1, 3, 4, 4)
        )
