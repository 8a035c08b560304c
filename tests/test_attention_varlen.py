"""The ``varlen`` engine (``hf_tree.attention.varlen``: two varlen kernel calls merged by log-sum-exp) and the automatic
CUDA rule (``hf_tree.attention.cuda``).

Oracles: the dense mask for the plan (every visible pair computed exactly once); the dense reference engine for the
engine's output and gradients, through the CPU kernel (a loop of PyTorch's fused CPU kernel with the varlen contract)
in float64 to 1e-9, and in float32/bfloat16 within twice the same-dtype eager error; real tiny HF models with the
engine forced against each branch run alone. On a GPU (``gpu``-marked): PyTorch's flash varlen kernel in bfloat16 and
float16 within twice eager attention's error in that dtype, forward and backward.
"""

from __future__ import annotations

import functools

import pytest
import torch

from hf_tree import Tree, TreeDataCollator, tree_causal_lm_loss
from hf_tree.attention import (
    ENGINES,
    EngineRefused,
    TreeAttentionOptions,
    dense_tree_mask,
    reference_tree_attention,
    select_backend,
    set_attention_backend,
    varlen_kernels,
)
from hf_tree.attention import cuda as cuda_module
from hf_tree.attention import flash as flash_module
from hf_tree.attention import varlen as varlen_module
from hf_tree.attention.cuda import VARLEN_MIN_TOKENS_PER_SEQUENCE, cuda_engine_choice, cuda_tree_attention
from hf_tree.attention.varlen import (
    VarlenPlan,
    VarlenRefused,
    cached_varlen_plan,
    plan_varlen,
    plan_varlen_paths,
    torch_varlen_tree_attention,
)
from hf_tree.attention.varlen_kernels import (
    CpuVarlen,
    CudaFlashVarlen,
    cuda_kernel_refusal,
    torch_declares_varlen_gqa,
)
from tests.helpers import (
    detached64,
    float64_norms,
    grads_of,
    max_grad_relative_error,
    per_branch_forest_loss,
    relative_error,
    run,
    run_benchmark,
    tiny_model,
)
from tests.varlen_attention import varlen_attention
from tests.workloads import HEAD_DIM, forest, long_segment_rows, packed_rows, qkv

TOLERANCE = 1e-9
CASES = [
    pytest.param({}, id="plain"),
    pytest.param({"sinks": True}, id="sinks"),
    pytest.param({"sliding_window": 3}, id="window3"),  # one call over the gathered paths
    pytest.param({"sliding_window": 40, "sinks": True}, id="window40-sinks"),
]
HEADS = [pytest.param((4, 4), id="mha"), pytest.param((4, 2), id="gqa"), pytest.param((6, 1), id="mqa")]
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py


def grpo_row() -> tuple[torch.Tensor, torch.Tensor]:
    """One GRPO group alone in its row (prompt 40, completions 30/50/20, no padding): both calls read views."""
    prompt = list(range(1, 41))
    group = [prompt + [100 + i] * 3 + list(range(200 + 60 * i, 200 + 60 * i + n)) for i, n in enumerate((27, 47, 17))]
    tree = Tree.from_sequences(group)
    batch = TreeDataCollator(max_packed_tokens=tree.num_tokens)([tree.to_dict()])
    return batch["kv_end"], batch["position_ids"]


def distinct_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of unrelated sequences (no sharing: no ancestors call) with padding."""
    trees = [Tree.from_sequences([list(range(s, s + n))]) for s, n in ((1, 50), (60, 30), (100, 70))]
    batch = TreeDataCollator(max_packed_tokens=96, pad_to_multiple_of=32)([t.to_dict() for t in trees])
    return batch["kv_end"], batch["position_ids"]


ROWS = {
    "long-segments": long_segment_rows,  # GRPO group, agent chain (gathered ancestors), short prompt, padding
    "random-forests": lambda: packed_rows(seed=3),  # many short segments, several forests per row, padding
    "grpo-views": grpo_row,
    "distinct": distinct_rows,
}


def computed_pairs(kv_end: torch.Tensor, plan: VarlenPlan, window: int | None = None) -> torch.Tensor:
    """``[B, N, N]`` int64: how often the plan's calls compute each (query, key) pair (causal parts aligned
    bottom-right, keys at most ``window`` positions back)."""
    batch, n = kv_end.shape
    counts = torch.zeros(batch * n, batch * n, dtype=torch.int64)
    flat = torch.arange(batch * n)
    for part in plan.parts:
        queries, keys = flat[part.queries], flat[part.keys]
        for q0, q1, k0, k1 in part.call.bounds:
            pairs = torch.ones(q1 - q0, k1 - k0, dtype=torch.int64)
            if part.causal:
                pairs = pairs.tril(k1 - k0 - (q1 - q0))
                if window is not None:
                    pairs = pairs.triu(k1 - k0 - (q1 - q0) - window)
            counts[queries[q0:q1, None], keys[None, k0:k1]] += pairs
    rows = torch.arange(batch)
    return counts.view(batch, n, batch, n)[rows, :, rows]


@pytest.mark.parametrize("rows", ROWS)
def test_plans_compute_every_visible_pair_exactly_once(rows):
    kv_end, position_ids = ROWS[rows]()
    plan, paths = plan_varlen(kv_end), plan_varlen_paths(kv_end, window=None)
    for each in (plan, paths):
        assert torch.equal(computed_pairs(kv_end, each), dense_tree_mask(kv_end).to(torch.int64))
    for window in (1, 3, 40):  # the window's keys, each once (as the kernel counts them: bottom-right, window - 1 back)
        windowed = computed_pairs(kv_end, plan_varlen_paths(kv_end, window), window - 1)
        assert torch.equal(windowed, dense_tree_mask(kv_end, position_ids, window).to(torch.int64))
        first = each.parts[0]  # reads every query in order
        assert first.queries == slice(0, kv_end.numel()) and int(first.call.cu_q[-1]) == kv_end.numel()
        assert first.call.cu_q.dtype == first.call.cu_k.dtype == torch.int32
    assert paths.num_tokens == plan.num_tokens and len(paths.parts) == 1
    self_call = plan.parts[0]
    assert self_call.causal and self_call.keys == self_call.queries  # in place: no copy
    ancestors = plan.parts[1] if len(plan.parts) > 1 else None
    if rows == "grpo-views":  # completions and prompt are one range each: no gather
        assert isinstance(ancestors.queries, slice) and isinstance(ancestors.keys, slice)
        assert ancestors.call.bounds == ((0, 100, 0, 40),)  # one sibling group against the prompt
    if rows == "long-segments":  # the agent chain's ancestors are not one range: gathered
        assert not isinstance(ancestors.keys, slice)
    if rows == "distinct":  # no sharing: one call, every path is its own segment
        assert ancestors is None and plan.num_sequences == paths.num_sequences == 3 and plan.tokens_per_sequence == 50
        assert paths.parts[0].keys == slice(0, kv_end.numel())


def test_plan_is_built_once_per_batch():
    kv_end, _ = long_segment_rows()
    first = cached_varlen_plan(kv_end)
    assert cached_varlen_plan(kv_end) is first and cached_varlen_plan(kv_end.clone()) is not first
    paths = cached_varlen_plan(kv_end, window=4)
    assert paths is not first and cached_varlen_plan(kv_end, window=4) is paths
    assert cached_varlen_plan(kv_end, window=5) is not paths


def sink_logits(num_heads: int, device: str = "cpu") -> torch.Tensor:
    """Random float64 per-head sink logits ``[H]`` on the scale of the scores."""
    return (2 * torch.randn(num_heads, generator=torch.Generator().manual_seed(5), dtype=torch.float64)).to(device)


def assert_within_twice_eager(engine, q, k, v, kv_end, position_ids, scaling: float, case: dict):
    """``engine``'s output and gradients (query, key, value, sinks) in ``q``'s dtype against the float64 reference:
    each error at most twice the reference engine's own error in that dtype (eager math). ``case``: ``CASES``'
    options (``sinks=True``: random sink logits)."""
    window = case.get("sliding_window")
    sinks = sink_logits(q.shape[1], device=q.device.type) if case.get("sinks") else None
    options, exact_options = (dict(scaling=scaling, sliding_window=window) for _ in range(2))
    if sinks is not None:
        options["sinks"], exact_options["sinks"] = sinks.to(q.dtype).requires_grad_(), sinks.clone().requires_grad_()
    exact_out, exact_grads = run(
        reference_tree_attention, *detached64((q, k, v)), kv_end, position_ids, **exact_options
    )
    out, grads = run(engine, q, k, v, kv_end, position_ids, **options)
    eager_out, eager_grads = run(reference_tree_attention, q, k, v, kv_end, position_ids, **options)
    assert out.dtype == q.dtype
    assert relative_error(out, exact_out) <= 2 * relative_error(eager_out, exact_out)
    for grad, eager_grad, exact in zip(grads, eager_grads, exact_grads, strict=True):
        assert grad.dtype == q.dtype
        assert relative_error(grad, exact) <= 2 * relative_error(eager_grad, exact)


@pytest.mark.parametrize(
    "heads",  # one query head per key head is the trivial grouping: gqa and mqa cover the mapping in the fast tier
    [pytest.param((4, 4), id="mha", marks=pytest.mark.slow), *HEADS[1:]],
)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rows", ROWS)
def test_engine_matches_reference_in_float64(heads, case, rows):
    kv_end, position_ids = ROWS[rows]()
    q, k, v = qkv(kv_end, heads, torch.float64)
    sinks = sink_logits(heads[0]).requires_grad_() if case.get("sinks") else None
    options = dict(scaling=0.37, sinks=sinks, sliding_window=case.get("sliding_window"))
    out, grads = run(torch_varlen_tree_attention, q, k, v, kv_end, position_ids, **options)
    ref_out, ref_grads = run(reference_tree_attention, q, k, v, kv_end, position_ids, **options)
    assert out.shape == ref_out.shape and out.dtype == torch.float64
    assert relative_error(out, ref_out) <= TOLERANCE
    assert len(grads) == len(ref_grads)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert relative_error(grad, ref_grad) <= TOLERANCE


def test_whole_paths_plan_matches_reference_in_float64():
    """The one-call plan over whole root-to-segment paths (the alternative the threshold benchmark times), passed to
    the engine without a window."""
    kv_end, position_ids = long_segment_rows()
    q, k, v = qkv(kv_end, (4, 2), torch.float64)
    paths = plan_varlen_paths(kv_end, window=None)
    out, grads = run(functools.partial(torch_varlen_tree_attention, plan=paths), q, k, v, kv_end, None, scaling=0.37)
    ref_out, ref_grads = run(reference_tree_attention, q, k, v, kv_end, position_ids, scaling=0.37)
    assert relative_error(out, ref_out) <= TOLERANCE
    assert all(relative_error(g, r) <= TOLERANCE for g, r in zip(grads, ref_grads, strict=True))


class _RepeatingKernel(CpuVarlen):
    """The CPU kernel taking grouped K/V only for the calls ``grouped`` accepts (torch 2.11's flash kernel takes none,
    torch 2.13's none of one-query calls): records the K/V heads of each call."""

    def __init__(self, grouped) -> None:
        self.grouped = grouped
        self.key_heads: list[int] = []

    def takes_grouped_kv(self, call) -> bool:
        return self.grouped(call)

    def forward(self, q, k, v, call, causal, scale, window):
        self.key_heads.append(k.shape[1])
        return super().forward(q, k, v, call, causal, scale, window)


@pytest.mark.parametrize("grouped", ["none", "self-call-only", "ancestors-only"])
@pytest.mark.parametrize("heads", HEADS[1:])
def test_kernel_without_grouped_kv_gets_repeated_heads_and_the_same_gradients(heads, grouped, monkeypatch):
    kv_end, position_ids = long_segment_rows()
    self_call = cached_varlen_plan(kv_end).parts[0].call
    accepts = {"none": lambda c: False, "self-call-only": lambda c: c is self_call}
    kernel = _RepeatingKernel(accepts.get(grouped, lambda c: c is not self_call))
    monkeypatch.setattr(varlen_module, "varlen_kernel", lambda device: kernel)
    q, k, v = qkv(kv_end, heads, torch.float64)
    out, grads = run(torch_varlen_tree_attention, q, k, v, kv_end, position_ids, scaling=0.37)
    ref_out, ref_grads = run(reference_tree_attention, q, k, v, kv_end, position_ids, scaling=0.37)
    full, grouped_heads = heads
    expected = {"none": [full, full], "self-call-only": [grouped_heads, full], "ancestors-only": [full, grouped_heads]}[
        grouped
    ]
    assert kernel.key_heads == expected  # the self call, then the ancestors call
    assert relative_error(out, ref_out) <= TOLERANCE
    assert all(relative_error(g, r) <= TOLERANCE for g, r in zip(grads, ref_grads, strict=True))


def test_cuda_kernel_repeats_kv_for_one_query_calls_and_before_torch_2_13():
    """FlashAttention-2's decoding path (one query per sequence, GQA) returns its log-sum-exp in another layout: such
    calls get repeated K/V, as every call does where torch's varlen_attn declares no enable_gqa."""
    one_query, longer = (varlen_module._call([n, n], [5, 7], torch.device("cpu")) for n in (1, 3))
    assert CudaFlashVarlen(native_gqa=True).takes_grouped_kv(longer)
    assert not CudaFlashVarlen(native_gqa=True).takes_grouped_kv(one_query)
    assert not CudaFlashVarlen(native_gqa=False).takes_grouped_kv(longer)


@pytest.mark.parametrize("window", [None, 7], ids=["two-calls", "window-paths"])
@pytest.mark.parametrize("native_gqa", [True, False], ids=["grouped-kv", "repeated-kv"])
def test_cuda_kernel_path_runs_on_this_torchs_flash_ops_on_meta_tensors(native_gqa, window):
    """The CUDA kernel's calls bind to this torch's ``aten::_flash_attention_forward``/``_backward`` schemas, and
    their meta kernels return the layouts the engine merges (``lse [H, T]`` float32, checked in ``forward``): the whole
    autograd function runs through them on meta tensors, forward and backward (shapes and dtypes only; the values
    are the ``gpu`` tests')."""
    kv_end, _ = long_segment_rows()
    meta = torch.device("meta")
    plan = plan_varlen(kv_end, device=meta) if window is None else plan_varlen_paths(kv_end, window + 1, device=meta)
    tokens = kv_end.numel()
    q, k, v = (torch.empty(tokens, h, 64, dtype=torch.bfloat16, device=meta, requires_grad=True) for h in (4, 2, 2))
    sinks = torch.empty(4, dtype=torch.bfloat16, device=meta, requires_grad=True)
    kernel = CudaFlashVarlen(native_gqa=native_gqa)
    out = varlen_module._VarlenTreeAttention.apply(q, k, v, sinks, plan, 0.125, window, kernel)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v, sinks))
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert [(g.shape, g.dtype) for g in grads] == [(x.shape, x.dtype) for x in (q, k, v, sinks)]


def test_installed_torch_declares_native_gqa():
    """torch 2.13's ``varlen_attn`` takes ``enable_gqa`` (K/V are then never repeated); 2.11's does not."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    assert torch_declares_varlen_gqa() == ((major, minor) >= (2, 13))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES[1::2])  # sinks; window and sinks
def test_low_precision_error_within_twice_eager(dtype, case):
    kv_end, position_ids = long_segment_rows(seed=1)
    q, k, v = qkv(kv_end, (4, 2), dtype)
    assert_within_twice_eager(torch_varlen_tree_attention, q, k, v, kv_end, position_ids, HEAD_DIM**-0.5, case)


def test_autocast_runs_the_kernel_in_the_autocast_dtype():
    kv_end, position_ids = grpo_row()
    q, k, v = qkv(kv_end, (4, 2), torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch_varlen_tree_attention(q, k, v, kv_end, TreeAttentionOptions(scaling=0.3))
    low = [x.detach().to(torch.bfloat16) for x in (q, k, v)]
    expected = torch_varlen_tree_attention(*low, kv_end, TreeAttentionOptions(scaling=0.3))
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and torch.isfinite(q.grad).all()


def test_rows_that_see_only_themselves_give_no_nan():
    """Padding keys (kv_end = j + 1) and a row of one-token trees: each query sees itself only, output = v."""
    kv_end = torch.arange(1, 41, dtype=torch.int32)[None]
    q, k, v = qkv(kv_end, (4, 2), torch.float64)
    out, grads = run(torch_varlen_tree_attention, q, k, v, kv_end, None, scaling=0.5)
    assert relative_error(out, v.detach().repeat_interleave(2, dim=1).transpose(1, 2)) <= TOLERANCE
    assert all(torch.isfinite(g).all() for g in grads) and grads[0].abs().max() <= 1e-12


@pytest.mark.parametrize(
    "option, reason",
    [
        (dict(softcap=2.0), "no soft-capping"),
        (dict(attention_chunk=8), "no chunked attention"),
    ],
)
def test_refusals_name_the_option_and_reason(option, reason):
    kv_end, position_ids = long_segment_rows()
    q, k, v = qkv(kv_end, (4, 2), torch.float64)
    options = TreeAttentionOptions(scaling=1.0, position_ids=position_ids, **option)
    with pytest.raises(EngineRefused, match=f"backend 'varlen' cannot run this call: {next(iter(option))}=.*{reason}"):
        torch_varlen_tree_attention(q, k, v, kv_end, options)
    blocks = torch.full_like(kv_end, -1)
    assert varlen_module.varlen_refusal(q, TreeAttentionOptions(scaling=1.0, bidirectional_block=blocks)) is None
    blocks[0, 1:4] = 0
    assert "bidirectional blocks" in varlen_module.varlen_refusal(
        q, TreeAttentionOptions(1.0, bidirectional_block=blocks)
    )


def test_cuda_kernel_refusals_name_the_reason(monkeypatch):
    cuda = torch.device("cuda")
    assert "float16/bfloat16 only" in cuda_kernel_refusal(torch.float32, 64, cuda)
    assert "head dim 260" in cuda_kernel_refusal(torch.bfloat16, 260, cuda)
    assert "head dim 36" in cuda_kernel_refusal(torch.bfloat16, 36, cuda)
    monkeypatch.setattr(varlen_kernels, "_varlen_attn_parameters", frozenset)  # torch < 2.10: no varlen module
    assert "has no varlen attention" in cuda_kernel_refusal(torch.bfloat16, 64, cuda)
    assert not torch_declares_varlen_gqa()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_cuda_rule_picks_varlen_for_long_segments_else_flash_attn_or_flex(monkeypatch):
    """The automatic CUDA engine's rule, on CPU tensors (the varlen engine's CPU kernel runs them): long segments ->
    varlen (forward and backward equal the reference), also with sinks or windows; short segments or soft-capping ->
    flash-attn where it computes the call, else flex."""
    long_rows, short_rows = long_segment_rows(), packed_rows(seed=3)
    assert cached_varlen_plan(long_rows[0]).tokens_per_sequence >= VARLEN_MIN_TOKENS_PER_SEQUENCE
    assert cached_varlen_plan(short_rows[0]).tokens_per_sequence < VARLEN_MIN_TOKENS_PER_SEQUENCE

    def choice(rows, **extra) -> str:
        kv_end, position_ids = rows
        q, _, v = qkv(kv_end, (4, 2), torch.float64)
        return cuda_engine_choice(q, v, kv_end, TreeAttentionOptions(scaling=0.3, position_ids=position_ids, **extra))

    assert (
        choice(long_rows) == choice(long_rows, sinks=torch.zeros(4)) == choice(long_rows, sliding_window=4) == "varlen"
    )
    assert choice(short_rows) == "flex" and choice(long_rows, softcap=2.0) == "flex"
    monkeypatch.setattr(flash_module, "flash_attn_refusal", lambda *args: None)  # as if flash-attn computed it
    assert choice(long_rows, softcap=2.0) == "flash_attn" and choice(long_rows, sliding_window=4) == "varlen"
    assert choice(short_rows) == "flash_attn" and choice(long_rows) == "varlen"
    monkeypatch.setattr(cuda_module, "VARLEN_MIN_TOKENS_PER_SEQUENCE", 10**6)
    assert choice(long_rows) == "flash_attn"
    monkeypatch.undo()
    kv_end, position_ids = long_rows
    q, k, v = qkv(kv_end, (4, 2), torch.float64)
    out, grads = run(cuda_tree_attention, q, k, v, kv_end, position_ids, scaling=0.37)
    ref_out, ref_grads = run(reference_tree_attention, q, k, v, kv_end, position_ids, scaling=0.37)
    assert relative_error(out, ref_out) <= TOLERANCE
    assert all(relative_error(g, r) <= TOLERANCE for g, r in zip(grads, ref_grads, strict=True))


@pytest.mark.parametrize(
    "backend, engine",
    [("varlen", torch_varlen_tree_attention), ("flash_attn", flash_module.flash_tree_attention)],
    ids=["varlen", "flash_attn"],
)
def test_cuda_varlen_engines_are_forceable_backends(monkeypatch, backend, engine):
    """``HF_TREE_ATTENTION_BACKEND`` forces either CUDA varlen engine; unset, CUDA takes the auto rule's engine."""
    monkeypatch.setenv("HF_TREE_ATTENTION_BACKEND", backend)
    assert select_backend(torch.device("cuda")) == backend and ENGINES[backend] is engine
    monkeypatch.delenv("HF_TREE_ATTENTION_BACKEND")
    assert ENGINES[select_backend(torch.device("cuda"))] is cuda_tree_attention


def test_varlen_and_flash_attn_stand_in_agree():
    """The two CUDA varlen designs on one row: ``varlen`` (two calls, merged) and ``flash_attn``'s gathered paths
    through the torch stand-in of ``flash_attn_varlen_func``."""
    kv_end, _ = long_segment_rows()
    q, k, v = qkv(kv_end, (4, 2), torch.float64)
    with torch.no_grad():
        ours = torch_varlen_tree_attention(q, k, v, kv_end, TreeAttentionOptions(scaling=0.37))
        theirs = flash_module.varlen_tree_attention(q, k, v, kv_end, scaling=0.37, attend=varlen_attention)
    assert relative_error(ours, theirs) <= TOLERANCE


def loss_and_grads(model, loss_fn):
    model.zero_grad()
    loss = loss_fn()
    loss.backward()
    return loss.detach(), grads_of(model)


@pytest.mark.parametrize(
    "family, overrides",
    [
        pytest.param("llama", {}, id="llama"),
        pytest.param("qwen3", {}, id="qwen3"),
        pytest.param("gpt_oss", {"layer_types": ["full_attention"] * 2}, id="gpt_oss-sinks"),
        pytest.param("gpt_oss", {}, id="gpt_oss-sinks-window4"),  # window 4 on half of the layers
        pytest.param("mistral", {"sliding_window": 4}, id="mistral-window4"),
    ],
)
def test_tiny_models_through_varlen_match_per_branch_in_float64(family, overrides):
    """Loss and every parameter gradient of a tree batch (several forests per row, rows, padding) with the engine
    forced, against each branch run alone through the model's own attention."""
    groups, batch = forest(seed=1)
    set_attention_backend("varlen")
    try:
        with float64_norms():
            model = tiny_model(family, vocab_size=97, **overrides)
            loss, grads = loss_and_grads(model, lambda: tree_causal_lm_loss(model, batch))
            ref_loss, ref_grads = loss_and_grads(model, lambda: per_branch_forest_loss(model, groups))
    finally:
        set_attention_backend(None)
    assert relative_error(loss, ref_loss) <= TOLERANCE
    assert max_grad_relative_error(grads, ref_grads) <= TOLERANCE


def test_a_softcapped_model_is_refused_by_name():
    _, batch = forest(seed=1)
    set_attention_backend("varlen")
    try:
        model = tiny_model("gemma2", vocab_size=97, head_dim=8, sliding_window=3, attn_logit_softcapping=0.5)
        with pytest.raises(VarlenRefused, match="softcap=0.5: PyTorch's flash varlen kernel has no soft-capping"):
            tree_causal_lm_loss(model, batch)
    finally:
        set_attention_backend(None)


@pytest.mark.slow  # a benchmark script in a subprocess, as the other benchmark smoke tests
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device runs the real timing")
def test_threshold_benchmark_without_cuda_prints_the_rules_choices():
    """``benchmarks/varlen_threshold.py`` (the sweep that tunes ``VARLEN_MIN_TOKENS_PER_SEQUENCE`` on a GPU) lists
    its rows and the rule's choice for each without CUDA, and exits 0."""
    lines = run_benchmark("varlen_threshold.py", "--quick", timeout=120).stdout.splitlines()
    assert lines[0].startswith("varlen_threshold: no CUDA device")
    rows = [line.split(" | ") for line in lines if line.startswith("| 16 ") or line.startswith("| 256 ")]
    assert [row[2] for row in rows] == ["flex", "varlen"] and all("skipped" in row[3] for row in rows)


GPU_HEAD_DIM = 64


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", HEADS[1:])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rows", ROWS)
def test_varlen_on_cuda_within_twice_eager(dtype, heads, case, rows):
    """PyTorch's flash varlen kernel: output and q/k/v (and sink) gradients within twice eager's error in the same
    dtype, against the float64 reference."""
    reason = cuda_kernel_refusal(dtype, GPU_HEAD_DIM, torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    kv_end, position_ids = (x.cuda() for x in ROWS[rows]())
    q, k, v = qkv(kv_end, heads, dtype, device="cuda", head_dim=GPU_HEAD_DIM)
    assert_within_twice_eager(torch_varlen_tree_attention, q, k, v, kv_end, position_ids, GPU_HEAD_DIM**-0.5, case)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_automatic_cuda_engine_within_twice_eager(dtype):
    """The automatic engine on a GRPO-like row: varlen in bfloat16, flex in float32 (the flash kernel takes half
    types only); forward and backward within twice eager's error in the same dtype."""
    kv_end, position_ids = (x.cuda() for x in long_segment_rows())
    q, k, v = qkv(kv_end, (4, 2), dtype, device="cuda", head_dim=GPU_HEAD_DIM)
    options = TreeAttentionOptions(scaling=GPU_HEAD_DIM**-0.5, position_ids=position_ids)
    expected = ("varlen",) if cuda_kernel_refusal(dtype, GPU_HEAD_DIM, q.device) is None else ("flash_attn", "flex")
    assert cuda_engine_choice(q, v, kv_end, options) in expected
    assert_within_twice_eager(cuda_tree_attention, q, k, v, kv_end, position_ids, options.scaling, {})
