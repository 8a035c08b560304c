"""The first-use self-check (hf_tree.models.check): a model that would train silently wrong on trees is refused.

Oracle: the probe compares the packed tree with its branches run alone with the model's own attention; a layer
patched to mix tokens across the row (a cumulative sum over the sequence, as a recurrent mixer would) must be
named in the ``ValueError``, and an exact model (Llama) must pass without changing RNG state or train/eval modes.
"""

from __future__ import annotations

import os
import types

import pytest
import torch
import transformers

from hf_tree import Tree, TreeDataCollator, tree_causal_lm_loss
from hf_tree.models.check import (
    NOT_TREE_AWARE_MODULES,
    SELF_CHECK_ENV_VAR,
    check_model_for_trees,
    probe_tree_exactness,
    self_check_setting,
)
from hf_tree.models.probe import (
    DEFAULT_PROBE_REACH,
    FLOOR_FACTOR,
    INVARIANCE_FRACTION,
    MAX_PROBE_REACH,
    MIN_FLOOR,
    bound,
    probe_shape,
)
from tests.helpers import hybrid_model, tiny_config, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tree_batch():
    tree = Tree.from_sequences([[5, 6, 7, 8, 9], [5, 6, 7, 10, 11, 12]])
    return TreeDataCollator(max_packed_tokens=16)([tree.to_dict()])


def leak_across_the_row(model: torch.nn.Module, layer: int = 1) -> None:
    """Make one decoder layer's MLP add a running sum over the sequence: siblings then see each other."""
    mlp = model.model.layers[layer].mlp
    plain = type(mlp).forward

    def forward(self, x):
        out = plain(self, x)  # a mixture-of-experts MLP also returns its router scores
        if isinstance(out, tuple):
            return (out[0] + 0.1 * x.cumsum(dim=1), *out[1:])
        return out + 0.1 * x.cumsum(dim=1)

    mlp.forward = types.MethodType(forward, mlp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_model_passes_without_side_effects(dtype):
    model = tiny_model(dtype=dtype)
    model.train()
    model.model.layers[0].eval()  # a mixed state must come back as it was
    modes = [m.training for m in model.modules()]
    rng = torch.get_rng_state()
    difference = probe_tree_exactness(model)
    assert difference < 1e-5 if dtype == torch.float32 else difference < 5e-2  # per-token relative, final layer
    assert torch.equal(torch.get_rng_state(), rng)
    assert [m.training for m in model.modules()] == modes
    assert model.config._attn_implementation == "tree_flash"


def test_leaking_layer_is_refused_by_the_loss():
    model = tiny_model(dtype=torch.float32)
    leak_across_the_row(model, layer=1)
    with pytest.raises(ValueError) as error:
        tree_causal_lm_loss(model, tree_batch())
    message = str(error.value)
    assert "LlamaForCausalLM" in message
    assert "layer 1 (LlamaDecoderLayer)" in message
    assert "mlp (LlamaMLP)" in message  # the submodule whose input agrees but output does not
    assert "self_attn" not in message  # layer 1's attention saw equal inputs and is exact
    assert "differs from its branches" in message


def test_leaking_layer_passes_with_the_opt_out(monkeypatch):
    model = tiny_model(dtype=torch.float32)
    leak_across_the_row(model)
    assert torch.isfinite(tree_causal_lm_loss(model, tree_batch(), self_check=False))
    other = tiny_model(dtype=torch.float32)
    leak_across_the_row(other)
    monkeypatch.setenv(SELF_CHECK_ENV_VAR, "0")
    assert torch.isfinite(tree_causal_lm_loss(other, tree_batch()))
    monkeypatch.setenv(SELF_CHECK_ENV_VAR, "1")
    with pytest.raises(ValueError, match="not tree-exact"):  # an opted-out result does not excuse a later check
        tree_causal_lm_loss(other, tree_batch())


def test_check_runs_once_per_model_instance():
    model = tiny_model(dtype=torch.float32)
    calls = []
    handle = model.model.register_forward_hook(lambda *args: calls.append(1))
    check_model_for_trees(model)
    first = len(calls)
    # head detection; tree, 3 branches alone, 2 padded batches, 3 branches alone in float64 (a float32 model's
    # floor); the tree twice with one sibling replaced
    assert first == 12
    tree_causal_lm_loss(model, tree_batch())
    assert len(calls) == first + 1  # only the loss's own forward
    handle.remove()


def test_peft_wrapped_leak_is_refused():
    from peft import LoraConfig, get_peft_model

    model = tiny_model(dtype=torch.float32)
    leak_across_the_row(model, layer=0)
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ValueError, match=r"layer 0 \(LlamaDecoderLayer\)"):
        tree_causal_lm_loss(peft_model, tree_batch())


def test_known_non_tree_aware_mixer_is_refused_by_name():
    config = transformers.AutoConfig.for_model("rwkv", vocab_size=64, hidden_size=32, num_hidden_layers=2)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="tree_flash")
    assert "RwkvSelfAttention" in NOT_TREE_AWARE_MODULES
    with pytest.raises(ValueError, match="RwkvSelfAttention: RWKV time mixing"):
        tree_causal_lm_loss(model, tree_batch())


def test_leak_is_caught_under_a_trainers_bf16_autocast():
    """Trainers run the model under autocast. An autocast around the call is switched off for the probe (an exact
    float32 check); accelerate's autocast inside the model's forward is not, so the probe measures its rounding floor
    in the autocast dtype: an exact model passes and a leaking one is still refused."""
    exact, leaking = tiny_model(dtype=torch.float32), tiny_model(dtype=torch.float32)
    leak_across_the_row(leaking)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ValueError, match=r"not tree-exact.*for torch\.float32"):
            tree_causal_lm_loss(leaking, tree_batch())
    for model in (exact, leaking):  # what accelerate.prepare does with mixed_precision="bf16"
        model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
    assert torch.isfinite(tree_causal_lm_loss(exact, tree_batch()))
    with pytest.raises(ValueError, match=r"not tree-exact.*for torch\.bfloat16"):
        tree_causal_lm_loss(leaking, tree_batch(), self_check=True)


def test_training_argument_opts_out(monkeypatch, tmp_path):
    from hf_tree.trainer import TreeTrainingArguments

    monkeypatch.setenv(SELF_CHECK_ENV_VAR, "1")
    model = tiny_model(dtype=torch.float32)
    leak_across_the_row(model)
    on = TreeTrainingArguments(output_dir=str(tmp_path), report_to=[])
    with pytest.raises(ValueError, match="not tree-exact"):
        tree_causal_lm_loss(model, tree_batch(), self_check=self_check_setting(on.tree_self_check))
    off = TreeTrainingArguments(output_dir=str(tmp_path), report_to=[], tree_self_check=False)
    assert torch.isfinite(tree_causal_lm_loss(model, tree_batch(), self_check=self_check_setting(off.tree_self_check)))
    assert os.environ[SELF_CHECK_ENV_VAR] == "1"  # the argument changes nothing process-wide


def look_back(model: torch.nn.Module, distance: int, layer: int = 1, scale: float = 0.5) -> None:
    """Make one decoder layer's MLP add ``scale`` x the hidden state ``distance`` tokens back in the row: a block
    that reads farther than the old 14-token probe could see."""
    mlp = model.model.layers[layer].mlp
    plain = type(mlp).forward

    def forward(self, x):
        shifted = torch.zeros_like(x)
        shifted[:, distance:] = x[:, :-distance]
        return plain(self, x) + scale * shifted

    mlp.forward = types.MethodType(forward, mlp)


@pytest.mark.parametrize("distance", [1, 4, 32, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_reach_up_to_the_default_is_refused(distance, dtype):
    """The old probe (branches of at most 14 tokens) passed a 32-token look-back that then trained with gradient
    error 1.7; the default probe covers DEFAULT_PROBE_REACH tokens back."""
    model = tiny_model(dtype=dtype)
    look_back(model, distance)
    with pytest.raises(ValueError, match=r"not tree-exact.*layer 1 \(LlamaDecoderLayer\).*mlp \(LlamaMLP\)"):
        tree_causal_lm_loss(model, tree_batch())


def test_probe_shape_covers_declared_reach_and_stays_within_positions():
    plain = probe_shape(tiny_config("llama", max_position_embeddings=4096))
    assert plain.reach >= DEFAULT_PROBE_REACH
    windowed = probe_shape(tiny_config("mistral", sliding_window=1000, max_position_embeddings=4096))
    assert windowed.suffixes[0] > 1000 and windowed.reach >= 1000  # a window counted in packed positions shows
    assert windowed.longest_branch <= 4096
    table = probe_shape(tiny_config("llama", max_position_embeddings=64))
    assert table.longest_branch <= 64  # never past the position table
    switch = probe_shape(tiny_config("llama", max_position_embeddings=4096), length_limit=100)
    assert switch.longest_branch <= 100  # never past a length switch (see hf_tree.models.length_rope)
    assert MAX_PROBE_REACH >= DEFAULT_PROBE_REACH


def test_a_sliding_window_past_the_old_probe_is_checked():
    """A window of 40 is longer than the old probe's branches; packing it by packed distance would be caught now."""
    model = tiny_model("mistral", dtype=torch.float32, sliding_window=40)
    assert probe_tree_exactness(model) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_leak_below_the_rounding_of_the_dtype_is_refused(dtype):
    """LFM2 without its tree-aware convolution leaks ~7e-4 (relative) into the first tokens of each sibling: below
    bfloat16's rounding, so comparing the tree with the branches alone cannot see it (the old 5e-2 bound let it
    train with gradient error 5.7x the bfloat16 floor). Replacing a sibling's tokens must leave the other branches
    bit for bit unchanged, as it does in a padded batch: that sees it in every dtype."""
    from hf_tree.models.mixers.install import install_tree_mixers, uninstall_tree_mixers

    exact = hybrid_model("lfm2").to(dtype)
    assert probe_tree_exactness(exact) < 5e-2
    uninstall_tree_mixers()
    try:
        leaking = hybrid_model("lfm2").to(dtype)
        with pytest.raises(ValueError, match="when one sibling branch's tokens are replaced|differs from its branches"):
            probe_tree_exactness(leaking)
    finally:
        install_tree_mixers()


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_exact_models_pass_in_half_precision(family, dtype):
    """No false alarm: the bound follows the rounding floor measured on the model (gpt-oss: MoE routing moves the
    other rows of a padded batch too)."""
    assert probe_tree_exactness(tiny_model(family, dtype=dtype)) < 5e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_leak_in_a_mixture_of_experts_model_is_refused(dtype):
    """The reference runs replay the tree's expert routing (a float16 tie between two experts' logits flips on
    rounding alone: hf_tree.models.pinned_routing); a leak into the router's input still shows in the experts'
    outputs and is refused."""
    model = tiny_model("gpt_oss", dtype=dtype)
    leak_across_the_row(model, layer=1)
    with pytest.raises(ValueError, match=r"not tree-exact.*layer 1 \(GptOssDecoderLayer\)"):
        probe_tree_exactness(model)


def test_pinned_routing_replays_the_recorded_experts():
    from hf_tree.models.pinned_routing import recording_routing, replaying_routing

    logits = torch.tensor([[0.5, 0.1, 0.1, -1.0], [0.0, 1.0, 2.0, 3.0]])
    with recording_routing({4}) as routing:
        torch.topk(logits, 2)
    assert [r.tolist() for r in routing] == [[[0, 1], [3, 2]]]
    routing[0][0] = torch.tensor([0, 2])  # the other side of the tie
    flipped = logits.flip(0)  # this run's token 0 is the recorded row 1, its token 1 routes on its own
    with replaying_routing({4}, routing, torch.tensor([1, -1])):
        values, indices = flipped.topk(2)
    assert indices.tolist() == [[3, 2], [0, 1]]
    assert torch.equal(values, torch.gather(flipped, 1, indices))
    with replaying_routing({4}, routing, torch.tensor([0, 1])):
        assert torch.topk(logits, 2).indices.tolist() == [[0, 2], [3, 2]]
        assert torch.topk(logits[:, :3], 2).indices.tolist() == [[0, 1], [2, 1]]  # not an expert axis


def test_float32_floor_is_the_models_own_rounding():
    """Pure Mamba2 in float32 (its SSD scan over the 257-token sibling rounds 8e-7 away from its float64 math) was
    refused at 6.5e-7 against 8 units of float32 roundoff (4.8e-7); the floor is now its own float32 run against
    float64, the parameters come back as the very same tensors, and a leak is still refused."""
    from tests.helpers import hybrid_model

    settings = dict(hidden_size=32, num_heads=4, head_dim=16, n_groups=1, chunk_size=8)  # the zoo's Mamba2
    model = hybrid_model("mamba2", **settings).float()
    before = [(p.data_ptr(), p.detach().clone()) for p in model.parameters()]
    assert probe_tree_exactness(model) < 2e-6
    for p, (pointer, values) in zip(model.parameters(), before):
        assert p.data_ptr() == pointer and p.dtype == torch.float32 and torch.equal(p, values)
    leaking = hybrid_model("mamba2", **settings).float()
    block = leaking.backbone.layers[1]
    plain = type(block).forward

    def forward(self, hidden_states, *args, **kwargs):
        return plain(self, hidden_states, *args, **kwargs) + 1e-3 * hidden_states.cumsum(dim=1)

    block.forward = types.MethodType(forward, block)
    with pytest.raises(ValueError, match=r"not tree-exact.*layer 1 \(Mamba2Block\)"):
        probe_tree_exactness(leaking)


def test_bound_follows_the_measured_floor():
    assert bound(0.0, torch.bfloat16) == FLOOR_FACTOR * MIN_FLOOR[torch.bfloat16]
    assert bound(1e-2, torch.bfloat16) == FLOOR_FACTOR * 1e-2
    assert bound(float("nan"), torch.float32) == FLOOR_FACTOR * MIN_FLOOR[torch.float32]
    assert bound(0.0, torch.bfloat16, INVARIANCE_FRACTION) <= MIN_FLOOR[torch.bfloat16] / 2  # half an ulp
