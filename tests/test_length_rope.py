"""RoPE whose frequencies depend on the batch's length (hf_tree.models.length_rope): exact below the switch, refused
above.

Oracle: each branch run alone with the model's own attention (``sdpa``), float64: loss and every parameter gradient.
transformers picks Phi-3 ``longrope``'s factors and ``dynamic`` NTK's base from the largest position of the whole
batch, so a packed batch whose deepest branch crosses the switch would give its shorter branches (and other rows'
trees) frequencies they do not get alone: measured before the refusal at gradient errors of 1e-2.
"""

from __future__ import annotations

import datasets
import pytest
import torch
import transformers

from hf_tree import Tree, TreeDataCollator, tree_causal_lm_loss
from hf_tree.models.length_rope import check_rope_lengths, length_switches, longest_exact_branch
from hf_tree.trainer import TreeTrainer, TreeTrainingArguments
from tests.helpers import grads_of, max_grad_relative_error, per_branch_loss, relative_error, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SWITCH = 32
HEAD_HALF = 4  # tiny models: hidden 32 / 4 heads = head dim 8, so 4 rotary frequencies
LONGROPE = dict(
    max_position_embeddings=128,
    pad_token_id=0,  # Phi-3's default pad id is past the tiny vocabulary
    original_max_position_embeddings=SWITCH,  # Phi3Config writes its own (4096) into rope_parameters otherwise
    rope_parameters=dict(
        rope_type="longrope",
        rope_theta=10000.0,
        short_factor=[1.0, 1.5, 2.0, 3.0][:HEAD_HALF],
        long_factor=[2.0, 5.0, 9.0, 20.0][:HEAD_HALF],
        original_max_position_embeddings=SWITCH,
    ),
)
DYNAMIC = dict(
    max_position_embeddings=SWITCH, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0)
)
MODELS = [pytest.param("phi3", LONGROPE, id="phi3-longrope"), pytest.param("llama", DYNAMIC, id="llama-dynamic")]


def branches(depths: list[int], prompt: int = 6, seed: int = 0) -> list[list[int]]:
    """Branches of the given lengths sharing a ``prompt``-token prefix."""
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 97, (prompt,), generator=generator).tolist()
    return [shared + torch.randint(3, 97, (d - prompt,), generator=generator).tolist() for d in depths]


def batch_of(*trees: list[list[int]]) -> dict[str, torch.Tensor]:
    """One row per tree (a row holds one tree: ``max_packed_tokens`` = the largest tree)."""
    built = [Tree.from_sequences(t) for t in trees]
    return TreeDataCollator(max_packed_tokens=max(t.num_tokens for t in built))([t.to_dict() for t in built])


@pytest.mark.parametrize(("family", "overrides"), MODELS)
def test_a_branch_past_the_switch_is_refused_before_the_forward(family, overrides):
    model = tiny_model(family, **overrides)
    calls = []
    model.model.register_forward_hook(lambda *args: calls.append(1))
    with pytest.raises(ValueError, match=rf"{SWITCH}.*longest branch has 40 tokens.*max_branch_tokens="):
        tree_causal_lm_loss(model, batch_of(branches([40, 13, 16])), self_check=False)
    assert not calls  # refused before any forward


@pytest.mark.parametrize(("family", "overrides"), MODELS)
def test_a_short_tree_beside_a_long_one_in_another_row_is_refused(family, overrides):
    model = tiny_model(family, **overrides)
    with pytest.raises(ValueError, match="longest branch has 40 tokens"):
        tree_causal_lm_loss(model, batch_of(branches([13, 16]), branches([40, 12], seed=1)), self_check=False)


@pytest.mark.parametrize(("family", "overrides"), MODELS)
def test_below_the_switch_trees_train_exactly(family, overrides):
    """With the self-check on: its probe stays within the switch (a longer probe would fail an exact model)."""
    model = tiny_model(family, **overrides)
    longest = longest_exact_branch(model.config)
    assert longest == (SWITCH if family == "phi3" else SWITCH - 1)
    trees = [branches([longest, 13, 16]), branches([20, longest - 2], seed=1)]
    loss = tree_causal_lm_loss(model, batch_of(*trees), self_check=True)
    loss.backward()
    tree_grads = grads_of(model)
    model.zero_grad()
    total, divisor = per_branch_loss(model, [b for t in trees for b in t], None)
    reference = total / divisor
    reference.backward()
    # HF's RMSNorm computes in float32 inside float64 models: ~1e-7 on shared tokens; crossing the switch gave 1e-2
    assert relative_error(loss, reference) < 1e-9
    assert max_grad_relative_error(tree_grads, grads_of(model)) < 1e-6


def test_switches_are_read_per_layer_type_and_only_for_length_dependent_ropes():
    plain = tiny_model("llama").config
    assert length_switches(plain) == [] and longest_exact_branch(plain) is None
    check_rope_lengths(plain, torch.arange(10_000)[None])  # no switch: nothing to refuse
    config = tiny_model("phi3", **LONGROPE).config
    (switch,) = length_switches(config)
    assert (switch.rope_type, switch.switch, switch.longest_exact) == ("longrope", SWITCH, SWITCH)
    config.rope_parameters = {"full_attention": dict(LONGROPE["rope_parameters"]), "sliding_attention": {}}
    assert [s.layer_type for s in length_switches(config)] == ["full_attention"]


def test_model_specific_rotaries():
    """HunYuan turns "dynamic" with a fixed alpha into static NTK-alpha frequencies (no switch); PhiMoE switches its
    attention scale (short/long mscale) at original_max_position_embeddings."""
    alpha = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 1.0, "alpha": 1000.0}
    assert length_switches(transformers.AutoConfig.for_model("hunyuan_v1_dense", rope_parameters=alpha)) == []
    mscale = {**LONGROPE["rope_parameters"], "short_mscale": 1.0, "long_mscale": 1.2}
    phimoe = transformers.AutoConfig.for_model("phimoe", **{**LONGROPE, "rope_parameters": mscale})
    assert [s.longest_exact for s in length_switches(phimoe)] == [SWITCH]


def test_trainer_refuses_a_dataset_crossing_the_switch_before_training(tmp_path):
    """Before the first step, not at the first long batch: the whole training set's longest branch as the collator
    passes it on. The fix in the message (cut branches at the switch) trains."""
    rows = [Tree.from_sequences(branches([12, 16])).to_dict(), Tree.from_sequences(branches([40], seed=1)).to_dict()]
    dataset = datasets.Dataset.from_list(rows)

    def trainer(**packing):
        args = TreeTrainingArguments(output_dir=str(tmp_path), report_to=[], max_packed_tokens=64, **packing)
        return TreeTrainer(model=tiny_model("phi3", **LONGROPE), args=args, train_dataset=dataset)

    with pytest.raises(ValueError, match=r"training dataset \(max_branch_tokens=64\)'s longest branch has 40 tokens"):
        trainer()
    trainer(max_branch_tokens=SWITCH, overlong="truncate")
