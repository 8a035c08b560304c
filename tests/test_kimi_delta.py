"""Kimi Linear (``KimiLinearForCausalLM``: Kimi delta attention + MLA attention + MoE) trains exactly on trees.

Kimi delta attention is the gated delta rule with a decay per key channel (``g [B, N, H, K]``) after a causal
convolution; hf_tree runs it with GatedDeltaNet's tree-aware chunked rule (``tree_chunk_gated_delta_rule``, the
per-head decay being the shared-channel case) and tree convolution (docs/hybrids.md).

Oracle: each branch alone through the model's own path (MLA with ``sdpa``, the model's own convolution and delta
attention), float64. The model computes its norms, forget gate, router and delta attention in float32 even in a
float64 model; ``float64_kimi_linear`` (hf_tree.testing) keeps them in float64 in both runs, the oracle's delta
attention being the model's own recurrence (``recurrent_kimi_delta_attention``, token by token): 1e-9 holds
(measured ~2e-15). The bug this guards against (siblings in a branch's recurrent state) moves gradients by 0.51 here.

Trees: a segment longer than the model's chunk of 64 tokens (70 tokens: two chunks) and segments longer than the
16-token decay blocks (``DECAY_BLOCK``), forks at position 1, inside the prompt and inside an answer, a prefix
branch, an untrained branch, uneven siblings, and a second tree in the row.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from transformers import Trainer, TrainingArguments
from trl import SFTConfig, SFTTrainer

from hf_tree import Tree, TreeDataCollator, tree_causal_lm_loss
from hf_tree.depth_first import DepthFirstConfig, depth_first_backward
from hf_tree.models.check import SELF_CHECK_ENV_VAR, probe_tree_exactness
from hf_tree.models.introspection import own_attention
from hf_tree.models.mixers import (
    build_topology,
    install_tree_mixers,
    tree_chunk_gated_delta_rule,
    uninstall_tree_mixers,
)
from hf_tree.models.mixers.delta_rule import DECAY_BLOCK, _decayed_scores
from hf_tree.testing import float64_kimi_linear, in_float64
from hf_tree.trainer import TreeTrainer, TreeTrainingArguments
from hf_tree.trl.sft import TreeSFTConfig, TreeSFTTrainer
from tests.helpers import (
    FLOAT32_FLOOR,
    VOCAB,
    assert_same_step_as_trl,
    branch_loss_func,
    collate_branches,
    common_args,
    float32_floor_grad_error,
    grads_of,
    hybrid_model,
    max_grad_relative_error,
    one_rank_context_parallel_errors,
    per_branch_forest_loss,
    relative_error,
    tiny_trl_config,
    train_and_measure_updates,
    word_tokenizer,
)
from tests.workloads import branch_dataset, tree_dataset

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOLERANCE = 1e-9
EXACT = 1e-12  # the tree op against the model's own recurrence on each branch, float64


def kimi_groups(prompt_length: int = 80, seed: int = 44) -> list[tuple[list[list[int]], list[list[int]]]]:
    """Two trees (see the module docstring); token ids in [3, VOCAB)."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    prompt, answer = tokens(prompt_length), tokens(22)
    sequences = [
        prompt + answer + tokens(18),
        prompt + answer + tokens(3),  # uneven siblings after a fork inside the answer
        prompt + answer[:4],  # a prefix branch
        prompt + tokens(5),
        prompt[:1] + tokens(2),  # a fork at position 1
        prompt[:10] + tokens(6),  # a fork inside the prompt
    ]
    masks = [[0] * prompt_length + [1] * (len(s) - prompt_length) for s in sequences]
    masks[4], masks[5] = [0, 1, 1], [0] * len(sequences[5])  # the last branch untrained: it still feeds states
    second = tokens(9)
    second_tree = [second + tokens(4), second[:5] + tokens(7), second + tokens(1)]
    return [(sequences, masks), (second_tree, [[0] + [1] * (len(s) - 1) for s in second_tree])]


def collate(groups, max_packed_tokens: int = 512) -> dict[str, torch.Tensor]:
    return TreeDataCollator(max_packed_tokens=max_packed_tokens)([Tree.from_sequences(s, m) for s, m in groups])


def branch_paths(kv_end: torch.Tensor) -> list[list[int]]:
    """Flat packed indices of every root-to-leaf path (padding tokens are one-token paths)."""
    pred = build_topology(kv_end).pred.tolist()
    continued = set(pred)
    paths = []
    for leaf in (i for i in range(len(pred)) if i not in continued):
        path = [leaf]
        while pred[path[-1]] >= 0:
            path.append(pred[path[-1]])
        paths.append(path[::-1])
    return paths


def kimi_model() -> torch.nn.Module:
    """The tiny float64 Kimi Linear of ``hf_tree.testing.SLOW_HYBRIDS`` with its float32-kept parameters (forget
    gates' ``dt_bias``, routers' weights) in float64 too."""
    return hybrid_model("kimi_linear").double()


# ------------------------------------------------------------------------------------------------------- op
def test_decay_blocks_factor_exactly_where_the_plain_split_overflows():
    """Per-channel decays across blocks factor through each block's first token: equal to the explicit
    ``[C, C, K]`` form at 1e-12 on decays so strong that ``exp(-cum)`` overflows float64."""
    generator = torch.Generator().manual_seed(0)
    left, right = (torch.randn(3, 2, 64, 8, dtype=torch.float64, generator=generator) for _ in range(2))
    cum = (-20 * torch.rand(3, 2, 64, 8, dtype=torch.float64, generator=generator)).cumsum(-2)
    assert torch.isinf((-cum).exp()).any()
    difference = (cum[..., :, None, :] - cum[..., None, :, :]).masked_fill(
        torch.ones(64, 64, dtype=torch.bool).triu(1)[..., None], float("-inf")
    )
    explicit = (left[..., :, None, :] * right[..., None, :, :] * difference.exp()).sum(-1)
    (blocked,) = _decayed_scores(cum, right, left)
    assert 64 // DECAY_BLOCK > 1 and relative_error(blocked, explicit) <= EXACT


@pytest.mark.parametrize("chunk_size", [4, 32])
def test_tree_kimi_delta_rule_matches_each_branch(chunk_size):
    """The tree op on a packed forest against, on each branch alone, the model's own recurrence in float64 (1e-12)
    and its own chunked torch path (float32 inside); gradients against the sum of the branches' (1e-12). A 35-token
    segment: two chunks of 32 (each of two decay blocks), or many chunks of 4 (one explicit block each)."""
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

    recurrence = in_float64(kimi.recurrent_kimi_delta_attention.__hf_tree_original__)
    chunked = kimi.chunk_kimi_delta_attention.__hf_tree_original__
    kv_end = collate(kimi_groups(prompt_length=45))["kv_end"]
    batch, length = kv_end.shape
    generator = torch.Generator().manual_seed(1)
    shapes = [(2, 8), (2, 8), (2, 6), (2, 8), (2,)]  # query, key, value, decay logits (per channel), beta logits
    inputs = [torch.randn(batch, length, *s, dtype=torch.float64, generator=generator).requires_grad_() for s in shapes]

    def run(fn, q, k, v, a, b, **options):
        g, beta = -F.softplus(a), b.sigmoid()
        return fn(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, **options)[0]

    topology = build_topology(kv_end)
    tree = run(tree_chunk_gated_delta_rule, *inputs, topology=topology, chunk_size=chunk_size)
    projection = torch.randn(tree.shape, dtype=tree.dtype, generator=generator)
    tree_grads = torch.autograd.grad((tree * projection).sum(), inputs)

    def at(tensor: torch.Tensor, path: list[int]) -> torch.Tensor:
        return tensor.reshape(batch * length, *tensor.shape[2:])[path][None]

    total, seen = 0.0, set()
    for path in branch_paths(kv_end):
        branch = [at(x, path) for x in inputs]
        own = run(recurrence, *branch, initial_state=None, output_final_state=False)
        assert relative_error(at(tree, path), own) <= EXACT
        assert relative_error(at(tree, path), run(chunked, *branch)) <= FLOAT32_FLOOR
        mine = [k for k, i in enumerate(path) if i not in seen]  # each token's output counted once
        seen.update(path)
        total = total + (own[0, mine] * at(projection, path)[0, mine]).sum()
    for got, expected in zip(tree_grads, torch.autograd.grad(total, inputs)):
        assert expected.norm() > 0 and relative_error(got, expected) <= EXACT


# --------------------------------------------------------------------------------------------------- model
def test_kimi_linear_tree_logits_and_gradients_match_per_branch():
    """Logits at every token of every branch, the loss and every parameter's gradient, float64, 1e-9."""
    groups = kimi_groups()
    batch = collate(groups)
    model = kimi_model()
    with float64_kimi_linear():
        loss = tree_causal_lm_loss(model, batch)
        loss.backward()
        tree_grads = grads_of(model)
        model.zero_grad()
        reference = per_branch_forest_loss(model, groups)
        reference.backward()
        with torch.no_grad():
            keys = ("input_ids", "position_ids", "kv_end")
            logits = model(**{k: batch[k] for k in keys}, use_cache=False).logits
            flat_ids, flat_logits = batch["input_ids"].reshape(-1), logits.reshape(-1, logits.shape[-1])
            with own_attention(model):
                for path in branch_paths(batch["kv_end"]):
                    alone = model(input_ids=flat_ids[path][None], use_cache=False).logits[0]
                    assert relative_error(flat_logits[path], alone) <= TOLERANCE
    assert batch["input_ids"].shape[0] == 1 and len(branch_paths(batch["kv_end"])) == 8  # leaves
    assert relative_error(loss, reference) <= TOLERANCE
    assert max_grad_relative_error(tree_grads, grads_of(model)) <= TOLERANCE


@pytest.mark.slow
def test_without_the_tree_delta_rule_kimi_is_refused_or_wrong(monkeypatch):
    """The oracle has teeth: with the model's own mixers (the row as one sequence) the first-use probe refuses the
    model at its delta attention, and with the check off the gradients are off by > 1e-2."""
    groups = kimi_groups()
    model = kimi_model()
    uninstall_tree_mixers()
    try:
        with pytest.raises(ValueError, match=r"not tree-exact.*KimiLinearDeltaAttention"):
            probe_tree_exactness(model)
        monkeypatch.setenv(SELF_CHECK_ENV_VAR, "0")
        with float64_kimi_linear():
            tree_causal_lm_loss(model, collate(groups)).backward()
            tree_grads = grads_of(model)
            model.zero_grad()
            per_branch_forest_loss(model, groups).backward()
    finally:
        install_tree_mixers()
    assert max_grad_relative_error(tree_grads, grads_of(model)) > 1e-2


def test_tree_batches_refuse_a_cache():
    batch = collate(kimi_groups())
    with pytest.raises(ValueError, match="use_cache=False"):
        kimi_model()(**{k: batch[k] for k in ("input_ids", "position_ids", "kv_end")}, use_cache=True)


def test_batches_without_kv_end_are_unchanged():
    """Installed, the ops leave padded batches and cached generation (the recurrent decoding step) as they were."""
    model = kimi_model().eval()
    input_ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    attention_mask = (torch.arange(6) >= torch.tensor([[2], [0]])).long()

    def run():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        generated = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=4, do_sample=False
        )
        return logits, generated

    with torch.no_grad():
        installed = run()
        uninstall_tree_mixers()
        try:
            original = run()
        finally:
            install_tree_mixers()
    assert torch.equal(installed[0], original[0]) and torch.equal(installed[1], original[1])


@pytest.mark.slow
@pytest.mark.parametrize("max_unit_tokens, checkpointing", [(7, False), (40, True)])
def test_depth_first_matches_per_branch(max_unit_tokens, checkpointing):
    """Depth-first execution: each unit's roots start from the state its nearest cached ancestor piece ended with,
    and its convolutions read the ancestors' cached inputs; units of 7 tokens cut every segment, units of 40 hold
    decay blocks and several segments (with gradient checkpointing: a recompute records the same entries). Also
    equal to the trees packed."""
    groups = kimi_groups()
    trees = [Tree.from_sequences(s, m) for s, m in groups]
    model = kimi_model()
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    with float64_kimi_linear():
        loss = depth_first_backward(model, trees, DepthFirstConfig(max_unit_tokens))
        grads = grads_of(model)
        model.zero_grad()
        reference = per_branch_forest_loss(model, groups)
        reference.backward()
        reference_grads = grads_of(model)
        model.zero_grad()
        packed = tree_causal_lm_loss(model, collate(groups))
        packed.backward()
    assert relative_error(loss, reference) <= TOLERANCE
    assert max_grad_relative_error(grads, reference_grads) <= TOLERANCE
    assert relative_error(loss, packed) <= EXACT
    assert max_grad_relative_error(grads, grads_of(model)) <= TOLERANCE


@pytest.mark.slow
def test_bfloat16_tree_error_is_no_worse_than_per_branch():
    """In bfloat16 (the delta rule's states in float32) the tree's gradient error against float64 per-branch training
    is within 2x of bfloat16 per-branch training's own error (measured 1.01x, both 0.2)."""
    groups = kimi_groups()
    model = kimi_model()
    with float64_kimi_linear():
        per_branch_forest_loss(model, groups).backward()
    exact = grads_of(model)
    low = kimi_model().to(torch.bfloat16)
    tree_causal_lm_loss(low, collate(groups)).backward()
    tree_grads = grads_of(low)
    low.zero_grad()
    per_branch_forest_loss(low, groups).backward()
    branch_grads = grads_of(low)
    tree_error = float32_floor_grad_error({n: g.double() for n, g in tree_grads.items()}, exact)
    branch_error = float32_floor_grad_error({n: g.double() for n, g in branch_grads.items()}, exact)
    assert tree_error <= 2 * branch_error


def test_one_rank_context_parallel_equals_packed():
    """Under hf_tree's context parallel the delta rule and conv run on the whole row gathered from the ranks
    (``SEQUENCE_DIMS``) and keep their own slots; on one rank this is the packed run."""
    batch = collate(kimi_groups())
    with float64_kimi_linear():  # its float32 forget gate sums dt_bias's gradient in another order (1e-8)
        loss_error, grad_error = one_rank_context_parallel_errors(kimi_model(), batch)
    assert loss_error <= EXACT
    assert grad_error <= EXACT


# ------------------------------------------------------------------------------------------------ trainers
@pytest.mark.slow
def test_tree_trainer_step_matches_trainer_on_branches(tmp_path):
    """One SGD step of every parameter: TreeTrainer on the trees (split over rows of 64 tokens) and
    transformers.Trainer on the unrolled branches (MLA with sdpa, right padding) move every parameter alike."""
    groups = kimi_groups(prompt_length=20) + kimi_groups(prompt_length=12, seed=45)
    tree_model = kimi_model()
    reference = kimi_model()
    reference.set_attn_implementation("sdpa")
    before = {n: p.detach().clone() for n, p in tree_model.named_parameters()}
    settings = dict(max_steps=1)
    tree_args = TreeTrainingArguments(**common_args(tmp_path, "tree", 2, 1, **settings), max_packed_tokens=64)
    tree = TreeTrainer(model=tree_model, args=tree_args, train_dataset=tree_dataset(groups))
    ref_args = TrainingArguments(**common_args(tmp_path, "ref", 2, 1, **settings), remove_unused_columns=False)
    branches = sum(len(sequences) for sequences, _ in groups[:2])
    ref = Trainer(
        model=reference,
        args=ref_args,
        train_dataset=branch_dataset(groups),
        data_collator=collate_branches,
        compute_loss_func=branch_loss_func("token", branches),
    )
    with float64_kimi_linear():
        tree.train()
        ref.train()
    tree_updates = {n: p.detach() - before[n] for n, p in tree_model.named_parameters()}
    ref_updates = {n: p.detach() - before[n] for n, p in reference.named_parameters()}
    assert all(update.norm() > 0 for name, update in ref_updates.items() if "experts" not in name)
    assert max_grad_relative_error(tree_updates, ref_updates) <= TOLERANCE
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (tree, ref)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)  # Trainer logs the loss in float32


SFT_ROWS = {
    "prompt": ["w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21 w22 w23 w24 w25 w26 w27"] * 2 + ["w16 w17"] * 2,
    "completion": [" w30 w31 w32 w33 w34 w35", " w36 w37", " w25", " w26 w27"],
}


@pytest.mark.slow
def test_sft_step_equals_trl(tmp_path):
    """TreeSFTTrainer against TRL's SFTTrainer: one SGD step (2 micro-batches of 2 rows, each a tree of one prompt and
    its 2 completions) logs TRL's loss and moves every parameter as TRL does (TRL's step tolerance: its fused LM head
    computes in float32). The loaded model keeps ``dt_bias`` and the routers' weights in float32
    (``_keep_in_fp32_modules_strict``): their updates are float32 differences, compared at the float32 floor."""
    path = str(tmp_path / "model")
    model = hybrid_model("kimi_linear")
    model.set_attn_implementation("sdpa")
    model.save_pretrained(path)

    def sft_step(cls, config_cls):
        args = tiny_trl_config(
            config_cls,
            path,
            torch.float64,
            max_steps=1,
            learning_rate=1.0,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            train_sampling_strategy="sequential",
            model_init_kwargs={"dtype": torch.float64, "experts_implementation": "eager"},
        )
        dataset = Dataset.from_dict(SFT_ROWS)
        trainer = cls(model=path, args=args, train_dataset=dataset, processing_class=word_tokenizer())
        with float64_kimi_linear():
            return trainer, train_and_measure_updates(trainer)

    trl, trl_updates = sft_step(SFTTrainer, SFTConfig)
    tree, tree_updates = sft_step(TreeSFTTrainer, TreeSFTConfig)
    assert tree.state.log_history[0]["dedup_ratio"] > 1
    kept = {name for name, update in trl_updates.items() if update.dtype == torch.float32}
    assert kept and all(name.endswith(("dt_bias", "gate.weight")) for name in kept)

    def without_kept(updates: dict) -> dict:
        return {name: update for name, update in updates.items() if name not in kept}

    assert_same_step_as_trl(trl, without_kept(trl_updates), tree, without_kept(tree_updates))
    assert float32_floor_grad_error(tree_updates, trl_updates) <= FLOAT32_FLOOR  # the float32 ones (1e-6 measured)
