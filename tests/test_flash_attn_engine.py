"""The flash-attn engine (``hf_tree.attention.flash``) on CPU, and on CUDA where flash-attn is installed.

Oracles: the segments engine's decomposition (``plan_segments``) and the dense mask for the varlen index; the dense
reference engine for the engine's output and gradients, with a pure-PyTorch stand-in of ``flash_attn_varlen_func``
(``tests/varlen_attention.py``, the same call contract) fed the engine's gathered tensors, in float64 to 1e-9. On a
GPU with flash-attn, the real kernel in bfloat16 must be within twice eager attention's bfloat16 error.
"""

from __future__ import annotations

import pytest
import torch

from hf_tree.attention import TreeAttentionOptions, dense_tree_mask, reference_tree_attention
from hf_tree.attention import flash as flash_module
from hf_tree.attention.cuda import cuda_tree_attention
from hf_tree.attention.flash import (
    flash_attn_refusal,
    flash_attn_varlen_func,
    flash_tree_attention,
    varlen_tree_attention,
    varlen_tree_index,
)
from hf_tree.attention.segments import plan_segments
from tests.helpers import detached64, relative_error, run
from tests.varlen_attention import varlen_attention
from tests.workloads import HEAD_DIM, long_segment_rows, packed_rows, qkv

TOLERANCE = 1e-9
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py

ROWS = {
    "long-segments": long_segment_rows,  # GRPO group, agent chain (gathered ancestors), short prompt, padding
    "random-forests": lambda: packed_rows(seed=3),  # several short-segment forests per row, two rows, padding
}


def varlen_pairs(kv_end: torch.Tensor) -> torch.Tensor:
    """``[B, N, N]`` int64: how often each (query, key) pair is computed by the varlen index (bottom-right causal)."""
    batch, n = kv_end.shape
    index = varlen_tree_index(kv_end)
    counts = torch.zeros(batch * n, batch * n, dtype=torch.int64)
    cu_q, cu_k = index.cu_seqlens_q.tolist(), index.cu_seqlens_k.tolist()
    for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:], strict=True):
        keys = index.key_index[k0:k1]
        causal = torch.ones(q1 - q0, k1 - k0, dtype=torch.int64).tril(k1 - k0 - (q1 - q0))
        counts[q0:q1, keys] += causal
    rows = torch.arange(batch)
    return counts.view(batch, n, batch, n)[rows, :, rows]


@pytest.mark.parametrize("rows", ROWS)
def test_varlen_index_is_the_segments_decomposition(rows):
    """One varlen sequence per segment of ``plan_segments`` (its causal parts and one-token segments), whose keys are
    the segment's full-part keys (ancestors) then its own; together they compute every visible pair exactly once."""
    kv_end, _ = ROWS[rows]()
    batch, n = kv_end.shape
    index, plan = varlen_tree_index(kv_end), plan_segments(kv_end)
    segment_starts = sorted([p.row * n + p.q0 for p in plan.parts if p.causal] + plan.singletons.tolist())
    assert index.cu_seqlens_q[:-1].tolist() == segment_starts and int(index.cu_seqlens_q[-1]) == batch * n
    ancestors = {}  # flat query -> flat ancestor keys, from the full parts
    for part in (p for p in plan.parts if not p.causal):
        keys = (torch.arange(n)[part.keys] + part.row * n).tolist()
        ancestors.update({part.row * n + q: keys for q in range(part.q0, part.q1)})
    cu_q, cu_k = index.cu_seqlens_q.tolist(), index.cu_seqlens_k.tolist()
    for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:], strict=True):
        assert index.key_index[k0:k1].tolist() == ancestors.get(q0, []) + list(range(q0, q1))
    assert index.max_seqlen_q == max(b - a for a, b in zip(cu_q[:-1], cu_q[1:]))
    assert index.max_seqlen_k == max(b - a for a, b in zip(cu_k[:-1], cu_k[1:]))
    assert torch.equal(varlen_pairs(kv_end), dense_tree_mask(kv_end).to(torch.int64))
    if rows == "long-segments":  # ancestors that are not one range are gathered
        assert any(len(a) != a[-1] - a[0] + 1 for a in ancestors.values())


def through_stand_in(q, k, v, kv_end, options: TreeAttentionOptions) -> torch.Tensor:
    """The engine's varlen path with the torch stand-in as its kernel (depths are not read: paths are)."""
    window, softcap = options.sliding_window, options.softcap
    return varlen_tree_attention(
        q, k, v, kv_end, scaling=options.scaling, attend=varlen_attention, sliding_window=window, softcap=softcap
    )


CASES = [
    pytest.param(dict(), id="plain"),
    pytest.param(dict(sliding_window=3), id="window3"),
    pytest.param(dict(softcap=1.5), id="softcap"),
    pytest.param(dict(sliding_window=40, softcap=2.0), id="window40-softcap"),
]


@pytest.mark.parametrize(
    "heads",  # one query head per key head is the trivial grouping: gqa and mqa cover the mapping in the fast tier
    [
        pytest.param((4, 4), id="mha", marks=pytest.mark.slow),
        pytest.param((4, 2), id="gqa"),
        pytest.param((6, 1), id="mqa"),
    ],
)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rows", ROWS)
def test_engine_through_torch_varlen_matches_reference_in_float64(heads, case, rows):
    """The engine's gather, cu_seqlens, window and soft-cap arguments, fed to the varlen contract's torch stand-in."""
    kv_end, position_ids = ROWS[rows]()
    q, k, v = qkv(kv_end, heads, torch.float64)
    options = dict(scaling=0.37, **case)
    out, grads = run(through_stand_in, q, k, v, kv_end, None, **options)
    ref_out, ref_grads = run(reference_tree_attention, q, k, v, kv_end, position_ids, **options)
    assert relative_error(out, ref_out) <= TOLERANCE
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert relative_error(grad, ref_grad) <= TOLERANCE


def test_refusals_name_the_reason():
    kv_end, _ = long_segment_rows()
    q, _, v = qkv(kv_end, (4, 2), torch.bfloat16)
    blocks = torch.full_like(kv_end, -1)
    assert "CUDA only" in flash_attn_refusal(q, v, bidirectional_block=blocks)  # all -1: no overlay
    blocks[0, 1:4] = 0
    assert "bidirectional blocks" in flash_attn_refusal(q, v, bidirectional_block=blocks)
    assert "sinks" in flash_attn_refusal(q, v, sinks=torch.zeros(4))
    assert "float16/bfloat16 only" in flash_attn_refusal(q.float(), v.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "CUDA only" in flash_attn_refusal(q.float(), v.float())  # the kernel would get bfloat16
    assert "head dims" in flash_attn_refusal(q, v[..., :4])
    with pytest.raises(ValueError, match="backend 'flash_attn' cannot run this call: attention sinks"):
        flash_tree_attention(q, q, v, kv_end, TreeAttentionOptions(scaling=1.0, sinks=torch.zeros(4)))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_cuda_engine_runs_flash_where_it_is_exact_else_flex(monkeypatch):
    """The automatic CUDA engine, checked on CPU: with the refusal lifted and the stand-in as the kernel it runs the
    flash engine (forward and backward equal the reference); with a reason it runs flex (here forward only)."""
    kv_end, position_ids = long_segment_rows()
    q, k, v = qkv(kv_end, (4, 2), torch.float64)
    options = dict(scaling=0.37, sliding_window=50, softcap=2.0)
    ref_out, ref_grads = run(reference_tree_attention, q, k, v, kv_end, position_ids, **options)
    with torch.no_grad():
        via_flex = cuda_tree_attention(q, k, v, kv_end, TreeAttentionOptions(position_ids=position_ids, **options))
    assert relative_error(via_flex, ref_out) <= TOLERANCE
    monkeypatch.setattr(flash_module, "flash_attn_refusal", lambda *args: None)
    monkeypatch.setattr(flash_module, "flash_attn_varlen_func", lambda: varlen_attention)
    out, grads = run(cuda_tree_attention, q, k, v, kv_end, position_ids, **options)
    assert relative_error(out, ref_out) <= TOLERANCE
    assert all(relative_error(g, r) <= TOLERANCE for g, r in zip(grads, ref_grads, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rows", ROWS)
def test_flash_attn_on_cuda_within_twice_eager_in_bfloat16(case, rows):
    if flash_attn_varlen_func() is None:
        pytest.skip("flash-attn is not installed")
    kv_end, position_ids = (x.cuda() for x in ROWS[rows]())
    q, k, v = qkv(kv_end, (4, 2), torch.bfloat16, device="cuda")
    options = dict(scaling=HEAD_DIM**-0.5, **case)
    exact_out, exact_grads = run(reference_tree_attention, *detached64((q, k, v)), kv_end, position_ids, **options)
    out, grads = run(flash_tree_attention, q, k, v, kv_end, position_ids, **options)
    eager_out, eager_grads = run(reference_tree_attention, q, k, v, kv_end, position_ids, **options)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, exact_out) <= 2 * relative_error(eager_out, exact_out)
    for grad, eager_grad, exact in zip(grads, eager_grads, exact_grads, strict=True):
        assert relative_error(grad, exact) <= 2 * relative_error(eager_grad, exact)
