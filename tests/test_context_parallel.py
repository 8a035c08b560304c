"""Tree context parallel pieces in one process: work counts, shard plans, batch sharding, the CP attention path.

The 2-process equivalence runs are in test_context_parallel_distributed.py. Here the CP attention path runs
with a one-rank plan (no collective): it must equal the plain tree forward, including sliding windows,
softcapping, attention sinks and small query blocks, which is the part of CP that does not depend on the all-gather.
"""

from __future__ import annotations

import random

import pytest
import torch

from hf_tree import Tree, TreeDataCollator, tree_causal_lm_loss
from hf_tree.attention.mask import dense_tree_mask
from hf_tree.parallel import (
    STRATEGIES,
    ContextParallelConfig,
    plan_context_parallel,
    shard_batch_for_context_parallel,
    tree_context_parallel,
    visible_keys_per_query,
)
from tests.helpers import VOCAB, float64_norms, grads_of, max_grad_relative_error, relative_error, tiny_model
from tests.workloads import TINY_LLAMA4, agent_row, deep_forest_rows, grpo_row, make_batch, random_tree_branches

ROWS = {"grpo": grpo_row, "agent": agent_row, "deep_forest": deep_forest_rows}


def random_batch(seed: int, max_packed_tokens: int = 64) -> dict[str, torch.Tensor]:
    rng = random.Random(seed)
    trees = [Tree.from_sequences(*random_tree_branches(rng, rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
    collator = TreeDataCollator(max_packed_tokens=max_packed_tokens, pad_to_multiple_of=rng.choice([None, 5, 8]))
    return collator([t.to_dict() for t in trees])


# ----------------------------------------------------------------------------------------------- work
@pytest.mark.parametrize("seed", range(6))
def test_visible_keys_agree_with_the_dense_mask(seed):
    kv_end = random_batch(seed)["kv_end"]
    torch.testing.assert_close(visible_keys_per_query(kv_end), dense_tree_mask(kv_end).sum(-1))


def test_a_packed_trees_work_is_its_depth_plus_one():
    batch = make_batch(agent_row, 128)
    real = batch["input_ids"][0] != 0
    work = visible_keys_per_query(batch["kv_end"])[0]
    torch.testing.assert_close(work[real], batch["position_ids"][0][real] + 1)


# ----------------------------------------------------------------------------------------------- plans
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", range(4))
def test_plans_cover_every_position_once_with_equal_shards(strategy, cp_size, seed):
    kv_end = random_batch(seed)["kv_end"]
    plan = plan_context_parallel(kv_end, cp_size, strategy)
    flat = plan.indices.flatten()
    assert plan.indices.shape == (cp_size, plan.shard_len) and plan.shard_len >= 1
    assert torch.equal(torch.sort(flat).values, torch.arange(plan.num_slots))
    assert bool((plan.indices[:, 1:] > plan.indices[:, :-1]).all())  # ascending per rank
    work = visible_keys_per_query(kv_end).sum(0)
    padding = plan.num_slots - plan.num_tokens
    assert int(plan.work.sum()) == int(work.sum()) + padding * kv_end.shape[0]
    owner, local = plan.slot_owner()
    assert torch.equal(plan.indices[owner, local], torch.arange(plan.num_slots))


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 5])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_rows_shorter_than_the_group_get_padding_slots(num_tokens, strategy):
    kv_end = torch.arange(1, num_tokens + 1)[None]
    plan = plan_context_parallel(kv_end, 4, strategy)
    assert plan.num_slots >= max(num_tokens, 4)
    assert int((plan.indices < num_tokens).sum()) == num_tokens


@pytest.mark.parametrize("row", list(ROWS))
def test_balanced_split_spreads_work_better_than_equal_tokens(row):
    kv_end = make_batch(ROWS[row], 128)["kv_end"]
    plan = plan_context_parallel(kv_end, 2, "balanced", chunks_per_rank=4)
    assert plan.work_balance <= plan.naive_work_balance
    assert plan.shard_len <= -(-plan.num_tokens // 8) * 4  # equal tokens: at most chunk rounding


def test_balanced_and_zigzag_fix_a_long_causal_row_that_naive_leaves_unbalanced():
    kv_end = torch.full((1, 4096), 4096)
    reports = {s: plan_context_parallel(kv_end, 4, s).report() for s in STRATEGIES}
    assert reports["naive"]["work_balance"] > 1.7
    assert reports["zigzag"]["work_balance"] == pytest.approx(1.0)
    assert reports["balanced"]["work_balance"] < 1.02
    assert reports["contiguous"]["work_balance"] < 1.01
    assert reports["contiguous"]["shard_len"] > 1.9 * reports["balanced"]["shard_len"]  # the memory it costs


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(cp_size=0), "cp_size=0"),
        (dict(cp_size=2, strategy="ring"), "strategy='ring'"),
        (dict(cp_size=2, chunks_per_rank=0), "chunks_per_rank=0"),
    ],
)
def test_plan_options_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_context_parallel(torch.tensor([[2, 2]]), **kwargs)


def test_a_kv_end_that_is_not_a_tree_mask_is_refused():
    with pytest.raises(ValueError, match="kv_end is not a tree mask"):
        plan_context_parallel(torch.tensor([[1, 1, 3]]), 2)


# ----------------------------------------------------------------------------------------------- sharding
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("seed", range(3))
def test_sharding_partitions_the_loss_edges_and_keeps_the_global_divisor(strategy, seed):
    batch = random_batch(seed)
    num_rows, num_tokens = batch["kv_end"].shape
    plan = plan_context_parallel(batch["kv_end"], 3, strategy)
    edges = []
    for rank in range(3):
        local = shard_batch_for_context_parallel(batch, plan, rank, pad_token_id=7)
        ids = plan.indices[rank]
        for key, pad in (("input_ids", 7), ("position_ids", 0)):
            assert local[key].shape == (num_rows, plan.shard_len)
            real = ids < num_tokens
            assert torch.equal(local[key][:, real], batch[key][:, ids[real]])
            assert bool((local[key][:, ~real] == pad).all())
        assert torch.equal(local["num_loss_items"], batch["num_loss_items"])
        keep = local["loss_weights"] != 0
        row = local["loss_positions"][keep] // plan.shard_len
        column = ids[local["loss_positions"][keep] % plan.shard_len]
        edges += list(
            zip(
                (row * num_tokens + column).tolist(),
                local["loss_targets"][keep].tolist(),
                local["loss_weights"][keep].tolist(),
            )
        )
    original = zip(batch["loss_positions"].tolist(), batch["loss_targets"].tolist(), batch["loss_weights"].tolist())
    assert sorted(edges) == sorted(original)


def test_a_rank_without_loss_edges_gets_one_zero_weight_edge():
    batch = make_batch(lambda: [([[5, 6, 7]], None)], 16)
    plan = plan_context_parallel(batch["kv_end"], 2, "naive")
    local = shard_batch_for_context_parallel(batch, plan, 1)
    assert local["loss_positions"].tolist() == [0] and local["loss_weights"].tolist() == [0.0]


def test_sharding_refuses_a_batch_the_plan_was_not_made_for():
    plan = plan_context_parallel(torch.tensor([[2, 2, 3]]), 2)
    with pytest.raises(ValueError, match="plan was made for 3"):
        shard_batch_for_context_parallel(make_batch(grpo_row, 128), plan, 0)


# ----------------------------------------------------------------------------------------------- CP attention path
# name: (model overrides, dtype, tolerance). The bound follows the model's real internal precision: a model that
# computes a part in float32 even as a float64 model gets the float32 bound. Gemma2's norm computes in float32 (not
# patched by float64_norms): it runs in float32. Llama4 runs in float64 but its RoPE and router compute in float32:
# the query blocks' matmul shapes round those float32 parts differently (4.7e-8 on CPUs without AVX-512).
FLOAT64_TOLERANCE, FLOAT32_TOLERANCE = 1e-10, 1e-5
MODELS = {
    "llama": (dict(family="llama"), torch.float64, FLOAT64_TOLERANCE),
    "qwen3": (dict(family="qwen3"), torch.float64, FLOAT64_TOLERANCE),
    "mistral_sliding_window": (dict(family="mistral", sliding_window=3), torch.float64, FLOAT64_TOLERANCE),
    "gpt_oss_sinks_sliding": (dict(family="gpt_oss"), torch.float64, FLOAT64_TOLERANCE),
    "gemma2_softcap_sliding": (
        dict(family="gemma2", head_dim=8, sliding_window=3, attn_logit_softcapping=0.5),
        torch.float32,
        FLOAT32_TOLERANCE,
    ),
    # Chunks of 4 depths on layer 0 (the blocks select the ancestors of their chunks); float32 RoPE and router.
    "llama4_chunked": (dict(family="llama4_text", **TINY_LLAMA4), torch.float64, FLOAT32_TOLERANCE),
}


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("row", list(ROWS))
def test_one_rank_context_parallel_path_equals_the_plain_tree_forward(model_name, row):
    """The CP attention path (query blocks over global ids, masks from kv_end, SDPA or soft-capped math)
    must reproduce the plain tree run's loss and gradients."""
    overrides, dtype, tolerance = MODELS[model_name]
    with float64_norms():
        model = tiny_model(dtype=dtype, vocab_size=VOCAB, **overrides)
        batch = make_batch(ROWS[row], 72)
        loss = tree_causal_lm_loss(model, batch)
        loss.backward()
        expected = grads_of(model)
        model.zero_grad()
        plan = plan_context_parallel(batch["kv_end"], 1)
        local = shard_batch_for_context_parallel(batch, plan, 0)
        with tree_context_parallel(batch, plan, 0, query_block_size=5) as attention:
            cp_loss = tree_causal_lm_loss(model, local)
            cp_loss.backward()
    assert len(attention.blocks) > 1
    assert relative_error(cp_loss, loss) <= tolerance
    assert max_grad_relative_error(grads_of(model), expected) <= tolerance


def test_the_context_refuses_an_unsharded_batch_and_nesting():
    model = tiny_model(vocab_size=VOCAB)
    batch = make_batch(grpo_row, 128)
    plan = plan_context_parallel(batch["kv_end"], 1)
    with tree_context_parallel(batch, plan, 0):
        with pytest.raises(ValueError, match="cannot be nested"):
            with tree_context_parallel(batch, plan, 0):
                pass
    with pytest.raises(ValueError, match="plan was made for 7"):
        with tree_context_parallel(batch, plan_context_parallel(torch.arange(1, 8)[None], 1), 0):
            pass
    with tree_context_parallel(batch, plan_context_parallel(batch["kv_end"], 1), 0):
        with pytest.raises(ValueError, match="expects this rank's shard"):
            model(**{k: batch[k][:, :-1] for k in ("input_ids", "position_ids", "kv_end")})


def _torch_context_parallel_module():
    """The module that defines torch's public ``context_parallel`` (and keeps its private swap record)."""
    import inspect
    import sys

    from torch.distributed.tensor.experimental import context_parallel

    return sys.modules[inspect.unwrap(context_parallel).__globals__["__name__"]]


def test_torch_context_parallel_is_seen_through_its_swap_record(monkeypatch):
    """Off: nothing raised. A recorded swap of ``F.scaled_dot_product_attention`` (what ``context_parallel``
    does on entry; the real one runs in test_context_parallel_distributed.py): refused. A torch that no longer
    keeps the record: refused loudly instead of passing silently."""
    import torch.nn.functional as F

    from hf_tree.parallel import refuse_torch_context_parallel

    module = _torch_context_parallel_module()
    refuse_torch_context_parallel()
    monkeypatch.setitem(module._replaced_functions, F.scaled_dot_product_attention, ("sdpa", None))
    with pytest.raises(ValueError, match="accelerate's context parallel"):
        refuse_torch_context_parallel()
    monkeypatch.delattr(module, "_replaced_functions")
    with pytest.raises(ValueError, match=r"_replaced_functions.*Use the torch version"):
        refuse_torch_context_parallel()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [(dict(strategy="ring"), "strategy='ring'"), (dict(query_block_size=0), "query_block_size=0")],
)
def test_context_parallel_config_is_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ContextParallelConfig(**kwargs)


@pytest.mark.parametrize("row", list(ROWS))
def test_query_blocks_attend_only_to_ancestors_and_themselves(row):
    """Every key a block's queries see is selected, and the only earlier keys selected are the ancestors of
    the block's first query (a GRPO completion never computes against its siblings)."""
    batch = make_batch(ROWS[row], 128)
    plan = plan_context_parallel(batch["kv_end"], 1)
    mask = dense_tree_mask(batch["kv_end"]).any(0)  # [N, N] over the rows
    with tree_context_parallel(batch, plan, 0, query_block_size=4) as attention:
        for block in attention.blocks:
            queries = plan.indices[0][block.q0 : block.q1]
            queries = queries[queries < plan.num_tokens]
            if queries.numel() == 0:
                continue
            needed = torch.nonzero(mask[queries].any(0)).flatten()
            assert set(needed.tolist()) <= set(block.key_ids.tolist())
            first = int(queries[0])
            earlier = block.key_ids[block.key_ids < first]
            assert torch.equal(earlier, torch.nonzero(mask[first, :first]).flatten())
