"""Depth-first execution (``hf_tree.depth_first``) of multi-head latent attention (DeepSeek V2/V3: value head size !=
query/key head size) and Llama 4's chunked attention, against each branch run alone with the model's own attention.

Units are cut small (``max_unit_tokens`` not a multiple of the chunk size), so unit boundaries fall inside chunks and
a unit's chunks start in its cached ancestors: a chunk is a function of a token's depth, never of its index in a unit.
As in ``tests/test_mla_chunked_attention.py``, both families keep float32 routers / RoPE inside float64 models: losses
at float64 level (1e-9), gradients at the float32 floor (a lost chunk or prefix moves them by percents).
"""

from __future__ import annotations

import pytest
import torch
from trl import SFTConfig, SFTTrainer

from hf_tree import Tree
from hf_tree.assets import load_smollm2_tokenizer
from hf_tree.builders import GROUP_BY_ROW
from hf_tree.depth_first import DepthFirstConfig, depth_first_backward
from hf_tree.trl.sft import TreeSFTConfig, TreeSFTTrainer
from tests.helpers import (
    SMOLLM2_VOCAB,
    exact_sgd_args,
    float32_floor_grad_error,
    float64_family_norms,
    float64_norms,
    grads_of,
    max_grad_relative_error,
    per_branch_forest_loss,
    relative_error,
    tiny_model,
    train_and_measure_updates,
)
from tests.workloads import TINY_DEEPSEEK_V3, TINY_LLAMA4, prompt_completion_dataset

VOCAB = 97
LOSS_TOLERANCE = 1e-9
GRAD_TOLERANCE = 1e-5  # float32 routers / RoPE inside float64 models (measured <= 4e-7 packed)
DEEPSEEK = dict(TINY_DEEPSEEK_V3, experts_implementation="eager")  # grouped_mm experts refuse float64
MLA_FAMILIES = {"deepseek_v2": dict(DEEPSEEK, q_lora_rank=None), "deepseek_v3": DEEPSEEK}
LLAMA4 = TINY_LLAMA4
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py


def deep_groups() -> list[tuple[list[list[int]], list[list[int]] | None]]:
    """Two trees 17 and 10 deep (4 chunks of 4 on the longest branch): a shared prompt of 6 (partly untrained), an
    inner branch point at depth 8, siblings of 3-9 tokens."""
    prompt = [3, 14, 15, 92, 65, 35]
    sequences = [
        prompt + [8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2],
        prompt + [8, 9, 17, 18, 19],
        prompt + [11, 12, 13, 14, 15, 16, 20, 21, 22],
        prompt + [8, 9, 70],
    ]
    masks = [[0] * 4 + [1] * (len(s) - 4) for s in sequences]
    return [(sequences, masks), ([[40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [40, 41, 42, 50, 51]], None)]


def depth_first_and_branch_runs(model, groups, max_unit_tokens: int):
    """(depth-first loss, per-branch loss, depth-first grads, per-branch grads)."""
    trees = [Tree.from_sequences(s, m) for s, m in groups]
    assert max(t.num_tokens for t in trees) > max_unit_tokens  # several units, cached prefixes
    model.zero_grad()
    loss = depth_first_backward(model, trees, DepthFirstConfig(max_unit_tokens))
    tree_grads = grads_of(model)
    model.zero_grad()
    reference = per_branch_forest_loss(model, groups)
    reference.backward()
    return loss.detach(), reference.detach(), tree_grads, grads_of(model)


@pytest.mark.parametrize("max_unit_tokens", [3, 6])
@pytest.mark.parametrize("family", sorted(MLA_FAMILIES))
def test_mla_depth_first_matches_per_branch(family, max_unit_tokens):
    """The cache holds the padded keys/values of one head size; the prefix attention's output is sliced back."""
    with float64_family_norms():
        model = tiny_model(family, vocab_size=VOCAB, **MLA_FAMILIES[family])
        attention = model.model.layers[0].self_attn
        assert attention.qk_head_dim != attention.v_head_dim
        loss, reference, tree_grads, ref_grads = depth_first_and_branch_runs(model, deep_groups(), max_unit_tokens)
    assert relative_error(loss, reference) <= LOSS_TOLERANCE
    assert float32_floor_grad_error(tree_grads, ref_grads) <= GRAD_TOLERANCE


def test_mla_float32_grouped_mm_depth_first_matches_per_branch():
    """DeepSeek V3 as users load it (float32, grouped_mm experts): within the float32 floor of the branches."""
    model = tiny_model("deepseek_v3", dtype=torch.float32, vocab_size=VOCAB, **TINY_DEEPSEEK_V3)
    assert model.config._experts_implementation != "eager"
    loss, reference, tree_grads, ref_grads = depth_first_and_branch_runs(model, deep_groups(), 5)
    assert relative_error(loss, reference) <= 1e-5
    assert float32_floor_grad_error(tree_grads, ref_grads) <= 1e-4


@pytest.mark.parametrize("max_unit_tokens", [3, 5, 7])
def test_llama4_chunked_depth_first_matches_per_branch(max_unit_tokens):
    """Unit boundaries inside chunks (units of 3, 5, 7 tokens against chunks of 4): each branch keeps its chunks."""
    with float64_norms():
        model = tiny_model("llama4_text", vocab_size=VOCAB, **LLAMA4)
        assert model.config.layer_types == ["chunked_attention", "full_attention"]
        loss, reference, tree_grads, ref_grads = depth_first_and_branch_runs(model, deep_groups(), max_unit_tokens)
        model.config.attention_chunk_size = 64  # the chunks matter: one chunk over everything is another loss
        unchunked = per_branch_forest_loss(model, deep_groups()).detach()
    assert relative_error(unchunked, reference) > 1e-6
    assert relative_error(loss, reference) <= LOSS_TOLERANCE
    assert float32_floor_grad_error(tree_grads, ref_grads) <= GRAD_TOLERANCE


def test_llama4_temperature_tuning_is_refused_by_the_depth_of_a_unit():
    """Llama 4's NoPE layers scale queries by packed index: a depth-first unit's index is not its depth, so the
    check counts the unit with its cached ancestors (the tree's depth), not the unit alone."""
    groups = deep_groups()
    trees = [Tree.from_sequences(s, m) for s, m in groups]
    model = tiny_model("llama4_text", vocab_size=VOCAB, **LLAMA4, floor_scale=8)
    with pytest.raises(ValueError, match="floor_scale=8"):
        depth_first_backward(model, trees, DepthFirstConfig(5), self_check=False)
    deepest = max(int(t.position_ids.max()) for t in trees)
    model = tiny_model("llama4_text", vocab_size=VOCAB, **LLAMA4, floor_scale=deepest + 2)
    depth_first_backward(model, trees, DepthFirstConfig(5), self_check=False)  # every depth below floor_scale - 1


@pytest.mark.parametrize(
    "family, execution",
    [
        ("llama4_text", "auto"),
        ("deepseek_v3", "depth_first"),
        # every tree is larger than a row: "auto" runs each depth-first, so the other pairs repeat the path
        pytest.param("llama4_text", "depth_first", marks=pytest.mark.slow),
        pytest.param("deepseek_v3", "auto", marks=pytest.mark.slow),
    ],
)
def test_sft_steps_over_units_equal_trl(tmp_path, family, execution):
    """Two SGD steps (two micro-batches of 2 rows, clipping at TRL's default 1.0) of TreeSFTTrainer with rows of 8
    tokens, every tree larger (``"auto"``: those run depth-first, ``"depth_first"``: all), float64, = TRL's
    SFTTrainer on the branches with the model's own attention (TRL's cross-entropy runs on float32 logits even in a
    float64 model: 1e-5). Llama 4 in chunks of 4, so units of 8 tokens over a cache cut chunks."""
    settings = dict(max_steps=2, learning_rate=0.5, per_device_train_batch_size=2, bf16=False, use_cpu=True)
    settings |= dict(train_sampling_strategy="sequential", max_length=None)
    if family == "llama4_text":
        # Llama4ForCausalLM's forward adds no router loss, but TRL's default takes its config's 0.001 and TRL's fused
        # head then reads a num_experts the config lacks (AttributeError): 0.0 is the model's own objective
        settings["router_aux_loss_coef"] = 0.0
    units = dict(tree_execution=execution, max_packed_tokens=8, max_branch_tokens=64, group_by=GROUP_BY_ROW)
    overrides = LLAMA4 if family == "llama4_text" else DEEPSEEK
    tokenizer = load_smollm2_tokenizer()
    runs = {}
    for name, (config, trainer) in {"trl": (SFTConfig, SFTTrainer), "tree": (TreeSFTConfig, TreeSFTTrainer)}.items():
        args = config(**exact_sgd_args(str(tmp_path / name), **settings), **(units if name == "tree" else {}))
        model = tiny_model(family, vocab_size=SMOLLM2_VOCAB, attn="sdpa", **overrides)
        if name == "trl" and family == "llama4_text":
            # TRL's fused LM head runs `model.base_model`, which Llama4ForCausalLM resolves to itself (its
            # base_model_prefix "language_model" names no attribute; the decoder is `model`): TRL fails with an
            # AttributeError on last_hidden_state. Point the prefix at the decoder; no computation changes.
            model.base_model_prefix = "model"
        run = trainer(model, args=args, train_dataset=prompt_completion_dataset(), processing_class=tokenizer)
        if name == "tree":
            assert run.tree_depth_first is not None
        with float64_family_norms():
            runs[name] = (run, train_and_measure_updates(run))
    (trl, trl_updates), (tree, tree_updates) = runs["trl"], runs["tree"]
    trl_logs, tree_logs = ([h for h in t.state.log_history if "loss" in h] for t in (trl, tree))
    assert [h["loss"] for h in tree_logs] == pytest.approx([h["loss"] for h in trl_logs], rel=1e-5)
    assert max_grad_relative_error(tree_updates, trl_updates) <= 1e-5


@pytest.mark.parametrize("family", ["llama4_text", "deepseek_v3"])
def test_grpo_shared_prompt_pieces_match_trl(tmp_path, monkeypatch, family):
    """GRPO with each group's prompt run once per optimizer step as a depth-first piece (``tree_share_across_
    microbatches``), its completions in micro-batches over its cache: MLA's padded keys/values in the cache, and
    Llama 4 in chunks of 3 (the 5-token prompt piece ends inside a chunk, which its completions continue). The same
    step as TRL's GRPOTrainer (harness of tests/test_grpo_depth_first.py) at the float32 floor of these models."""
    from trl import GRPOConfig, GRPOTrainer

    from hf_tree.trl.grpo import TreeGRPOConfig, TreeGRPOTrainer
    from tests.helpers import one_step_trainer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    overrides = dict(LLAMA4, attention_chunk_size=3) if family == "llama4_text" else DEEPSEEK
    model = tiny_model(family, **overrides)
    model.save_pretrained(tmp_path)
    cut = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, num_iterations=2, max_steps=2, beta=0.1)
    cut["model_init_kwargs"] = dict(dtype=torch.float64, experts_implementation="eager")  # not saved in the config
    if family == "llama4_text":
        cut["router_aux_loss_coef"] = 0.0  # see test_sft_steps_over_units_equal_trl
    updates = {}
    for name, (trainer_cls, config_cls, extra) in {
        "trl": (GRPOTrainer, GRPOConfig, {}),
        "tree": (TreeGRPOTrainer, TreeGRPOConfig, dict(tree_share_across_microbatches=True)),
    }.items():
        trainer = one_step_trainer(trainer_cls, config_cls, str(tmp_path), False, **cut, **extra)
        if name == "trl" and family == "llama4_text":
            for model in (trainer.model, trainer.ref_model):  # see test_sft_steps_over_units_equal_trl
                model.base_model_prefix = "model"
        with float64_family_norms():
            updates[name] = train_and_measure_updates(trainer)
        if name == "tree":
            assert trainer.shared_prompt_stats.pieces == 2, "one prompt piece per optimizer step"
    error = float32_floor_grad_error(updates["tree"], updates["trl"])
    print(f"\n{family}: update error vs TRL {error:.2e}")
    assert any(u.norm() > 0 for u in updates["trl"].values())
    assert error <= GRAD_TOLERANCE  # measured 2.5e-7 (Llama 4), 1.0e-7 (DeepSeek V3)
