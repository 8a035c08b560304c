"""Issue 43: multi-head latent attention (value head size != query/key head size: DeepSeek V2/V3) and Llama 4's
chunked attention through every CPU tree engine, against each branch run alone with the model's own attention.

Both families keep float32 inside a float64 model: DeepSeek's MoE router (``F.linear`` in float32) and Llama 4's
RoPE (complex float32), norms and router. Their losses match per branch at float64 level (1e-9) and their gradients
at the float32 floor (measured 1e-7 .. 4e-7; a sibling leak moves them by percents).
"""

from __future__ import annotations

import contextlib
from functools import partial

import pytest
import torch

from hf_tree import Tree, TreeDataCollator, tree_causal_lm_loss
from hf_tree.attention import (
    BACKEND_ENV_VAR,
    TreeAttentionOptions,
    blocked_tree_attention,
    dense_tree_mask,
    flex_tree_attention,
    reference_tree_attention,
)
from hf_tree.attention.flex import tree_block_mask
from hf_tree.attention.segments import segment_tree_attention
from hf_tree.models.router_loss import router_aux_loss_coef
from tests.helpers import (
    float32_floor_grad_error,
    float64_family_norms,
    float64_norms,
    grads_of,
    per_branch_forest_loss,
    relative_error,
    run,
    tiny_model,
)
from tests.workloads import TINY_DEEPSEEK_V3, TINY_LLAMA4, forest, packed_rows, qkv

VOCAB = 97
LOSS_TOLERANCE = 1e-9
GRAD_TOLERANCE = 1e-5  # float32 routers / RoPE inside float64 models (measured <= 4e-7)
DEEPSEEK = dict(TINY_DEEPSEEK_V3, experts_implementation="eager")  # grouped_mm experts refuse float64
MLA_FAMILIES = {"deepseek_v2": dict(DEEPSEEK, q_lora_rank=None), "deepseek_v3": DEEPSEEK}
LLAMA4 = TINY_LLAMA4
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py


def tree_and_branch_runs(model, groups, batch, backward: bool = True):
    """(tree loss, per-branch loss, tree grads, per-branch grads); no gradients with ``backward=False``."""
    with contextlib.nullcontext() if backward else torch.no_grad():
        model.zero_grad()
        loss = tree_causal_lm_loss(model, batch)
        if backward:
            loss.backward()
        tree_grads = grads_of(model)
        model.zero_grad()
        reference = per_branch_forest_loss(model, groups)
        if backward:
            reference.backward()
    return loss.detach(), reference.detach(), tree_grads, grads_of(model)


# ----------------------------------------------------------------------------------------------------- MLA
@pytest.mark.parametrize("engine", ["segments", "blocked", "reference"])
@pytest.mark.parametrize("family", sorted(MLA_FAMILIES))
def test_mla_models_match_per_branch(family, engine, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV_VAR, engine)
    groups, batch = forest(seed=1)
    assert batch["input_ids"].shape[0] > 1
    with float64_family_norms():
        model = tiny_model(family, vocab_size=VOCAB, **MLA_FAMILIES[family])
        attention = model.model.layers[0].self_attn
        assert attention.qk_head_dim != attention.v_head_dim
        loss, reference, tree_grads, ref_grads = tree_and_branch_runs(model, groups, batch)
    assert relative_error(loss, reference) <= LOSS_TOLERANCE
    assert float32_floor_grad_error(tree_grads, ref_grads) <= GRAD_TOLERANCE


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_mla_flex_forward_matches_per_branch(monkeypatch):
    """Flex has no CPU backward: the loss value checks the padded heads through its kernel."""
    monkeypatch.setenv(BACKEND_ENV_VAR, "flex")
    groups, batch = forest(seed=2)
    with float64_family_norms():
        model = tiny_model("deepseek_v3", vocab_size=VOCAB, **DEEPSEEK)
        loss, reference, _, _ = tree_and_branch_runs(model, groups, batch, backward=False)
    assert relative_error(loss, reference) <= LOSS_TOLERANCE


def test_mla_lora_matches_per_branch():
    from peft import LoraConfig, get_peft_model

    groups, batch = forest(seed=3)
    targets = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    with float64_family_norms():
        model = tiny_model("deepseek_v3", vocab_size=VOCAB, **DEEPSEEK)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
        for name, parameter in model.named_parameters():  # LoRA's B starts at zero: give A's gradient a signal
            if "lora_B" in name:
                torch.nn.init.normal_(parameter, std=0.1)
        loss, reference, tree_grads, ref_grads = tree_and_branch_runs(model, groups, batch)
    assert tree_grads.keys() == ref_grads.keys() and all("lora_" in name for name in tree_grads)
    assert relative_error(loss, reference) <= LOSS_TOLERANCE
    assert float32_floor_grad_error(tree_grads, ref_grads) <= GRAD_TOLERANCE


def test_deepseek_declares_no_router_loss_under_trls_default():
    """DeepSeek V2/V3 balance experts without an auxiliary loss (a bias): their config has no
    ``router_aux_loss_coef``, so TRL's default (the architecture's coefficient) adds none, and neither do the
    tree passes, also with ``output_router_logits=True``."""
    for family, settings in MLA_FAMILIES.items():
        model = tiny_model(family, vocab_size=VOCAB, output_router_logits=True, **settings)
        assert not hasattr(model.config, "router_aux_loss_coef")
        assert router_aux_loss_coef(model) == 0.0


def test_mla_dual_mode_is_the_models_own_attention():
    """Without kv_end, tree_flash is sdpa (which takes value heads of another size): same logits, also padded."""
    model = tiny_model("deepseek_v3", vocab_size=VOCAB, **DEEPSEEK)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 0, 0]])
    mask = (ids > 0).long()
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=mask).logits
        model.set_attn_implementation("sdpa")
        theirs = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(ours, theirs)


# ------------------------------------------------------------------------------------- chunked attention
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("case", [dict(attention_chunk=4), dict(attention_chunk=5, sliding_window=3)])
def test_blocked_and_flex_match_reference_with_chunks(case):
    kv_end, position_ids = packed_rows(seed=21)
    assert int(position_ids.max()) >= 3 * case["attention_chunk"]  # branches span several chunks
    q, k, v = qkv(kv_end, (4, 2), torch.float64)
    options = dict(scaling=0.37, **case)
    ref_out, ref_grads = run(reference_tree_attention, q, k, v, kv_end, position_ids, **options)
    out, grads = run(partial(blocked_tree_attention, tile_elements=64), q, k, v, kv_end, position_ids, **options)
    assert relative_error(out, ref_out) <= LOSS_TOLERANCE
    assert all(relative_error(g, r) <= LOSS_TOLERANCE for g, r in zip(grads, ref_grads, strict=True))
    flex_out, _ = run(flex_tree_attention, q, k, v, kv_end, position_ids, backward=False, **options)
    assert relative_error(flex_out, ref_out) <= LOSS_TOLERANCE
    with pytest.raises(ValueError, match="attention_chunk=.*use blocked_tree_attention"):
        segment_tree_attention(q, k, v, kv_end, TreeAttentionOptions(**options))


def test_chunk_mask_is_each_branchs_own_and_block_summaries_are_sound():
    """A packed token sees exactly the keys of its branch in its own chunk (chunk = depth // size, as
    transformers' chunked mask counts a branch's tokens), and the Flex block mask never skips a visible pair."""
    kv_end, position_ids = packed_rows(seed=22, max_packed_tokens=120, pad_to_multiple_of=16)
    mask = dense_tree_mask(kv_end, position_ids, attention_chunk=4)
    tree = dense_tree_mask(kv_end)
    same_chunk = position_ids[:, :, None] // 4 == position_ids[:, None, :] // 4
    assert torch.equal(mask, tree & same_chunk) and not torch.equal(mask, tree)
    batch, n = kv_end.shape
    block_mask = tree_block_mask(kv_end, position_ids, block_size=8, attention_chunk=4)
    exact_any = mask.view(batch, n // 8, 8, n // 8, 8).any(dim=(2, 4))
    exact_all = mask.view(batch, n // 8, 8, n // 8, 8).all(dim=(2, 4))
    full_only = type(block_mask).from_kv_blocks(
        block_mask.full_kv_num_blocks, block_mask.full_kv_indices, BLOCK_SIZE=8, seq_lengths=(n, n)
    )
    assert (block_mask.to_dense()[:, 0].bool() >= exact_any).all()
    assert (full_only.to_dense()[:, 0].bool() <= exact_all).all()


def deep_forest():
    """A tree whose branches run 3-5 chunks of 4 deep (a shared prefix of 6, siblings of 5-11), and another tree."""
    prefix = [3, 14, 15, 92, 65, 35]
    sequences = [prefix + [8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2], prefix + [11, 12, 13, 14, 15], prefix + [8, 9, 70]]
    groups = [(sequences, None), ([[40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [40, 41, 42, 50]], None)]
    collator = TreeDataCollator(max_packed_tokens=48, pad_to_multiple_of=8)
    return groups, collator([Tree.from_sequences(s, m).to_dict() for s, m in groups])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("engine", ["cpu", "blocked", "reference", "flex"])
def test_llama4_chunked_attention_matches_per_branch(engine, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV_VAR, engine)
    groups, batch = deep_forest()
    with float64_norms():
        model = tiny_model("llama4_text", vocab_size=VOCAB, **LLAMA4)
        assert model.config.layer_types == ["chunked_attention", "full_attention"]
        flex = engine == "flex"  # no CPU backward: the loss only
        loss, reference, tree_grads, ref_grads = tree_and_branch_runs(model, groups, batch, backward=not flex)
        # the chunks matter: the same branches with one chunk over all of them give another loss
        model.config.attention_chunk_size = 64
        unchunked = per_branch_forest_loss(model, groups).detach()
    assert relative_error(unchunked, reference) > 1e-6  # 4.4e-5: far above the 1e-9 the tree is held to
    assert relative_error(loss, reference) <= LOSS_TOLERANCE
    if not flex:
        assert float32_floor_grad_error(tree_grads, ref_grads) <= GRAD_TOLERANCE


def test_llama4_temperature_tuning_by_packed_index_is_refused_on_long_rows():
    """Llama 4's NoPE layers scale queries by packed index: exact only on rows shorter than floor_scale."""
    groups, batch = deep_forest()
    model = tiny_model("llama4_text", vocab_size=VOCAB, **LLAMA4, floor_scale=8)
    with pytest.raises(ValueError, match="floor_scale=8"):
        tree_causal_lm_loss(model, batch, self_check=False)
    model = tiny_model("llama4_text", vocab_size=VOCAB, **LLAMA4, floor_scale=batch["input_ids"].shape[1] + 1)
    tree_causal_lm_loss(model, batch, self_check=False)  # rows shorter than floor_scale run


def test_hrm_text_loads_with_tree_flash_and_matches_per_branch():
    """HRM-text refuses flash attention with its PrefixLM overlay; tree_flash is not flash-attn there."""
    groups, batch = forest(seed=4)
    model = tiny_model("hrm_text", dtype=torch.float32, vocab_size=VOCAB)
    assert model.config.prefix_lm and model.config._attn_implementation == "tree_flash"
    loss, reference, tree_grads, ref_grads = tree_and_branch_runs(model, groups, batch)
    assert relative_error(loss, reference) <= 1e-5
    assert float32_floor_grad_error(tree_grads, ref_grads) <= 1e-4


def test_flash_attn_refuses_chunks_by_name():
    """flash-attn has sliding windows but no chunks: refused with the reason (``cuda`` then runs ``flex``)."""
    from hf_tree.attention.flash import flash_attn_refusal

    kv_end, _ = packed_rows(seed=23)
    q, _, v = qkv(kv_end, (4, 2), torch.bfloat16)
    assert "no chunked attention" in flash_attn_refusal(q, v, attention_chunk=4)
