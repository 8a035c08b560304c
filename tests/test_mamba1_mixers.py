"""Exact tree training on the Mamba-1 family: Mamba, Falcon-Mamba, Jamba (attention + Mamba + MoE) and Zamba
(Mamba + shared attention), whose mixers run a causal convolution and the selective scan.

Oracles as in tests/test_hybrid_mixers.py:
- op: each root-to-leaf branch run alone through transformers' own ``mamba_selective_scan`` (the torch fallback;
  it casts ``B`` and ``x`` to float32, so the float32 floor), and through the tree scan on the lone branch (float64,
  exact at 1e-12: values and input gradients).
- models: per-branch training with the model's own path, float64 weights. The models exponentiate ``A_log`` and
  normalise in float32 inside, so the bound is the float32 floor (measured ~1e-7); the bug this guards against
  (the packed row scanned as one sequence) moves gradients by > 1e-2.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from hf_tree import Tree, TreeDataCollator, tree_causal_lm_loss
from hf_tree import depth_first as depth_first_module
from hf_tree.attention import PrefixCache
from hf_tree.depth_first import DepthFirstConfig, depth_first_backward
from hf_tree.models.check import SELF_CHECK_ENV_VAR
from hf_tree.models.head import detect_logit_head
from hf_tree.models.mixers import (
    build_topology,
    install_tree_mixers,
    tree_mamba_selective_scan,
    uninstall_tree_mixers,
)
from hf_tree.trainer import TreeTrainer, TreeTrainingArguments
from tests.context_parallel_harness import ACCELERATE_CONFIG, FLOAT64_TOLERANCE, REPO, sharded_step, single_process
from tests.helpers import (
    FLOAT32_FLOOR,
    VOCAB,
    branch_loss_func,
    check_tree_op,
    collate_branches,
    common_args,
    finish_launched_worker,
    float32_floor_grad_error,
    free_port,
    generate_and_score,
    grads_of,
    hybrid_model,
    max_grad_relative_error,
    one_rank_context_parallel_errors,
    per_branch_forest_loss,
    random_token_inputs,
    relative_error,
)
from tests.workloads import (
    BRANCHES_PER_TREE,
    branch_dataset,
    branch_groups,
    deep_forest_rows,
    grpo_row,
    make_batch,
    packed_batch,
    tree_dataset,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py

MAMBA = dict(hidden_size=16, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4, time_step_rank=4)
# Tiny configs: two mixer layers each (Jamba: a Mamba layer, then attention with 4 experts; Zamba: a Mamba layer and
# two hybrid layers sharing one attention block, two Mamba heads, so a scan per head).
MAMBA1 = {
    "mamba": MAMBA,
    "falcon_mamba": MAMBA,
    "jamba": dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=4,
    ),
    "zamba": dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        layers_block_type=["mamba", "hybrid", "hybrid"],
        attention_hidden_size=64,
        attention_head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_mamba_heads=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=4,
    ),
}


def mamba1_model(family: str, long_memory: bool = False, **overrides) -> torch.nn.Module:
    """The tiny float64 model of ``family``, seeded. ``long_memory``: its scans keep their state (``A = -0.1``,
    ``D = 0``): at init ``A = -1..-8`` forgets within a few tokens and the ``D`` skip dominates the output, so that
    a dropped state would move the gradients little."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(family, vocab_size=VOCAB, **{**MAMBA1[family], **overrides})
    model = AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation="tree_flash", dtype=torch.float64, experts_implementation="eager"
    )
    if long_memory:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(".A_log"):
                    parameter.fill_(math.log(0.1))
                elif name.endswith(".D") and ("mixer" in name or "mamba" in name):
                    parameter.zero_()
    return model


def tree_and_branch_gradients(model):
    batch, groups = packed_batch()
    model.zero_grad(set_to_none=True)
    loss = tree_causal_lm_loss(model, batch)
    loss.backward()
    tree_grads = grads_of(model)
    model.zero_grad(set_to_none=True)
    reference = per_branch_forest_loss(model, groups)
    reference.backward()
    return loss, reference, tree_grads, grads_of(model)


def assert_matches_per_branch(model) -> None:
    loss, reference, tree_grads, ref_grads = tree_and_branch_gradients(model)
    assert relative_error(loss, reference) <= FLOAT32_FLOOR
    assert tree_grads.keys() == ref_grads.keys()
    assert float32_floor_grad_error(tree_grads, ref_grads) <= FLOAT32_FLOOR


# ------------------------------------------------------------------------------------------------------ op
def test_tree_selective_scan_matches_each_branch():
    """The packed forest of tests/test_hybrid_mixers.py (forks at depth 1, nested forks, a prefix branch, a duplicate,
    padding, a second tree), scan inputs random; Mamba's own fallback on each branch."""
    from transformers.models.mamba.modeling_mamba import mamba_selective_scan

    batch, _ = packed_batch()
    kv_end = batch["kv_end"]
    topology = build_topology(kv_end)
    x, dt, b, c, z = random_token_inputs(kv_end, (4,), (4,), (3,), (3,), (4,))
    generator = torch.Generator().manual_seed(3)
    A = -torch.rand(4, 3, dtype=torch.float32, generator=generator) - 0.1  # the models pass -exp(A_log.float())
    D, delta_bias = torch.randn(2, 4, dtype=torch.float64, generator=generator)
    options = dict(D=D, delta_bias=delta_bias, delta_softplus=True)
    original = mamba_selective_scan.__hf_tree_original__

    def channels_first(fn):  # the op's [B, X, L] from the test's [B, L, X], and back
        return lambda *t: fn(*(u.transpose(1, 2) for u in t)).transpose(1, 2)

    def scan(fn, **extra):
        return channels_first(lambda x, dt, b, c, z: fn(x, dt, A, b, c, z=z, **options, **extra))

    check_tree_op(
        scan(tree_mamba_selective_scan, topology=topology),
        scan(original),
        lambda lone, *t: scan(tree_mamba_selective_scan, topology=lone)(*t),
        [x, dt, b, c, z],
        kv_end,
    )


# ---------------------------------------------------------------------------------------------------- models
@pytest.mark.parametrize(
    "family", ["mamba", *(pytest.param(f, marks=pytest.mark.slow) for f in ("falcon_mamba", "jamba", "zamba"))]
)
def test_model_tree_training_matches_per_branch(family):
    assert_matches_per_branch(mamba1_model(family, long_memory=True))


@pytest.mark.parametrize("family", ["mamba", pytest.param("jamba", marks=pytest.mark.slow)])
def test_gradient_checkpointing_stays_on_and_recomputes_the_tree(family):
    """hf_tree hands kv_end on through blocks that drop it (MambaBlock, JambaMambaDecoderLayer) by wrapping their
    forward inside transformers' checkpointing wrapper, so a block stays checkpointed (its mixer runs again in
    backward) and its recompute sees the tree too."""
    model = mamba1_model(family, long_memory=True)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    mixers = [m for m in model.modules() if type(m).__name__.endswith("Mixer")]
    calls = []
    for mixer in mixers:
        mixer.register_forward_hook(lambda *_: calls.append(1))
    batch, _ = packed_batch()
    tree_causal_lm_loss(model, batch).backward()
    assert len(calls) >= 2 * len(mixers)  # forward and recompute (the self-check's probe runs without gradients)
    assert_matches_per_branch(model)


@pytest.mark.slow
def test_bfloat16_tree_error_is_no_worse_than_per_branch():
    """In bfloat16 (float32 states, as the fallback) the tree's gradient error against float64 per-branch training
    is within 2x of bfloat16 per-branch training's own."""
    model = mamba1_model("mamba", long_memory=True)
    exact = tree_and_branch_gradients(model)[3]
    low = copy.deepcopy(model).to(torch.bfloat16)
    _, _, tree_grads, branch_grads = tree_and_branch_gradients(low)
    tree_error = float32_floor_grad_error({n: g.double() for n, g in tree_grads.items()}, exact)
    branch_error = float32_floor_grad_error({n: g.double() for n, g in branch_grads.items()}, exact)
    assert tree_error <= 2 * branch_error


def test_without_tree_mixers_the_same_check_fails(monkeypatch):
    """The oracle has teeth: with the models' own mixers (the row scanned as one sequence) the first-use probe
    refuses Mamba, and with the check off the gradients are visibly wrong."""
    model = mamba1_model("mamba", long_memory=True)
    uninstall_tree_mixers()
    try:
        with pytest.raises(ValueError, match="MambaMixer"):
            tree_and_branch_gradients(model)
        monkeypatch.setenv(SELF_CHECK_ENV_VAR, "0")
        _, _, tree_grads, ref_grads = tree_and_branch_gradients(mamba1_model("mamba", long_memory=True))
    finally:
        install_tree_mixers()
    assert float32_floor_grad_error(tree_grads, ref_grads) > 1e-2


def test_batches_without_kv_end_are_unchanged():
    """Padded logits and cached greedy decoding (``mamba_selective_state_update``, ``causal_conv1d_update``) are
    the models' own with or without the tree mixers."""
    model = mamba1_model("mamba").eval()
    input_ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    attention_mask = (torch.arange(6) >= torch.tensor([[2], [0]])).long()
    with torch.no_grad():
        installed = generate_and_score(model, input_ids, attention_mask)
        uninstall_tree_mixers()
        try:
            original = generate_and_score(model, input_ids, attention_mask)
        finally:
            install_tree_mixers()
    torch.testing.assert_close(installed[0], original[0], rtol=0, atol=0)
    assert torch.equal(installed[1], original[1])


def test_tree_batches_refuse_a_cache():
    model = mamba1_model("mamba")
    batch, _ = packed_batch()
    with pytest.raises(ValueError, match="use_cache=False"):
        model(input_ids=batch["input_ids"], kv_end=batch["kv_end"], use_cache=True)


def test_one_rank_context_parallel_equals_packed():
    """Under hf_tree's context parallel the scan runs on the whole row gathered from the ranks (``SEQUENCE_DIMS``);
    on one rank this is the packed run."""
    batch, _ = packed_batch()
    loss_error, grad_error = one_rank_context_parallel_errors(mamba1_model("mamba", long_memory=True), batch)
    assert loss_error <= 1e-12
    assert grad_error <= 1e-12


# ----------------------------------------------------------------------------------------------- depth-first
def depth_first_and_packed(model, groups, max_unit_tokens: int = 6):
    """(depth-first loss, its gradients, the same trees packed in one row: loss, gradients)."""
    trees = [Tree.from_sequences(s, m) for s, m in groups]
    model.zero_grad(set_to_none=True)
    loss = depth_first_backward(model, trees, DepthFirstConfig(max_unit_tokens), "token")
    grads = grads_of(model)
    model.zero_grad(set_to_none=True)
    collator = TreeDataCollator(max_packed_tokens=sum(t.num_tokens for t in trees))
    packed = tree_causal_lm_loss(model, collator(trees))
    packed.backward()
    return loss, grads, packed, grads_of(model)


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("mamba", {}),
        pytest.param("jamba", {}, marks=pytest.mark.slow),
        pytest.param(
            "zamba", {"num_hidden_layers": 2, "layers_block_type": ["mamba", "mamba"]}, marks=pytest.mark.slow
        ),
    ],
    ids=["mamba", "jamba", "zamba-mamba-layers"],
)
def test_depth_first_matches_per_branch_and_packed(family, overrides):
    """Trees cut into units of 6 tokens: each unit's scans start its roots from the state its nearest cached ancestor
    piece ended with (Zamba: one scan and one state per Mamba head after one convolution, keyed by the head), its
    convolutions read that piece's inputs. Against per-branch training at the float32 floor and the same trees packed
    (the same tree ops) at ~1e-7 (``A_log``'s gradient passes through the model's float32 exponential)."""
    model = mamba1_model(family, long_memory=True, **overrides)
    groups = deep_forest_rows()
    loss, grads, packed, packed_grads = depth_first_and_packed(model, groups)
    model.zero_grad(set_to_none=True)
    reference = per_branch_forest_loss(model, groups)
    reference.backward()
    assert relative_error(loss, reference) <= 1e-8
    assert float32_floor_grad_error(grads, grads_of(model)) <= FLOAT32_FLOOR
    assert relative_error(loss, packed) <= 1e-12
    assert max_grad_relative_error(grads, packed_grads) <= 1e-5


def test_pure_mamba2_depth_first_matches_packed():
    """``Mamba2ForCausalLM`` drops ``kv_prefix`` before its backbone as it drops ``kv_end`` (the same keyword table):
    without it handed on, each unit's scan restarted from zero and the depth-first probe refused the model (6e-1)."""
    model = hybrid_model("mamba2")
    loss, grads, packed, packed_grads = depth_first_and_packed(model, deep_forest_rows())
    assert relative_error(loss, packed) <= 1e-12
    assert max_grad_relative_error(grads, packed_grads) <= 1e-5


def test_zamba_shared_attention_is_refused_depth_first():
    """Zamba's hybrid layers share one attention block, which has no layer index of its own (the layer passes it in):
    its cached keys/values could not be told apart, so depth-first execution refuses it by name."""
    model = mamba1_model("zamba")
    with pytest.raises(ValueError, match="ZambaAttention has no integer layer_idx"):
        depth_first_and_packed(model, deep_forest_rows())


@pytest.mark.slow  # the probe path is tested fast in test_depth_first.py; Mamba-1 depth-first exactness stays fast
def test_dropping_the_carried_state_is_detected(monkeypatch):
    """The comparison can fail: with the state entering a unit treated as a constant the loss is right and the
    gradient is off; with every unit started from a zero state the first-use probe of depth-first refuses."""
    model = mamba1_model("mamba", long_memory=True)
    groups = deep_forest_rows()
    loss, grads, packed, packed_grads = depth_first_and_packed(model, groups)
    assert max_grad_relative_error(grads, packed_grads) <= 1e-5
    assert depth_first_module.probe_depth_first(model, model, detect_logit_head(model)) <= 1e-12
    join = PrefixCache.join

    def carried(transform):
        def joined(key, entries):
            entry = join(key, entries)
            return transform(entry) if key[0] == "state" else entry

        return staticmethod(joined)

    monkeypatch.setattr(PrefixCache, "join", carried(torch.Tensor.detach))
    loss, grads, packed, packed_grads = depth_first_and_packed(model, groups)
    assert relative_error(loss, packed) <= 1e-12  # the forward is right...
    assert max_grad_relative_error(grads, packed_grads) > 1e-3  # ...the gradient is not
    monkeypatch.setattr(PrefixCache, "join", carried(torch.zeros_like))
    loss, grads, packed, packed_grads = depth_first_and_packed(model, groups)
    assert relative_error(loss, packed) > 1e-6
    with pytest.raises(ValueError, match=r"depth_first' is not exact for MambaForCausalLM"):
        depth_first_module.probe_depth_first(model, model, detect_logit_head(model))


# --------------------------------------------------------------------------------------------------- trainer
def test_tree_trainer_matches_trainer_on_branches(tmp_path):
    """Three SGD steps: TreeTrainer on trees (split over rows of 24 tokens) and transformers.Trainer on the unrolled
    branches (right padding, the model's own path) move every parameter of a tiny Mamba alike."""
    groups = branch_groups(num_trees=6)
    tree_model = mamba1_model("mamba", long_memory=True)
    reference = copy.deepcopy(tree_model)
    before = {n: p.detach().clone() for n, p in tree_model.named_parameters()}
    tree_args = TreeTrainingArguments(**common_args(tmp_path, "tree", 2, 1), max_packed_tokens=24)
    tree = TreeTrainer(model=tree_model, args=tree_args, train_dataset=tree_dataset(groups))
    tree.train()
    ref = Trainer(
        model=reference,
        args=TrainingArguments(**common_args(tmp_path, "ref", 2, 1), remove_unused_columns=False),
        train_dataset=branch_dataset(groups),
        data_collator=collate_branches,
        compute_loss_func=branch_loss_func("token", BRANCHES_PER_TREE * 2),
    )
    ref.train()
    for name, parameter in reference.named_parameters():
        update = parameter.detach() - before[name]
        assert update.norm() > 0, name
        assert relative_error(tree_model.get_parameter(name).detach() - before[name], update) <= FLOAT32_FLOOR, name
    ref_losses = [h["loss"] for h in ref.state.log_history if "loss" in h]
    tree_losses = [h["loss"] for h in tree.state.log_history if "loss" in h]
    assert len(tree_losses) == 3 and tree_losses == pytest.approx(ref_losses, rel=FLOAT32_FLOOR)


# ---------------------------------------------------------------------------------------- context parallel
# name: (rows, strategy, max_packed_tokens, query_block_size, chunks_per_rank): shards cut inside segments, at forks
# and at sibling starts of deep trees (tests/workloads.py), as tests/test_context_parallel_models.py cuts Bamba's.
CP_CASES = {
    "deep_forest_zigzag": (deep_forest_rows, "zigzag", 72, 1024, 8),
    "grpo_balanced": (grpo_row, "balanced", 128, 8, 4),
}
# The model takes exp(A_log.float()), D.float() and dt_proj.bias.float() inside: their gradients are float32 sums
# over the tokens, added in another order when each rank sums its shard's.
FLOAT32_CAST_PARAMETERS = ("A_log", ".D", "dt_proj.bias")


def cp_worker(out_dir: str) -> None:
    """Each ``CP_CASES`` case on this rank: its shard of a tiny float64 Mamba through the tree context parallel
    forward and backward (``sharded_step``), against the whole batch in this process."""
    from accelerate import Accelerator

    from hf_tree.distributed import enable_fsdp2_on_cpu
    from hf_tree.parallel import TreeContextParallel, plan_context_parallel

    enable_fsdp2_on_cpu()
    accelerator = Accelerator()
    cp = TreeContextParallel.from_accelerator(accelerator)
    results = {"cp_size": cp.size}
    for name, (rows_fn, strategy, max_packed_tokens, block, chunks) in CP_CASES.items():
        batch = make_batch(rows_fn, max_packed_tokens)
        model = mamba1_model("mamba", long_memory=True)
        ref_logits, ref_loss, ref_grads = single_process(model, batch)
        plan = plan_context_parallel(batch["kv_end"], cp.size, strategy, chunks)
        _, logits_err, total, grads = sharded_step(model, batch, plan, cp, block, ref_logits)
        results[name] = {
            "logits": logits_err,
            "loss": relative_error(total, ref_loss),
            "grad_errors": {n: max_grad_relative_error({n: grads[n]}, {n: ref_grads[n]}) for n in ref_grads},
            "num_grads": len(grads),
        }
    Path(out_dir, f"rank{accelerator.process_index}.json").write_text(json.dumps(results))
    finish_launched_worker()


@pytest.mark.slow
@pytest.mark.distributed
def test_two_rank_context_parallel_equals_one_process(tmp_path):
    """``accelerate launch`` of this file on 2 gloo ranks (accelerate's FSDP2 + CP config): every rank's logits, the
    summed loss and every gradient equal the whole batch in one process, 1e-9 in float64 (the float32-cast
    parameters: 1e-6)."""
    config = tmp_path / "accelerate_cp.json"
    config.write_text(json.dumps(ACCELERATE_CONFIG))
    env = dict(os.environ, ACCELERATE_USE_CPU="true", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    command += ["--main_process_port", str(free_port()), __file__, str(tmp_path)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, result in enumerate(results):
        assert result["cp_size"] == 2
        for name in CP_CASES:
            case = result[name]
            assert case["num_grads"] == len(case["grad_errors"]) > 0, (rank, name)
            assert case["logits"] <= FLOAT64_TOLERANCE and case["loss"] <= FLOAT64_TOLERANCE, (rank, name, case)
            for parameter, error in case["grad_errors"].items():
                float32_cast = any(parameter.endswith(suffix) for suffix in FLOAT32_CAST_PARAMETERS)
                assert error <= (1e-6 if float32_cast else FLOAT64_TOLERANCE), (rank, name, parameter, error)


if __name__ == "__main__":
    cp_worker(sys.argv[1])
