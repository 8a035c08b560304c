"""The compiled FlexAttention of the ``flex`` engine (``hf_tree.attention.flex.compiled_flex_attention``, issue 49):
many models in one process never reach dynamo's recompile limit (which made Flex run uncompiled, 10x slower, with
only a log line), a soft-cap value is a tensor input (a second value crashed the compile), and new lengths reuse the
graph.

On CPU, PyTorch's Flex compiles the forward only; the bookkeeping (one code object per ``FlexCompileKey``, dynamic
shapes, the soft-cap input) is dynamo's and is checked with the ``aot_eager`` backend in seconds; the fused kernels
(``inductor``) take ~40 s per compile on CPU (``slow``); backward and the time of a new length are ``gpu`` tests.
"""

from __future__ import annotations

import time
import warnings
from contextlib import nullcontext

import pytest
import torch
from torch._dynamo.utils import counters

from hf_tree.attention import flex
from hf_tree.attention.engine import TreeAttentionOptions
from hf_tree.attention.reference import reference_tree_attention
from tests.workloads import packed_rows, qkv

# (dtype, head_dim, softcap, sliding_window, row tokens): 10 configurations of 8 compile keys (two soft-cap values
# share a key, as do two lengths)
CONFIGS = [
    (torch.float32, 16, None, None, 256),
    (torch.float32, 16, None, None, 200),  # a new length: no new graph
    (torch.float32, 16, 2.0, None, 256),
    (torch.float32, 16, 5.0, None, 300),  # a second soft-cap value: no new graph, no crash
    (torch.bfloat16, 16, None, None, 256),
    (torch.float32, 32, None, None, 256),
    (torch.float32, 32, None, 4, 256),
    (torch.float32, 32, None, 6, 256),
    (torch.bfloat16, 64, 3.0, 6, 256),
    (torch.bfloat16, 32, 30.0, None, 256),
]


def compile_keys(configs) -> int:
    return len({(dtype, head_dim, softcap is not None, window) for dtype, head_dim, softcap, window, _ in configs})


@pytest.fixture
def fresh_flex(monkeypatch):
    """An empty table of compiled Flex functions (this test's keys compile here), restored afterwards."""
    monkeypatch.setattr(flex, "_compiled", {})
    yield
    torch._dynamo.reset()


def check_config(seed: int, dtype, head_dim, softcap, window, tokens) -> None:
    """The compiled call on packed random forests (GQA 4/2) against the float64 reference, bound by the same-dtype
    error of the uncompiled call."""
    kv_end, position_ids = packed_rows(seed=seed, num_trees=6, max_packed_tokens=tokens)
    q, k, v = (x.detach() for x in qkv(kv_end, (4, 2), dtype, device="cpu", head_dim=head_dim))
    block_mask = flex.tree_block_mask(kv_end, position_ids, window)
    options = TreeAttentionOptions(scaling=0.25, softcap=softcap, position_ids=position_ids, sliding_window=window)
    out = flex.compiled_flex_attention(q, k, v, block_mask, 0.25, softcap, False, (window, None, False))
    exact = reference_tree_attention(q.double(), k.double(), v.double(), kv_end, options)
    eager = reference_tree_attention(q, k, v, kv_end, options)
    error = float((out.transpose(1, 2).double() - exact).norm() / exact.norm())
    eager_error = float((eager.double() - exact).norm() / exact.norm())
    assert error <= max(2 * eager_error, 1e-6), (dtype, head_dim, softcap, window, error, eager_error)


@pytest.mark.slow  # 8 dynamo compiles of Flex (~20 s); the fast tier keeps the limit's warning test below
def test_many_models_keep_compiled_flex_under_a_tight_recompile_limit(fresh_flex, monkeypatch):
    """10 configurations (dtypes, head dims, soft-caps, windows, lengths) in one process with dynamo's recompile
    limit lowered to 1: each compile key has a code object of its own, so none reaches the limit (no fallback to
    uncompiled Flex, no warning); one graph per key (new lengths and soft-cap values reuse it), each matching the
    reference. One shared code object (as before) hits the limit at the second key."""
    monkeypatch.setattr(flex, "COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the recompile-limit warning fails the test
        for seed, config in enumerate(CONFIGS):
            check_config(seed, *config)
        assert counters["stats"]["unique_graphs"] == compile_keys(CONFIGS) == len(flex._compiled) == 8
        shared = torch.compile(flex._flex_call, backend="aot_eager", dynamic=True, fullgraph=True)
        kv_end, _ = packed_rows(seed=0, num_trees=6, max_packed_tokens=256)
        block_mask = flex.tree_block_mask(kv_end)
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v = (x.detach() for x in qkv(kv_end, (4, 2), dtype, device="cpu", head_dim=16))
            with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit) if dtype == torch.bfloat16 else nullcontext():
                shared(q, k, v, block_mask, 0.25, None, True, False)


def test_a_key_past_the_recompile_limit_warns_and_compiles_afresh(fresh_flex, monkeypatch):
    """Should one key still reach the limit, the call warns (naming the key) and runs compiled on a new code object
    (right result), instead of silently running uncompiled Flex."""
    monkeypatch.setattr(flex, "COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1):
        check_config(0, torch.float32, 16, None, None, 256)
        entry = next(iter(flex._compiled.values()))
        first = entry.function
        kv_end, position_ids = packed_rows(seed=1, num_trees=6, max_packed_tokens=256)
        # 8 query heads (4 before): a guard of the graph fails, which the limit of 1 refuses
        q, k, v = (x.detach() for x in qkv(kv_end, (8, 2), torch.float32, device="cpu", head_dim=16))
        with pytest.warns(RuntimeWarning, match="recompile limit"):
            out = flex.compiled_flex_attention(q, k, v, flex.tree_block_mask(kv_end), 0.25)
    assert entry.function is not first
    exact = reference_tree_attention(q.double(), k.double(), v.double(), kv_end, TreeAttentionOptions(scaling=0.25))
    assert float((out.transpose(1, 2).double() - exact).norm() / exact.norm()) < 1e-6


@pytest.mark.slow  # inductor compiles Flex's CPU kernel (~40 s on 2 busy cores)
def test_two_softcap_values_share_one_fused_compile_and_match_the_reference(fresh_flex):
    """The fused (inductor) kernel with two soft-cap values in one process: a float closed over by the score function
    crashed the compile at the second value; as a tensor input both run on one graph and match the reference."""
    torch._dynamo.reset()
    counters.clear()
    for seed, softcap in enumerate((2.0, 5.0)):
        check_config(seed, torch.float32, 16, softcap, None, 256)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.gpu
def test_cuda_many_models_forward_backward_stay_compiled_and_new_lengths_are_cheap(fresh_flex):
    """On CUDA: the 10 configurations forward + backward through the ``flex`` engine in one process (no recompile
    warning), and after warm-up a new packed length costs under a second."""
    from hf_tree.attention import ENGINES
    from tests.helpers import run

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for seed, (dtype, head_dim, softcap, window, tokens) in enumerate(CONFIGS):
            kv_end, position_ids = (x.cuda() for x in packed_rows(seed=seed, num_trees=6, max_packed_tokens=tokens))
            q, k, v = qkv(kv_end, (4, 2), dtype, device="cuda", head_dim=head_dim)
            options = dict(scaling=0.25, softcap=softcap, sliding_window=window)
            run(ENGINES["flex"], q, k, v, kv_end, position_ids, **options)
        kv_end, position_ids = (x.cuda() for x in packed_rows(seed=99, num_trees=9, max_packed_tokens=777))
        q, k, v = qkv(kv_end, (4, 2), torch.bfloat16, device="cuda", head_dim=16)
        start = time.perf_counter()
        run(ENGINES["flex"], q, k, v, kv_end, position_ids, scaling=0.25)
        torch.cuda.synchronize()
        assert time.perf_counter() - start < 1.0
    assert len(flex._compiled) == compile_keys(CONFIGS)
