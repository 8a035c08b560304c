"""Depth-first execution (``hf_tree.depth_first``) against the oracle: every branch run alone through the same model
with its own attention (``sdpa``, ``eager`` for softcapping/sinks), float64, RMSNorm kept in float64.

The trees are cut into many units (small ``max_unit_tokens``): pieces of long nodes, sibling groups, several levels
of cached keys/values, so every path of the executor (prefix attention, cache gradients, edges crossing units) runs.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peft import LoraConfig, get_peft_model

from hf_tree import Tree, TreeDataCollator, tree_causal_lm_loss
from hf_tree import depth_first as depth_first_module
from hf_tree.attention import (
    ENGINES,
    PrefixCache,
    TreeAttentionOptions,
    attention_engine_scope,
    prefix_tree_attention,
    reference_tree_attention,
)
from hf_tree.depth_first import DepthFirstConfig, Unit, depth_first_backward, plan_units
from hf_tree.models.head import detect_logit_head
from hf_tree.models.mixers import build_topology, tree_chunk_gated_delta_rule, tree_mamba2_chunk_scan
from tests.helpers import (
    FLOAT32_FLOOR,
    VOCAB,
    float32_floor_grad_error,
    float64_norms,
    grads_of,
    hybrid_model,
    max_grad_relative_error,
    per_branch_forest_loss,
    relative_error,
    tiny_model,
)
from tests.workloads import random_tree_branches

TOLERANCE = 1e-9
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py


def branch_groups(seed: int = 0, num_trees: int = 2) -> list[tuple[list[list[int]], list[list[int]]]]:
    """Random trees with a long shared prompt (cut into pieces), nested branch points and masked tokens."""
    rng = random.Random(seed)
    groups = []
    for _ in range(num_trees):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(9, 14))]
        sequences, masks = random_tree_branches(rng, rng.randint(4, 7), max_len=16)
        groups.append(([prompt + s for s in sequences], [[0] * len(prompt) + m for m in masks]))
    return groups


def oracle(model, groups, normalization: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = per_branch_forest_loss(model, groups, normalization)
    loss.backward()
    return loss.detach(), grads_of(model)


def depth_first(model, groups, normalization: str, max_unit_tokens: int = 6) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    trees = [Tree.from_sequences(s, m) for s, m in groups]
    loss = depth_first_backward(model, trees, DepthFirstConfig(max_unit_tokens), normalization)
    return loss, grads_of(model)


def assert_matches_oracle(model, groups, normalization: str = "token", tolerance: float = TOLERANCE) -> None:
    loss, grads = depth_first(model, groups, normalization)
    ref_loss, ref_grads = oracle(model, groups, normalization)
    assert relative_error(loss, ref_loss) <= tolerance
    assert max_grad_relative_error(grads, ref_grads) <= tolerance


@pytest.mark.parametrize(
    "family, overrides",
    [
        pytest.param("llama", {}, id="llama"),
        pytest.param("qwen3", {}, id="qwen3"),
        pytest.param("mistral", {"sliding_window": 4}, id="mistral-window4"),
        pytest.param("qwen2", {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 0}, id="qwen2-w3"),
        pytest.param("gpt_oss", {}, id="gpt_oss-sinks-window4"),
    ],
)
def test_depth_first_matches_per_branch(family, overrides):
    with float64_norms():
        assert_matches_oracle(tiny_model(family, vocab_size=VOCAB, **overrides), branch_groups())


@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_depth_first_normalizations_match_per_branch(normalization):
    with float64_norms():
        assert_matches_oracle(tiny_model(vocab_size=VOCAB), branch_groups(seed=1, num_trees=3), normalization)


def test_softcapped_gemma2_matches_per_branch():
    """Attention and final-logit softcapping with a window (eager oracle). Gemma's RMSNorm computes in float32 even
    in float64 (not patched): ~1e-7, against ~1e-1 for a lost window or prefix."""
    model = tiny_model("gemma2", vocab_size=VOCAB, head_dim=8, sliding_window=3, attn_logit_softcapping=0.5)
    assert_matches_oracle(model, branch_groups(seed=2), tolerance=1e-6)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_lora_and_gradient_checkpointing_match_per_branch(checkpointing):
    with float64_norms():
        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
        model = get_peft_model(tiny_model(vocab_size=VOCAB), config)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        assert_matches_oracle(model, branch_groups(seed=3))


def test_whole_tree_in_one_unit_is_the_packed_row():
    groups = branch_groups(seed=4, num_trees=1)
    tree = Tree.from_sequences(*groups[0])
    assert plan_units(tree, tree.num_tokens) == [Unit(0, tree.num_tokens, tree.num_tokens)]
    with float64_norms():
        model = tiny_model(vocab_size=VOCAB)
        loss, grads = depth_first(model, groups, "token", max_unit_tokens=tree.num_tokens)
        model.zero_grad()
        batch = TreeDataCollator(max_packed_tokens=tree.num_tokens)([tree])
        packed = tree_causal_lm_loss(model, batch)
        packed.backward()
    assert relative_error(loss, packed) <= 1e-12
    assert max_grad_relative_error(grads, grads_of(model)) <= 1e-12


def test_dropping_the_cache_gradient_is_detected(monkeypatch):
    """The comparison can fail: backpropagating each unit's loss without its descendants' cache gradients (the
    cached keys/values treated as constants) misses the gradient every shared prefix gets from its branches."""

    def without_cache_gradients(self) -> None:
        if self.output_grads[0] is not None:
            torch.autograd.backward(self.outputs[:1], self.output_grads[:1])

    groups = branch_groups(seed=5)
    with float64_norms():
        model = tiny_model(vocab_size=VOCAB)
        ref_loss, ref_grads = oracle(model, groups, "token")
        monkeypatch.setattr(depth_first_module._Pending, "backward", without_cache_gradients)
        loss, grads = depth_first(model, groups, "token")
    assert relative_error(loss, ref_loss) <= TOLERANCE  # the forward is right...
    assert max_grad_relative_error(grads, ref_grads) > 1e-3  # ...the gradient is not


def test_plan_of_a_grpo_group():
    """A 20-token prompt with 16 completions of 3 tokens, 16 tokens a unit: the prompt in pieces of 16 and 4, then
    the completions one by one (16 - 20 < 16 / 4: a quarter row, 4 tokens) over the prompt's cache; with 26 tokens a
    unit, the prompt in one piece, then the completions as they fit beside it (26 - 20 = 6 tokens: two by two)."""
    tree = Tree.from_sequences([list(range(3, 23)) + [30 + i, 60, 61] for i in range(16)])
    singles = [Unit(s, s + 3, s + 3) for s in range(20, tree.num_tokens, 3)]
    pairs = [Unit(s, s + 6, s + 6) for s in range(20, tree.num_tokens, 6)]
    assert plan_units(tree, 16) == [Unit(0, 16, tree.num_tokens), Unit(16, 20, tree.num_tokens), *singles]
    assert plan_units(tree, 26) == [Unit(0, 20, tree.num_tokens), *pairs]
    assert [u.keeps_cache for u in plan_units(tree, 26)[:2]] == [True, False]


@pytest.mark.parametrize("seed", range(4))
def test_plan_tiles_the_tree_and_fits_the_budget(seed):
    rng = random.Random(seed)
    forest = Tree.from_sequences(*random_tree_branches(rng, 12, max_len=30))
    units = plan_units(forest, 7)
    assert [u.start for u in units[1:]] == [u.end for u in units[:-1]]
    assert units[0].start == 0 and units[-1].end == forest.num_tokens
    assert all(0 < u.end - u.start <= 7 for u in units)


def test_lfm2_convolutions_match_per_branch():
    """LFM2's short convolutions read their ancestors' inputs across units (the cached convolution inputs); its
    norms and convolutions compute in float32 inside a float64 model (``FLOAT32_FLOOR``). With the cached inputs
    dropped (every unit's window starting from zeros) the gradients are off by 0.77 and the first-use probe refuses."""
    model = hybrid_model("lfm2")
    assert_matches_oracle(model, branch_groups(seed=6), tolerance=FLOAT32_FLOOR)


def recurrent_hybrid(family: str) -> torch.nn.Module:
    """The tiny float64 hybrid of ``family``, its Mamba2 mixers given a long memory (``D = 0``, ``A = -0.1``,
    ``dt_bias = 0``): at init their ``D`` skip path dominates the scan's output and its state fades within a few
    tokens, so that even a dropped state would move the gradients by only ~1e-6."""
    model = hybrid_model(family)
    long_memory = {"D": 0.0, "A_log": math.log(0.1), "dt_bias": 0.0}
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            short = name.rsplit(".", 1)[-1]
            if ("mamba" in name or "mixer" in name) and short in long_memory:
                parameter.fill_(long_memory[short])
    return model


@pytest.mark.parametrize(
    "family",
    ["qwen3_5_text", "bamba", *(pytest.param(f, marks=pytest.mark.slow) for f in ("qwen3_next", "nemotron_h"))],
)
def test_recurrent_hybrids_match_per_branch(family):
    """GatedDeltaNet (Qwen3.5, Qwen3-Next) and Mamba2 (Bamba, Nemotron-H) layers start a unit's roots from the
    state their nearest cached ancestor piece ended with, and their convolutions read its inputs. The oracle's own
    mixers compute in float32 inside a float64 model (``FLOAT32_FLOOR``, as tests/test_hybrid_mixers.py; measured
    ~3e-8..2e-6, the packed row's own error against the branches; the loss <= 6e-11). Against the same trees packed
    (the same float64 tree ops): loss ~2e-16, gradients <= 2e-7 (``A_log``, exponentiated in float32 by the model)."""
    model = recurrent_hybrid(family)
    groups = branch_groups(seed=6)
    loss, grads = depth_first(model, groups, "token")
    ref_loss, ref_grads = oracle(model, groups, "token")
    assert relative_error(loss, ref_loss) <= 1e-8
    assert float32_floor_grad_error(grads, ref_grads) <= FLOAT32_FLOOR
    assert_matches_packed(model, groups, loss, grads)


def assert_matches_packed(model, groups, loss: torch.Tensor, grads: dict, normalization: str = "token") -> None:
    """``loss``/``grads`` of a depth-first run equal the trees packed in one row (the same float64 tree ops; ``A_log``'s
    gradient passes through the model's float32 exponential: ~2e-7, 1.9e-6 seen on a random forest in units of 3)."""
    model.zero_grad()
    trees = [Tree.from_sequences(s, m) for s, m in groups]
    collator = TreeDataCollator(max_packed_tokens=sum(t.num_tokens for t in trees), normalization=normalization)
    packed = tree_causal_lm_loss(model, collator(trees))
    packed.backward()
    assert relative_error(loss, packed) <= 1e-12
    assert max_grad_relative_error(grads, grads_of(model)) <= 1e-5


@pytest.mark.parametrize("family", ["qwen3_5_text", pytest.param("bamba", marks=pytest.mark.slow)])
def test_recurrent_hybrid_with_gradient_checkpointing(family):
    """A checkpointed layer's recompute runs its convolution and scan again and records the same entries."""
    model = recurrent_hybrid(family)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    groups = branch_groups(seed=7)
    assert_matches_packed(model, groups, *depth_first(model, groups, "token"))


@pytest.mark.slow
@given(
    seed=st.integers(0, 2**31),
    max_unit_tokens=st.integers(1, 24),
    family=st.sampled_from(["qwen3_5_text", "bamba"]),
    normalization=st.sampled_from(["token", "sequence"]),
)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_recurrent_hybrids_in_random_units_match_packed(seed, max_unit_tokens, family, normalization):
    """Random forests in any unit size, down to one token (every token a unit, a cached state per token), against
    the same forest packed."""
    rng = random.Random(seed)
    groups = [random_tree_branches(rng, rng.randint(1, 5)) for _ in range(2)]
    model = recurrent_hybrid(family)
    assert_matches_packed(model, groups, *depth_first(model, groups, normalization, max_unit_tokens), normalization)


@pytest.mark.parametrize(
    "family",  # the probe that catches it is one code path: the fast tier runs it on the delta rule
    ["qwen3_5_text", pytest.param("bamba", marks=pytest.mark.slow)],
)
def test_dropping_the_carried_state_is_detected(family, monkeypatch):
    """The comparison can fail: with the state entering a unit treated as a constant (its gradient not passed back
    into the ancestor piece) the loss is right and the gradient off by > 1e-3 (measured 0.16 for Qwen3.5, 0.034 for
    Bamba); with every unit started from a zero state too, and the first-use probe refuses Qwen3.5."""
    groups = branch_groups(seed=6)
    model = recurrent_hybrid(family)
    ref_loss, ref_grads = oracle(model, groups, "token")
    assert depth_first_module.probe_depth_first(model, model, detect_logit_head(model)) <= 1e-12  # carried: passes
    join = PrefixCache.join

    def carried(transform):
        def joined(key, entries):
            entry = join(key, entries)
            return transform(entry) if key[0] == "state" else entry

        return staticmethod(joined)

    monkeypatch.setattr(PrefixCache, "join", carried(torch.Tensor.detach))
    loss, grads = depth_first(model, groups, "token")
    assert relative_error(loss, ref_loss) <= 1e-8  # the forward is right...
    assert float32_floor_grad_error(grads, ref_grads) > 1e-3  # ...the gradient is not
    monkeypatch.setattr(PrefixCache, "join", carried(torch.zeros_like))
    loss, grads = depth_first(model, groups, "token")
    assert float32_floor_grad_error(grads, ref_grads) > 1e-3
    if family == "qwen3_5_text":  # the tiny Mamba2 hybrid's hidden states move by ~1e-5 only, under the probe's 1e-4
        with pytest.raises(ValueError, match=r"depth_first' is not exact for Qwen3_5ForCausalLM"):
            depth_first_module.probe_depth_first(model, model, detect_logit_head(model))


def _delta_rule(inputs: list[torch.Tensor], topology, prefix) -> torch.Tensor:
    query, key, value, decay, beta = inputs
    g, beta = -torch.nn.functional.softplus(decay), beta.sigmoid()
    options = dict(chunk_size=4, use_qk_l2norm_in_kernel=True)
    return tree_chunk_gated_delta_rule(query, key, value, g, beta, topology, kv_prefix=prefix, **options)[0]


def _mamba2_scan(inputs: list[torch.Tensor], topology, prefix) -> torch.Tensor:
    x, dt, b, c = inputs
    A, D, dt_bias = torch.tensor([-0.1, -0.5, -1.0, -2.0], dtype=torch.float64), torch.ones(4) * 0.3, torch.zeros(4)
    options = dict(D=D.double(), dt_bias=dt_bias.double(), dt_softplus=True)
    return tree_mamba2_chunk_scan(x, dt, A, b, c, 4, topology=topology, kv_prefix=prefix, **options)


RECURRENCES = {  # op, [B, N, ...] input shapes (after B, N)
    "gated-delta-rule": (_delta_rule, [(2, 8), (2, 8), (4, 8), (4,), (4,)]),
    "mamba2-scan": (_mamba2_scan, [(4, 8), (4,), (2, 8), (2, 8)]),
}


@pytest.mark.parametrize("recurrence", list(RECURRENCES))
def test_recurrences_continue_the_cached_state_exactly(recurrence):
    """The ops in float64 (no float32 inside): two pieces of one node (the second and the mini-tree below them each
    start from the state the previous unit ended with) equal the scan of the whole row ``[pieces | mini-tree]`` at
    1e-12, outputs and input gradients, with each piece backpropagated after its descendants with its state's
    ``.grad``, as ``depth_first_backward`` does."""
    op, shapes = RECURRENCES[recurrence]
    mini_tree = Tree.from_sequences(*random_tree_branches(random.Random(7), 4, max_len=8))
    num_tokens = 11 + mini_tree.num_tokens
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(1, num_tokens, *shape, generator=generator, dtype=torch.float64) for shape in shapes]
    inputs = [x.requires_grad_() for x in inputs]
    row_kv_end = torch.cat([torch.full((11,), num_tokens), torch.from_numpy(mini_tree.kv_end) + 11])[None].int()
    whole = op(inputs, build_topology(row_kv_end), None)
    weights = torch.randn(whole.shape, generator=generator, dtype=torch.float64)
    expected = torch.autograd.grad((whole * weights).sum(), inputs)

    units = [(0, 5, torch.full((1, 5), 5)), (5, 11, torch.full((1, 6), 6))]
    units.append((11, num_tokens, torch.from_numpy(mini_tree.kv_end)[None]))
    outputs, carried, leaf = [], [], None
    for start, end, kv_end in units:
        prefix = PrefixCache.over({} if leaf is None else {("state", 0): leaf}, torch.zeros(1, start), kv_end, kv_end)
        prefix.mixer = 0  # what the mixer's convolution sets
        outputs.append(op([x[:, start:end] for x in inputs], build_topology(kv_end), prefix))
        state = prefix.own[("state", 0)]
        carried.append((outputs[-1], weights[:, start:end], state, leaf))
        leaf = state.detach().requires_grad_()
    assert relative_error(torch.cat(outputs, dim=1), whole) <= 1e-12
    for index, (output, weight, state, _) in enumerate(reversed(carried)):
        later_leaf = None if index == 0 else carried[-index][3]
        grads = [weight] + ([later_leaf.grad] if later_leaf is not None else [])
        torch.autograd.backward([output, state][: len(grads)], grads)
    for x, expected_grad in zip(inputs, expected, strict=True):
        assert relative_error(x.grad, expected_grad) <= 1e-12


@pytest.mark.parametrize("recurrence", list(RECURRENCES))
def test_a_recurrence_without_its_convolution_is_refused(recurrence):
    """A state is keyed by the convolution its mixer ran just before (the ops get no module), taken once: a second
    scan, or one with no convolution before it, would read another layer's state and is refused."""
    op, shapes = RECURRENCES[recurrence]
    inputs = [torch.randn(1, 3, *shape, dtype=torch.float64) for shape in shapes]
    kv_end = torch.full((1, 3), 3)
    prefix = PrefixCache.over({}, torch.zeros(1, 0), kv_end, kv_end)
    prefix.mixer = 0
    op(inputs, build_topology(kv_end), prefix)
    with pytest.raises(ValueError, match="without a causal convolution before it"):
        op(inputs, build_topology(kv_end), prefix)


def test_reentrant_gradient_checkpointing_is_refused():
    model = tiny_model(vocab_size=VOCAB)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    tree = Tree.from_sequences(*branch_groups()[0])
    with pytest.raises(ValueError, match="use_reentrant"):
        depth_first_backward(model, [tree], DepthFirstConfig(6))


OPTIONS = {
    "plain": {},
    "window": {"sliding_window": 3},
    "softcap": {"softcap": 0.5, "sliding_window": 4},
    "sinks": {"sinks": True},
}


@pytest.mark.parametrize("unit_kind", ["mini-tree", "piece"])
@pytest.mark.parametrize("num_prefix", [5, 120], ids=["row-engine", "dense-mask"])  # the two paths of the call
@pytest.mark.parametrize(
    "engine, options",
    [pytest.param("cpu", options, id=name) for name, options in OPTIONS.items()]
    + [pytest.param("segments", OPTIONS[name], id=f"segments-{name}") for name in ("plain", "sinks")]
    + [pytest.param("varlen", OPTIONS[name], id=f"varlen-{name}") for name in ("plain", "sinks", "window")],
)
def test_prefix_attention_is_the_attention_of_the_whole_row(engine, unit_kind, num_prefix, options):
    """A unit's queries over ``[prefix | unit]`` equal the reference engine on the whole row (prefix queries
    dropped): outputs, and gradients of the queries, of the unit's and the prefix's keys and values, and of sinks.
    Forcing ``segments`` runs only the unit's rectangles (a piece's segment starts in the prefix)."""
    options = dict(options)
    if unit_kind == "piece":
        unit = Tree.from_sequences([list(range(3, 60))])
    else:
        unit = Tree.from_sequences(*random_tree_branches(random.Random(num_prefix), 4, max_len=8))
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, n, total = 4, 2, 8, unit.num_tokens, num_prefix + unit.num_tokens

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_()

    query, key, value = randn(1, heads, n, dim), randn(1, kv_heads, total, dim), randn(1, kv_heads, total, dim)
    sinks = randn(heads) if options.pop("sinks", False) else None
    prefix_key, prefix_value = key[:, :, :num_prefix], value[:, :, :num_prefix]
    prefix = PrefixCache.over(
        {("key", 0): prefix_key, ("value", 0): prefix_value},
        torch.arange(num_prefix)[None],
        torch.from_numpy(unit.kv_end)[None].int(),
        torch.from_numpy(unit.position_ids)[None] + num_prefix,
    )
    got = prefix_tree_attention(
        query,
        key[:, :, num_prefix:],
        value[:, :, num_prefix:],
        prefix_key,
        prefix_value,
        prefix,
        ENGINES[engine],
        TreeAttentionOptions(scaling=0.3, sinks=sinks, **options),
    )
    row_queries = torch.cat([torch.zeros(1, heads, num_prefix, dim, dtype=torch.float64), query], dim=2)
    expected = reference_tree_attention(
        row_queries,
        key,
        value,
        prefix.row_kv_end,
        TreeAttentionOptions(scaling=0.3, position_ids=prefix.row_position_ids, sinks=sinks, **options),
    )[:, num_prefix:]
    weights = torch.randn(expected.shape, generator=generator, dtype=torch.float64)
    inputs = [query, key, value] + ([sinks] if sinks is not None else [])
    got_grads = torch.autograd.grad((got * weights).sum(), inputs)
    expected_grads = torch.autograd.grad((expected * weights).sum(), inputs)
    assert relative_error(got, expected) <= 1e-12
    for got_grad, expected_grad in zip(got_grads, expected_grads, strict=True):
        assert relative_error(got_grad, expected_grad) <= 1e-12


def _attention_without_prefix(query, key, value, prefix_key, prefix_value, prefix, engine, options):
    """``prefix_tree_attention`` with the ancestors' cache dropped: attention over the unit alone, as a model with
    its own cache-less context path would compute."""
    return engine(
        query,
        key,
        value,
        prefix.row_kv_end[:, -query.shape[2] :] - (prefix.row_kv_end.shape[1] - query.shape[2]),
        dataclasses.replace(options, position_ids=prefix.row_position_ids[:, -query.shape[2] :]),
    )


def test_probe_refuses_a_model_whose_units_lose_their_context(monkeypatch):
    """The first-use probe compares a depth-first run with the packed one: with the ancestors' cache dropped, it
    refuses."""
    import hf_tree.attention as attention

    model = tiny_model(vocab_size=VOCAB, dtype=torch.float32)
    assert depth_first_module.probe_depth_first(model, model, detect_logit_head(model)) < 1e-5
    monkeypatch.setattr(attention, "prefix_tree_attention", _attention_without_prefix)
    with pytest.raises(ValueError, match=r"depth_first' is not exact for LlamaForCausalLM"):
        depth_first_module.probe_depth_first(model, model, detect_logit_head(model))


def test_trainer_decides_depth_first_at_init(tmp_path, monkeypatch, caplog):
    """The depth-first probe runs when the trainer is built, not at the first tree larger than a row: a model that
    fails it is refused by ``"depth_first"`` and runs packed under ``"auto"`` (one log line naming why) before any
    step; a model that passes it runs depth-first."""
    import hf_tree.attention as attention
    from hf_tree.trainer import TreeTrainer, TreeTrainingArguments
    from tests import workloads
    from tests.helpers import exact_sgd_args

    def trainer(execution: str) -> TreeTrainer:
        settings = dict(max_steps=1, per_device_train_batch_size=4, use_cpu=True)
        args = TreeTrainingArguments(
            **exact_sgd_args(str(tmp_path / execution), **settings), max_packed_tokens=24, tree_execution=execution
        )
        model = tiny_model(vocab_size=VOCAB, dtype=torch.float32)
        return TreeTrainer(model=model, args=args, train_dataset=workloads.tree_dataset(workloads.branch_groups(5, 4)))

    assert trainer("auto").tree_depth_first is not None  # the control: the probe passes, depth-first it is
    monkeypatch.setattr(attention, "prefix_tree_attention", _attention_without_prefix)
    with pytest.raises(ValueError, match=r"tree_execution='depth_first' cannot run here: .*not exact for LlamaForCa"):
        trainer("depth_first")
    with caplog.at_level("WARNING", logger="hf_tree"):
        auto = trainer("auto")
    assert auto.tree_depth_first is None and auto.data_collator.packing.tree_execution == "packed"
    assert "tree_execution='auto' runs as 'packed' here (tree_execution='depth_first' is not exact" in caplog.text
    auto.train()  # packed: trees larger than the row are split by their branches
    assert auto.state.global_step == 1


def test_depth_first_refuses_a_scoped_attention_engine():
    """Tree context parallel scopes its own engine over sharded rows; a unit over its cache cannot run on it."""
    model = tiny_model(vocab_size=VOCAB)
    with attention_engine_scope(ENGINES["reference"]), pytest.raises(ValueError, match="attention_engine_scope"):
        depth_first(model, branch_groups(), "token")


@pytest.mark.slow
@given(
    seed=st.integers(0, 2**31),
    num_trees=st.integers(1, 3),
    max_unit_tokens=st.integers(1, 40),
    normalization=st.sampled_from(["token", "sequence"]),
)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_forests_in_random_units_match_per_branch(seed, num_trees, max_unit_tokens, normalization):
    """Any unit size, down to one token (every token its own unit, a cache level per token)."""
    rng = random.Random(seed)
    groups = [random_tree_branches(rng, rng.randint(1, 6)) for _ in range(num_trees)]
    with float64_norms():
        model = tiny_model(vocab_size=VOCAB)
        loss, grads = depth_first(model, groups, normalization, max_unit_tokens)
        ref_loss, ref_grads = oracle(model, groups, normalization)
    assert relative_error(loss, ref_loss) <= TOLERANCE
    assert max_grad_relative_error(grads, ref_grads) <= TOLERANCE


# Models whose attention differs from plain causal softmax: (tiny_model arguments, tolerance). Gemma 2's RMSNorm
# computes in float32 even in float64 (float64_norms does not patch it): ~1e-7, against ~1e-1 for a lost window.
MASKED_ATTENTION_MODELS = {
    "mistral-window3": ({"family": "mistral", "sliding_window": 3}, TOLERANCE),
    "gemma2-softcap-window3": (
        {"family": "gemma2", "head_dim": 8, "sliding_window": 3, "attn_logit_softcapping": 0.5},
        1e-6,
    ),
    "gpt_oss-sinks-window4": ({"family": "gpt_oss"}, TOLERANCE),
}


@pytest.mark.slow
@given(
    seed=st.integers(0, 2**31),
    max_unit_tokens=st.integers(1, 24),
    name=st.sampled_from(sorted(MASKED_ATTENTION_MODELS)),
)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_window_softcap_and_sink_models_in_random_units_match_per_branch(seed, max_unit_tokens, name):
    """Sliding windows, softcapping and sinks at any unit size: a window that starts inside a cached prefix, a unit
    of one token, a unit cut inside the prompt."""
    arguments, tolerance = MASKED_ATTENTION_MODELS[name]
    groups = branch_groups(seed=seed % 1000, num_trees=2)
    with float64_norms():
        model = tiny_model(vocab_size=VOCAB, **arguments)
        loss, grads = depth_first(model, groups, "token", max_unit_tokens)
        ref_loss, ref_grads = oracle(model, groups, "token")
    assert relative_error(loss, ref_loss) <= tolerance
    assert max_grad_relative_error(grads, ref_grads) <= tolerance
