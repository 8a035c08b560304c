"""Tree attention engines against the dense reference on real packed rows.

Oracle: ``reference_tree_attention`` (explicit softmax over ``dense_tree_mask``). Rows come from
``Tree.from_sequences`` + ``TreeDataCollator`` (several trees per row, padding, several rows), so the
engines see the ``kv_end``/``position_ids`` layouts training produces. float64 outputs and gradients
must match to 1e-9; in float32/bfloat16 an engine's error against float64 may be at most twice the
reference engine's own error in that dtype (the same math HF eager attention does).
"""

from __future__ import annotations

import inspect
from functools import partial

import pytest
import torch

from hf_tree.attention import (
    ENGINES,
    TreeAttentionEngine,
    TreeAttentionOptions,
    blocked,
    blocked_tree_attention,
    dense_tree_mask,
    flex_tree_attention,
    reference_tree_attention,
    select_backend,
    set_attention_backend,
)
from hf_tree.attention.flex import cached_tree_block_mask, clear_block_mask_cache, tree_block_mask
from hf_tree.attention.segments import (
    MIN_TOKENS_PER_CALL,
    cpu_tree_attention,
    plan_segments,
    segment_tree_attention,
)
from tests.helpers import detached64, relative_error, run
from tests.workloads import HEAD_DIM, long_segment_rows, long_segment_trees, packed_rows, qkv

TOLERANCE = 1e-9
HEADS = [(4, 4), (4, 2), (6, 1)]  # MHA, GQA, MQA
GPU_HEAD_DIM = 16  # flex's Triton kernels refuse head dims below 16 (HEAD_DIM is 8)
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py


def in64(options: dict) -> dict:
    """Engine options with the sink logits (if any) as a float64 leaf, for the float64 reference run."""
    return options if options.get("sinks") is None else dict(options, sinks=detached64([options["sinks"]])[0])


CASES = [
    pytest.param(dict(), id="plain"),
    pytest.param(dict(sliding_window=3), id="window3"),
    pytest.param(dict(softcap=1.5), id="softcap"),
    pytest.param(dict(sliding_window=5, softcap=2.0), id="window5-softcap"),
    pytest.param(dict(sinks=True), id="sinks"),
    pytest.param(dict(sliding_window=4, softcap=2.0, sinks=True), id="window4-softcap-sinks"),
]


def with_sinks(case: dict, num_heads: int, dtype: torch.dtype, device: str = "cpu") -> dict:
    """``case`` with ``sinks=True`` replaced by random per-head sink logits ``[H]`` (a leaf that needs grad), on the
    scale of the scores so that each sink takes a visible share of its rows."""
    if not case.get("sinks"):
        return case
    sinks = 2 * torch.randn(num_heads, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    return dict(case, sinks=sinks.to(device=device, dtype=dtype).requires_grad_())


@pytest.mark.parametrize(
    "heads, case, tile_elements",
    [pytest.param(h, c.values[0], 64, id=f"{c.id}-{h[0]}x{h[1]}-small-tiles") for h in HEADS for c in CASES]
    + [pytest.param((4, 2), {}, None, id="plain-default-tiles")],
)
def test_blocked_matches_reference_in_float64(heads, case, tile_elements):
    kv_end, position_ids = packed_rows(seed=len(case) + heads[1])
    q, k, v = qkv(kv_end, heads, torch.float64)
    options = dict(scaling=0.37, **with_sinks(case, heads[0], torch.float64))
    out, grads = run(
        partial(blocked_tree_attention, tile_elements=tile_elements), q, k, v, kv_end, position_ids, **options
    )
    ref_out, ref_grads = run(reference_tree_attention, q, k, v, kv_end, position_ids, **options)
    assert kv_end.shape[0] > 1 and out.shape == ref_out.shape
    assert relative_error(out, ref_out) <= TOLERANCE
    for grad, ref_grad in zip(grads, ref_grads):
        assert grad.shape == ref_grad.shape
        assert relative_error(grad, ref_grad) <= TOLERANCE


def test_blocked_on_worker_threads_matches_reference_and_is_deterministic(monkeypatch):
    """With several intra-op threads the CPU engine spreads blocks over worker threads; key/value gradient
    terms are still added in block order, so two runs agree bit for bit, and the caller's thread count
    is restored."""
    monkeypatch.setattr(blocked, "MIN_PARALLEL_TOKENS", 1)  # this row is short: use the workers anyway
    kv_end, position_ids = packed_rows(seed=8, num_trees=16, max_packed_tokens=200)
    q, k, v = qkv(kv_end, (4, 2), torch.float64)
    options = dict(scaling=0.37, sliding_window=6)
    torch.set_num_threads(2)
    first = run(partial(blocked_tree_attention, tile_elements=64), q, k, v, kv_end, position_ids, **options)
    second = run(partial(blocked_tree_attention, tile_elements=64), q, k, v, kv_end, position_ids, **options)
    assert torch.get_num_threads() == 2
    torch.set_num_threads(1)
    ref_out, ref_grads = run(reference_tree_attention, q, k, v, kv_end, position_ids, **options)
    assert relative_error(first[0], ref_out) <= TOLERANCE
    assert all(relative_error(g, r) <= TOLERANCE for g, r in zip(first[1], ref_grads))
    assert torch.equal(first[0], second[0]) and all(torch.equal(a, b) for a, b in zip(first[1], second[1]))


def test_failing_block_stops_the_other_workers_before_the_error_is_raised():
    """A worker's error reaches the caller only once no block is running, and the queued blocks never start
    afterwards (they would write into the failed call's outputs)."""
    import threading
    import time

    lock, running, started = threading.Lock(), [0], []

    def block(x: torch.Tensor, index: int) -> int:
        with lock:
            running[0] += 1
            started.append(index)
        try:
            if index == 0:
                raise RuntimeError("block 0 failed")
            time.sleep(0.2)  # still running when block 0 fails
            return index
        finally:
            with lock:
                running[0] -= 1

    items = ((torch.zeros(1), index) for index in range(8))
    threads = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="block 0 failed"):
        list(blocked._map_blocks(block, items, workers=2))
    torch.set_num_threads(threads)  # _map_blocks restores the workers' count, the caller's by convention
    with lock:
        assert running[0] == 0
        started_at_error = list(started)
    time.sleep(0.5)
    assert started == started_at_error and len(started) <= 3  # workers + the one queued beyond them


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("case", CASES)
def test_flex_forward_matches_reference_on_cpu(heads, case):
    """Flex's CPU path has no backward (PyTorch), but its forward checks the BlockMask and mask function."""
    kv_end, position_ids = packed_rows(seed=10 + heads[1])
    q, k, v = qkv(kv_end, heads, torch.float64)
    options = dict(scaling=0.37, **with_sinks(case, heads[0], torch.float64))
    out, _ = run(flex_tree_attention, q, k, v, kv_end, position_ids, backward=False, **options)
    ref, _ = run(reference_tree_attention, q, k, v, kv_end, position_ids, backward=False, **options)
    assert relative_error(out, ref) <= TOLERANCE


@pytest.mark.slow  # inductor compiles FlexAttention's CPU kernel: about a minute on 2 cores
def test_compiled_flex_forward_on_cpu_honours_the_block_mask():
    """Eager Flex evaluates every block (mask_mod only); the compiled kernel skips the blocks the
    BlockMask leaves out, so this checks the block lists themselves in a real kernel."""
    kv_end, position_ids = packed_rows(seed=13, num_trees=12, max_packed_tokens=256, pad_to_multiple_of=128)
    q, k, v = (t.detach().float() for t in qkv(kv_end, (4, 2), torch.float64))
    block_mask = tree_block_mask(kv_end, position_ids, 6, block_size=128)
    compiled = torch.compile(torch.nn.attention.flex_attention.flex_attention)
    with torch.no_grad():
        out = compiled(q, k, v, block_mask=block_mask, scale=0.3, enable_gqa=True).transpose(1, 2)
        ref = reference_tree_attention(
            q, k, v, kv_end, TreeAttentionOptions(scaling=0.3, position_ids=position_ids, sliding_window=6)
        )
    assert relative_error(out, ref) <= 1e-5


def test_flex_refuses_gradients_off_cuda():
    kv_end, _ = packed_rows(seed=0)
    q, k, v = qkv(kv_end, (4, 2), torch.float64)
    with pytest.raises(ValueError, match="'blocked' backend"):
        flex_tree_attention(q, k, v, kv_end, TreeAttentionOptions(scaling=1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES[:3] + CASES[4:5])
def test_blocked_low_precision_error_within_twice_eager(dtype, case):
    kv_end, position_ids = packed_rows(seed=3, max_packed_tokens=160, pad_to_multiple_of=16)
    q, k, v = qkv(kv_end, (4, 2), dtype)
    options = dict(scaling=HEAD_DIM**-0.5, **with_sinks(case, 4, dtype))
    exact = run(reference_tree_attention, *detached64((q, k, v)), kv_end, position_ids, **in64(options))
    exact_out, exact_grads = exact
    out, grads = run(partial(blocked_tree_attention, tile_elements=256), q, k, v, kv_end, position_ids, **options)
    eager_out, eager_grads = run(reference_tree_attention, q, k, v, kv_end, position_ids, **options)
    assert out.dtype == dtype
    assert relative_error(out, exact_out) <= 2 * relative_error(eager_out, exact_out)
    for grad, eager_grad, exact in zip(grads, eager_grads, exact_grads):
        assert grad.dtype == dtype
        assert relative_error(grad, exact) <= 2 * relative_error(eager_grad, exact)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_low_precision_forward_within_twice_eager(dtype):
    kv_end, position_ids = packed_rows(seed=4, max_packed_tokens=160, pad_to_multiple_of=16)
    q, k, v = qkv(kv_end, (4, 2), dtype)
    exact, _ = run(reference_tree_attention, *detached64((q, k, v)), kv_end, None, backward=False, scaling=0.3)
    out, _ = run(flex_tree_attention, q, k, v, kv_end, None, backward=False, scaling=0.3)
    eager, _ = run(reference_tree_attention, q, k, v, kv_end, None, backward=False, scaling=0.3)
    assert relative_error(out, exact) <= 2 * relative_error(eager, exact)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("engine", ["blocked", "segments", "flex"])
def test_rows_that_see_only_themselves_give_no_nan(engine):
    """Padding keys (kv_end = j + 1) and a row of one-token trees: each query sees itself only, output = v."""
    n = 40
    kv_end = torch.arange(1, n + 1, dtype=torch.int32)[None]
    q, k, v = qkv(kv_end, (4, 2), torch.float64)
    backward = engine != "flex"
    out, grads = run(ENGINES[engine], q, k, v, kv_end, None, backward=backward, scaling=0.5)
    expected = v.detach().repeat_interleave(2, dim=1).transpose(1, 2)
    assert torch.isfinite(out).all()
    assert relative_error(out, expected) <= TOLERANCE
    if backward:
        assert all(torch.isfinite(g).all() for g in grads)
        assert grads[0].abs().max() <= 1e-12  # softmax over one key: no gradient reaches the query


def test_padding_rows_match_reference_and_stay_finite():
    kv_end, position_ids = packed_rows(seed=7, num_trees=2, max_packed_tokens=64, pad_to_multiple_of=64)
    assert (kv_end[:, -1] == kv_end.shape[1]).all() and (kv_end[0] == torch.arange(1, 65)).any()
    q, k, v = qkv(kv_end, (4, 2), torch.float64)
    out, grads = run(blocked_tree_attention, q, k, v, kv_end, position_ids, scaling=0.4, sliding_window=4)
    ref, ref_grads = run(reference_tree_attention, q, k, v, kv_end, position_ids, scaling=0.4, sliding_window=4)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    assert relative_error(out, ref) <= TOLERANCE
    assert all(relative_error(g, r) <= TOLERANCE for g, r in zip(grads, ref_grads))


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("block_size", [8, 16])
def test_block_mask_skips_exactly_the_empty_blocks(window, block_size):
    """Block summaries vs the dense mask cut into blocks: no visible pair is skipped, a "full" block is
    truly full, and without a window the classification is exact."""
    kv_end, position_ids = packed_rows(seed=11, max_packed_tokens=120, pad_to_multiple_of=16)
    batch, n = kv_end.shape
    block_mask = tree_block_mask(kv_end, position_ids, window, block_size=block_size)
    dense = dense_tree_mask(kv_end, position_ids, window).view(batch, n // block_size, block_size, -1, block_size)
    exact_any, exact_all = dense.any(dim=(2, 4)), dense.all(dim=(2, 4))
    mine_any = block_mask.to_dense()[:, 0].bool()
    full_only = type(block_mask).from_kv_blocks(
        block_mask.full_kv_num_blocks, block_mask.full_kv_indices, BLOCK_SIZE=block_size, seq_lengths=(n, n)
    )
    mine_all = full_only.to_dense()[:, 0].bool()
    assert (mine_any >= exact_any).all() and (mine_all <= exact_all).all()
    assert (mine_all <= mine_any).all()
    if window is None:
        assert torch.equal(mine_any, exact_any) and torch.equal(mine_all, exact_all)
    assert not mine_any.all()  # sibling blocks are skipped


def test_block_mask_is_built_once_per_batch():
    clear_block_mask_cache()
    kv_end, position_ids = packed_rows(seed=12)
    first = cached_tree_block_mask(kv_end, position_ids, None)
    assert cached_tree_block_mask(kv_end, position_ids, None) is first  # every layer of one forward
    assert cached_tree_block_mask(kv_end.clone(), position_ids, None) is not first  # another batch
    windowed = cached_tree_block_mask(kv_end, position_ids, 4)
    assert windowed is not first and cached_tree_block_mask(kv_end, position_ids, 4) is windowed
    kv_end[0, 0] = kv_end[0, 0]  # an in-place write bumps the version: rebuilt
    assert cached_tree_block_mask(kv_end, position_ids, None) is not first
    clear_block_mask_cache()


def test_sliding_window_without_depths_is_refused():
    kv_end, _ = packed_rows(seed=0)
    q, k, v = qkv(kv_end, (4, 2), torch.float64)
    for engine in (blocked_tree_attention, flex_tree_attention):
        with pytest.raises(ValueError, match="position_ids"):
            engine(q, k, v, kv_end, TreeAttentionOptions(scaling=1.0, sliding_window=4))


def test_every_engine_takes_the_row_and_one_options_object():
    """One interface (``TreeAttentionEngine``): every engine, and context parallel's scoped one, takes ``(query,
    key, value, kv_end, options)``; an engine's own extras (a tile size, a plan) are keyword-only with defaults."""
    from hf_tree.parallel import ContextParallelAttention

    protocol = list(inspect.signature(TreeAttentionEngine.__call__).parameters)[1:]
    for engine in (*ENGINES.values(), ContextParallelAttention.__call__):
        parameters = list(inspect.signature(engine).parameters.values())
        if parameters[0].name == "self":
            parameters = parameters[1:]
        assert [p.name for p in parameters[: len(protocol)]] == protocol, engine
        extras = parameters[len(protocol) :]
        assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in extras), engine


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_sinks_must_be_one_logit_per_query_head():
    kv_end, _ = packed_rows(seed=0)
    q, k, v = qkv(kv_end, (4, 2), torch.float64)
    for engine in ENGINES.values():
        with pytest.raises(ValueError, match=r"one logit per query head, shape \(4,\)"):
            engine(
                q.detach(),
                k.detach(),
                v.detach(),
                kv_end,
                TreeAttentionOptions(scaling=1.0, sinks=torch.zeros(2, dtype=torch.float64)),
            )


def test_backend_selection(monkeypatch):
    monkeypatch.delenv("HF_TREE_ATTENTION_BACKEND", raising=False)
    assert select_backend(torch.device("cpu")) == "cpu"
    assert select_backend(torch.device("cuda")) == "cuda"
    monkeypatch.setenv("HF_TREE_ATTENTION_BACKEND", "reference")
    assert select_backend(torch.device("cuda")) == "reference"
    try:
        set_attention_backend("flex")
        assert select_backend(torch.device("cpu")) == "flex"  # the argument beats the environment
    finally:
        set_attention_backend(None)
    monkeypatch.setenv("HF_TREE_ATTENTION_BACKEND", "nope")
    with pytest.raises(ValueError, match="nope"):
        select_backend(torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown"):
        set_attention_backend("nope")


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["flex", "blocked"])
@pytest.mark.parametrize("case", CASES)
def test_cuda_engines_within_twice_eager_in_float32(engine, case):
    kv_end, position_ids = packed_rows(seed=21, num_trees=12, max_packed_tokens=400, pad_to_multiple_of=128)
    kv_end, position_ids = kv_end.cuda(), position_ids.cuda()
    q, k, v = qkv(kv_end, (4, 2), torch.float32, device="cuda", head_dim=GPU_HEAD_DIM)
    options = dict(scaling=GPU_HEAD_DIM**-0.5, **with_sinks(case, 4, torch.float32, device="cuda"))
    exact = run(reference_tree_attention, *detached64((q, k, v)), kv_end, position_ids, **in64(options))
    exact_out, exact_grads = exact
    out, grads = run(ENGINES[engine], q, k, v, kv_end, position_ids, **options)
    eager_out, eager_grads = run(reference_tree_attention, q, k, v, kv_end, position_ids, **options)
    assert relative_error(out, exact_out) <= 2 * relative_error(eager_out, exact_out)
    for grad, eager_grad, exact in zip(grads, eager_grads, exact_grads):
        assert relative_error(grad, exact) <= 2 * relative_error(eager_grad, exact)


@pytest.mark.gpu
def test_cuda_blocked_matches_reference_in_float64():
    kv_end, position_ids = packed_rows(seed=22, num_trees=12, max_packed_tokens=400)
    kv_end, position_ids = kv_end.cuda(), position_ids.cuda()
    q, k, v = qkv(kv_end, (4, 2), torch.float64, device="cuda", head_dim=GPU_HEAD_DIM)
    out, grads = run(blocked_tree_attention, q, k, v, kv_end, position_ids, scaling=0.3, sliding_window=5)
    ref, ref_grads = run(reference_tree_attention, q, k, v, kv_end, position_ids, scaling=0.3, sliding_window=5)
    assert relative_error(out, ref) <= TOLERANCE
    assert all(relative_error(g, r) <= TOLERANCE for g, r in zip(grads, ref_grads))


def test_segment_rectangles_tile_the_tree_mask_exactly():
    for kv_end in (long_segment_rows()[0], packed_rows(seed=2)[0]):
        plan = plan_segments(kv_end)
        batch, n = kv_end.shape
        covered = torch.zeros(batch, n, n, dtype=torch.int64)
        for part in plan.parts:
            keys = torch.arange(n)[part.keys]
            block = covered[part.row, part.q0 : part.q1][:, keys]
            if part.causal:
                block += torch.ones(len(keys), len(keys), dtype=torch.int64).tril()
            else:
                block += 1
            covered[part.row, part.q0 : part.q1, keys] = block
        flat = covered.view(batch * n, n)
        flat[plan.singletons, plan.singletons % n] += 1
        assert torch.equal(covered, dense_tree_mask(kv_end).squeeze(1).to(torch.int64))
    parts = plan_segments(long_segment_rows()[0]).parts
    assert any(not isinstance(p.keys, slice) for p in parts)  # gathered ancestors


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}x{h[1]}")
@pytest.mark.parametrize("case", [pytest.param({}, id="plain"), pytest.param({"sinks": True}, id="sinks")])
@pytest.mark.parametrize("rows", ["long-segments", "random-forests"])
def test_segments_match_reference_in_float64(heads, case, rows):
    kv_end, position_ids = long_segment_rows() if rows == "long-segments" else packed_rows(seed=heads[1])
    q, k, v = qkv(kv_end, heads, torch.float64)
    options = dict(scaling=0.37, **with_sinks(case, heads[0], torch.float64))
    out, grads = run(segment_tree_attention, q, k, v, kv_end, position_ids, **options)
    ref_out, ref_grads = run(reference_tree_attention, q, k, v, kv_end, position_ids, **options)
    assert relative_error(out, ref_out) <= TOLERANCE
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert relative_error(grad, ref_grad) <= TOLERANCE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [pytest.param({}, id="plain"), pytest.param({"sinks": True}, id="sinks")])
def test_segments_low_precision_error_within_twice_eager(dtype, case):
    kv_end, position_ids = long_segment_rows(seed=1)
    q, k, v = qkv(kv_end, (4, 2), dtype)
    options = dict(scaling=HEAD_DIM**-0.5, **with_sinks(case, 4, dtype))
    exact_out, exact_grads = run(
        reference_tree_attention, *detached64((q, k, v)), kv_end, position_ids, **in64(options)
    )
    out, grads = run(segment_tree_attention, q, k, v, kv_end, position_ids, **options)
    eager_out, eager_grads = run(reference_tree_attention, q, k, v, kv_end, position_ids, **options)
    assert out.dtype == dtype
    assert relative_error(out, exact_out) <= 2 * relative_error(eager_out, exact_out)
    for grad, eager_grad, exact in zip(grads, eager_grads, exact_grads, strict=True):
        assert grad.dtype == dtype
        assert relative_error(grad, exact) <= 2 * relative_error(eager_grad, exact)


def _per_branch_sdpa(tree, q, k, v, grad_outs, scaling: float):
    """Each branch of ``tree`` alone through causal SDPA (the model's own path), on copies of its tokens of
    ``q/k/v [1, H*, N, D]`` (new leaves), with the output gradient ``grad_outs[b] [1, H, L_b, D]``: the branches'
    outputs concatenated ``[H, sum L_b, D]`` and their q/k/v gradients summed onto the packed tokens (float64)."""
    outs, grads = [], [torch.zeros(x.shape, dtype=torch.float64) for x in (q, k, v)]
    for b, grad_out in enumerate(grad_outs):
        index = torch.from_numpy(tree.branch_flat_indices(b))
        leaves = [x.detach()[:, :, index].requires_grad_() for x in (q, k, v)]
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True, scale=scaling, enable_gqa=True)
        for total, grad in zip(grads, torch.autograd.grad(out, leaves, grad_out), strict=True):
            total.index_add_(2, index, grad.double())
        outs.append(out.detach()[0])
    return torch.cat(outs, dim=1), grads


@pytest.mark.parametrize("mode", ["bfloat16", "autocast"])
@pytest.mark.parametrize("heads", [(4, 2), (6, 1)], ids=lambda h: f"{h[0]}x{h[1]}")
def test_segments_bfloat16_error_within_twice_per_branch_sdpa(mode, heads):
    """The segments engine in bf16 (bf16 tensors, or float32 ones under CPU bf16 autocast) against the branches run
    alone through SDPA: its output and gradients, err against float64 per-branch SDPA, at most twice per-branch
    SDPA's own err in the same precision. The engine keeps the model's dtype for outputs and gradients (a
    token's parts merged and summed there, as per-branch training sums its branches' gradients in the weights'
    dtype) and only the softmax statistics in float32."""
    scaling = HEAD_DIM**-0.5
    for seed, tree in enumerate(long_segment_trees(seed=2)):
        kv_end = torch.from_numpy(tree.kv_end)[None]
        dtype = torch.bfloat16 if mode == "bfloat16" else torch.float32
        q, k, v = qkv(kv_end, heads, dtype, seed=seed)
        # Output gradients of eighths: exact in bf16, and so are their sums over the branches sharing a token.
        generator = torch.Generator().manual_seed(seed)
        grad_outs = [
            torch.randint(-8, 9, (1, heads[0], n, HEAD_DIM), generator=generator, dtype=torch.float64) / 8
            for n in tree.branch_lengths.tolist()
        ]
        grad_tree = torch.zeros(q.shape, dtype=torch.float64)
        for b, grad_out in enumerate(grad_outs):
            grad_tree.index_add_(2, torch.from_numpy(tree.branch_flat_indices(b)), grad_out)
        with torch.autocast("cpu", torch.bfloat16, enabled=mode == "autocast"):
            out = segment_tree_attention(q, k, v, kv_end, TreeAttentionOptions(scaling=scaling))
            low = _per_branch_sdpa(tree, q, k, v, [g.to(out.dtype) for g in grad_outs], scaling)
        assert out.dtype == torch.bfloat16
        grads = torch.autograd.grad(out, (q, k, v), grad_tree.to(out.dtype).transpose(1, 2))
        exact = _per_branch_sdpa(tree, *detached64((q, k, v)), grad_outs, scaling)
        flat = torch.cat([torch.from_numpy(tree.branch_flat_indices(b)) for b in range(tree.num_branches)])
        tree_out = out[0].transpose(0, 1)[:, flat]  # [H, sum L_b, D], each branch's tokens in its order
        assert relative_error(tree_out, exact[0]) <= 2 * relative_error(low[0], exact[0])
        for grad, low_grad, exact_grad in zip(grads, low[1], exact[1], strict=True):
            assert grad.dtype == dtype
            assert relative_error(grad, exact_grad) <= 2 * relative_error(low_grad, exact_grad)


def test_segments_refuse_what_the_fused_kernel_lacks():
    kv_end, position_ids = long_segment_rows()
    q, k, v = qkv(kv_end, (4, 2), torch.float64)
    for option in (dict(softcap=2.0), dict(sliding_window=8, position_ids=position_ids)):
        with pytest.raises(ValueError, match="use blocked_tree_attention"):
            segment_tree_attention(q, k, v, kv_end, TreeAttentionOptions(scaling=1.0, **option))


@pytest.mark.parametrize(
    "rows, options, chosen",
    [
        ("long-segments", {}, "_SegmentTreeAttention"),
        ("long-segments", dict(softcap=2.0), "_BlockedTreeAttention"),
        ("long-segments", dict(sliding_window=16), "_BlockedTreeAttention"),
        ("random-forests", {}, "_BlockedTreeAttention"),
    ],
)
def test_cpu_engine_chooses_by_segment_length_and_options(rows, options, chosen):
    kv_end, position_ids = long_segment_rows() if rows == "long-segments" else packed_rows(seed=0)
    plan = plan_segments(kv_end)
    assert (plan.tokens_per_call >= MIN_TOKENS_PER_CALL) == (rows == "long-segments")
    q, k, v = qkv(kv_end, (4, 2), torch.float64)
    out = cpu_tree_attention(q, k, v, kv_end, TreeAttentionOptions(scaling=0.37, position_ids=position_ids, **options))
    assert type(out.grad_fn).__name__ == chosen + "Backward"
    ref = reference_tree_attention(
        q, k, v, kv_end, TreeAttentionOptions(scaling=0.37, position_ids=position_ids, **options)
    )
    assert relative_error(out, ref) <= TOLERANCE
