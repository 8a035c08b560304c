"""QLoRA: bitsandbytes 4-bit NF4 (compute float32) and 8-bit bases with LoRA train exactly on trees.

Oracles. Loss and gradients: the quantized model computes ``dequantized weight @ x`` in float32 (training kernels of
bitsandbytes' CPU backend), so the same function in float64 (each quantized weight dequantized into a float64
``nn.Linear``) is its exact value; the tree (packed and depth-first) may differ from it by at most twice what the
quantized model's own per-branch run differs by (the project's low-precision rule): both are float32 rounding,
whose pattern depends on the row length. Trainers: TRL's SFTTrainer and GRPOTrainer on the same quantized base,
within twice what TRL's own step moves when only its padding changes. Self-check: no false alarm, no change to the
training computation, leaks still refused."""

from __future__ import annotations

import copy

import datasets
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, TrainerCallback
from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

from hf_tree import Tree, TreeDataCollator, tree_causal_lm_loss
from hf_tree.depth_first import DepthFirstConfig, depth_first_backward
from hf_tree.models.check import check_model_for_trees, probe_tree_exactness
from hf_tree.models.check_guard import four_bit_layers, repacked_layers
from hf_tree.models.introspection import causal_lm_of
from hf_tree.trl.dpo import TreeDPOConfig, TreeDPOTrainer
from hf_tree.trl.grpo import TreeGRPOConfig, TreeGRPOTrainer
from hf_tree.trl.sft import TreeSFTConfig, TreeSFTTrainer
from tests.helpers import (
    grads_of,
    max_grad_relative_error,
    one_step_trainer,
    per_branch_loss,
    relative_error,
    saved_tiny_model,
    tiny_trl_config,
    train_and_measure_updates,
    word_tokenizer,
)
from tests.workloads import grpo_row

bnb = pytest.importorskip("bitsandbytes")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# bitsandbytes' CPU kernels need in/out features that are multiples of its 64-value blocks (4-bit) and of 32.
QUANTIZABLE = dict(hidden_size=64, intermediate_size=128)
QUANTIZATIONS = {
    "nf4": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32),
    "int8": BitsAndBytesConfig(load_in_8bit=True),
}
LORA = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return saved_tiny_model(tmp_path_factory.mktemp("quantized"), torch.float32, **QUANTIZABLE)


# LoRA adapters: none, float32, or bfloat16 as TRL's QLoRA recipe stores them (PEFT rounds their inputs to it)
ADAPTERS = {"base": None, "lora": torch.float32, "bf16_lora": torch.bfloat16}


def quantized(checkpoint: str, quantization: str, adapters: str = "lora") -> torch.nn.Module:
    """The tiny float32 checkpoint loaded with ``QUANTIZATIONS[quantization]`` on tree_flash, with
    ``ADAPTERS[adapters]`` LoRA adapters (non-zero: ``init_lora_weights=False``)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, quantization_config=QUANTIZATIONS[quantization], attn_implementation="tree_flash"
    )
    if ADAPTERS[adapters] is None:
        return model
    model = get_peft_model(model, copy.deepcopy(LORA))
    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter.data = parameter.data.to(ADAPTERS[adapters])
    return model


def dequantized_float64(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of ``model`` (after its first forward) in which each bitsandbytes linear is a plain
    ``nn.Linear`` holding its dequantized weight: the function the quantized model's training kernels compute,
    without their rounding."""
    exact = copy.deepcopy(model)
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            weight = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
        elif isinstance(module, bnb.nn.Linear8bitLt):
            # statistics as the first forward moved them (into the layer's matmul state), which the copy lost
            weight = bnb.functional.int8_vectorwise_dequant(module.state.CB, module.state.SCB)
        else:
            continue
        linear = torch.nn.Linear(module.in_features, module.out_features, bias=False, dtype=torch.float64)
        linear.weight = torch.nn.Parameter(weight.double(), requires_grad=False)
        parent, _, child = name.rpartition(".")
        setattr(exact.get_submodule(parent), child, linear)
    return exact.double()


def tree_and_branch_grads(
    model: torch.nn.Module, sequences, masks, depth_first: bool
) -> tuple[float, dict, float, dict]:
    """(tree loss, tree LoRA grads, per-branch loss, per-branch LoRA grads) of one tree on ``model``, the tree
    packed or depth-first in units of at most 8 tokens."""
    tree = Tree.from_sequences(sequences, masks)
    model.zero_grad()
    if depth_first:
        tree_loss = depth_first_backward(model, [tree], DepthFirstConfig(8))
    else:
        tree_loss = tree_causal_lm_loss(model, TreeDataCollator(max_packed_tokens=128)([tree.to_dict()]))
        tree_loss.backward()
    tree_grads = grads_of(model)
    model.zero_grad()
    total, divisor = per_branch_loss(model, sequences, masks)
    branch_loss = total / divisor
    branch_loss.backward()
    return float(tree_loss), tree_grads, float(branch_loss), grads_of(model)


@pytest.mark.parametrize(
    "depth_first", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["packed", "depth_first"]
)
@pytest.mark.parametrize("quantization", list(QUANTIZATIONS))
def test_tree_loss_and_grads_equal_per_branch(checkpoint, quantization, depth_first):
    model = quantized(checkpoint, quantization)
    model.train()
    sequences, masks = grpo_row()[0]
    tree_loss, tree_grads, branch_loss, branch_grads = tree_and_branch_grads(model, sequences, masks, depth_first)
    exact = dequantized_float64(model)
    exact_loss, _, _, exact_grads = tree_and_branch_grads(exact, sequences, masks, depth_first=False)
    assert tree_grads.keys() == exact_grads.keys() and all("lora_" in name for name in tree_grads)
    loss_error, loss_floor = (abs(loss - exact_loss) / abs(exact_loss) for loss in (tree_loss, branch_loss))
    grad_error, grad_floor = (max_grad_relative_error(grads, exact_grads) for grads in (tree_grads, branch_grads))
    print(f"\n{quantization} depth_first={depth_first}: loss tree {loss_error:.2e} per-branch {loss_floor:.2e}", end="")
    print(f"; grads tree {grad_error:.2e} per-branch {grad_floor:.2e}")
    assert 0 < grad_floor < 1e-5  # float32 rounding: the float64 oracle is the quantized model's own function
    # The tree's cross-entropy runs in float32 (the model's dtype), the per-branch reference's in float64: a few
    # float32 roundings of the loss; a missing or doubled token moves it by > 1e-3.
    assert loss_error <= max(2 * loss_floor, 1e-6)
    assert grad_error <= 2 * grad_floor


def training_logits(model: torch.nn.Module) -> torch.Tensor:
    model.train()
    with torch.no_grad():
        return model(input_ids=torch.tensor([[5, 17, 42, 8, 63, 21, 9, 77]])).logits


@pytest.mark.parametrize("adapters", [a if a == "lora" else pytest.param(a, marks=pytest.mark.slow) for a in ADAPTERS])
@pytest.mark.parametrize("quantization", list(QUANTIZATIONS))
def test_self_check_accepts_quantized_models_and_leaves_training_unchanged(checkpoint, quantization, adapters):
    """No false alarm (the probe compares the kernels training runs; bfloat16 adapters round at their own unit
    roundoff), and the check's eval-mode forwards do not switch the layers to bitsandbytes' inference kernels
    (bfloat16 4-bit without a backward on AVX512-BF16 CPUs; LLM.int8 with batch-wide outlier columns)."""
    model = quantized(checkpoint, quantization, adapters)
    before = training_logits(model)
    check_model_for_trees(model)
    difference = probe_tree_exactness(model)  # passes: within its bounds
    if adapters != "bf16_lora":
        assert difference < 1e-5  # float32 rounding (per-token relative, final hidden state)
    assert torch.equal(training_logits(model), before)


@pytest.mark.parametrize("adapters", ["base", pytest.param("bf16_lora", marks=pytest.mark.slow)])
@pytest.mark.parametrize("quantization", list(QUANTIZATIONS))
def test_leak_in_a_quantized_model_is_refused(checkpoint, quantization, adapters):
    """Bfloat16 adapters widen the difference check's bound to their rounding; the invariance check (a sibling's
    tokens change no other branch's bits) keeps the float32 one and refuses the leak."""
    model = quantized(checkpoint, quantization, adapters)
    mlp = causal_lm_of(model).model.layers[1].mlp
    plain = mlp.forward
    mlp.forward = lambda x: plain(x) + 1e-3 * x.cumsum(dim=1)  # siblings see each other (0.1% of the output)
    with pytest.raises(ValueError, match=r"not tree-exact.*layer 1 \(LlamaDecoderLayer\)"):
        probe_tree_exactness(model)


# ------------------------------------------------------------------------------------------- vs TRL's trainers
# TRL's QLoRA recipe stores the adapters (and so their gradients) in bfloat16 for quantized bases; each trainer
# does the same. The comparisons turn them back to float32 in both, so that the update holds the float32 gradient,
# where a mix stays visible. The bound is TRL's own rounding: the same TRL step with its rows padded to another
# length, twice that, at least 1e-6 (measured here: SFT tree vs TRL 5.0e-6 nf4 / 5.8e-6 int8 where TRL padded
# moves by 5.0e-6 / 6.2e-6; GRPO 5.3e-7 / 5.2e-7 against 3.1e-7 / 4.0e-7); a dropped or doubled token moves the
# update by > 1e-3.
MIN_TRL_BOUND = 1e-6


def float32_adapters(trainer) -> None:
    for parameter in trainer.model.parameters():
        if parameter.requires_grad:
            parameter.data = parameter.data.float()


def largest_update_difference(updates: dict, reference: dict) -> float:
    assert updates.keys() == reference.keys() and any(u.norm() > 0 for u in reference.values())
    return max(relative_error(updates[name], update) for name, update in reference.items())


def assert_within_trls_rounding(name: str, tree: dict, trl: dict, trl_padded: dict) -> None:
    error, floor = largest_update_difference(tree, trl), largest_update_difference(trl_padded, trl)
    print(f"\n{name}: update vs TRL {error:.2e}, TRL padded vs TRL {floor:.2e}")
    assert error <= max(2 * floor, MIN_TRL_BOUND)


def grpo_step(cls, config_cls, checkpoint: str, quantization: str, **settings) -> tuple:
    init = {"dtype": torch.float32, "quantization_config": QUANTIZATIONS[quantization]}
    trainer = one_step_trainer(cls, config_cls, checkpoint, peft=True, model_init_kwargs=init, **settings)
    float32_adapters(trainer)
    return trainer, train_and_measure_updates(trainer)


@pytest.mark.parametrize("quantization", ["nf4", pytest.param("int8", marks=pytest.mark.slow)])
def test_grpo_step_equals_trls(checkpoint, quantization, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    _, trl = grpo_step(GRPOTrainer, GRPOConfig, checkpoint, quantization)
    _, trl_padded = grpo_step(GRPOTrainer, GRPOConfig, checkpoint, quantization, pad_to_multiple_of=32)
    tree, updates = grpo_step(TreeGRPOTrainer, TreeGRPOConfig, checkpoint, quantization)
    assert tree.tree_head.layout_stats.dedup_ratio > 1
    # evaluation's generation (eval mode, no gradients) must not repack 4-bit layers: kept off it from __init__ on
    assert not any(layer.support_avx512bf16_for_cpu for _, layer in four_bit_layers(tree.model))
    assert_within_trls_rounding(f"grpo {quantization}", updates, trl, trl_padded)


def sft_step(
    cls,
    config_cls,
    checkpoint: str,
    quantization: str,
    float32: bool = True,
    evaluate: bool = False,
    callbacks: list | None = None,
    **settings,
):
    """One SFT step over 7 prompt/completion rows (3 prompts) from the quantized checkpoint with LoRA (non-zero
    adapters), in float32 (``float32_adapters``) or as TRL's recipe has them (bfloat16); ``evaluate``: the same rows
    are the evaluation set too; ``settings`` override the config's."""
    rows = [
        {"prompt": prompt, "completion": completion}
        for prompt, completions in [
            ("w10 w11 w12 w13", [" w20 w21 w22", " w20 w21 w23 w24", " w25"]),
            ("w14 w15", [" w30 w31", " w30 w32 w33 w34 w35"]),
            ("w16 w17 w18", [" w40", " w40 w41"]),
        ]
        for completion in completions
    ]
    init = {"dtype": torch.float32, "quantization_config": QUANTIZATIONS[quantization]}
    defaults = dict(
        model_init_kwargs=init,
        max_steps=1,
        learning_rate=1.0,
        per_device_train_batch_size=len(rows),
        gradient_checkpointing=False,
        train_sampling_strategy="sequential",
    )
    args = tiny_trl_config(config_cls, checkpoint, torch.float32, **{**defaults, **settings})
    trainer = cls(
        checkpoint,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        eval_dataset=datasets.Dataset.from_list(rows) if evaluate else None,
        processing_class=word_tokenizer(),
        peft_config=copy.deepcopy(LORA),
        callbacks=callbacks,
    )
    if float32:
        float32_adapters(trainer)
    return trainer, train_and_measure_updates(trainer)


@pytest.mark.parametrize("quantization", ["nf4", pytest.param("int8", marks=pytest.mark.slow)])
def test_sft_step_equals_trls(checkpoint, quantization):
    _, trl = sft_step(SFTTrainer, SFTConfig, checkpoint, quantization)
    _, trl_padded = sft_step(SFTTrainer, SFTConfig, checkpoint, quantization, pad_to_multiple_of=32)
    tree, updates = sft_step(TreeSFTTrainer, TreeSFTConfig, checkpoint, quantization)
    assert tree.state.log_history[0]["dedup_ratio"] > 1
    assert_within_trls_rounding(f"sft {quantization}", updates, trl, trl_padded)


def test_weights_repacked_for_inference_are_refused(checkpoint):
    """An eval-mode generate() before training repacks 4-bit weights for bitsandbytes' CPU inference kernel, which
    has no backward (LoRA gradients all zero, in TRL too): refused by name, not as a branch mix."""
    model = quantized(checkpoint, "nf4")
    model.eval()
    model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
    if not bnb.functional.has_avx512bf16():
        pytest.skip("bitsandbytes repacks only on CPUs with AVX512-BF16")
    with pytest.raises(ValueError, match="repacked the 4-bit weights of 14 layers"):
        check_model_for_trees(model)


@pytest.mark.parametrize("quantization", ["nf4", pytest.param("int8", marks=pytest.mark.slow)])
def test_sft_step_with_trls_bfloat16_adapters(checkpoint, quantization):
    """TRL's recipe as is: the bfloat16 adapters (non-zero) pass the self-check (the probe bounds their rounding by
    their own unit roundoff; it refused 2 of 8 seeds before), and against TRL's float32-adapter step the tree's
    step is off by no more than twice TRL's own bfloat16 step (the update is the difference of two bfloat16
    parameters: up to 62% per matrix here, for both)."""
    _, reference = sft_step(SFTTrainer, SFTConfig, checkpoint, quantization)
    _, trl = sft_step(SFTTrainer, SFTConfig, checkpoint, quantization, float32=False)
    _, tree = sft_step(TreeSFTTrainer, TreeSFTConfig, checkpoint, quantization, float32=False)
    error, trl_error = largest_update_difference(tree, reference), largest_update_difference(trl, reference)
    print(f"\nsft {quantization} bfloat16 adapters vs float32: tree {error:.2e}, TRL {trl_error:.2e}")
    assert error <= 2 * trl_error


# ------------------------------------------------------------------- repacks after the first-use check
# bitsandbytes repacks a 4-bit layer for its inference kernel (no backward) on the layer's first eval-mode forward
# without gradients, on CPUs with AVX512-BF16. The trainers' own no-grad passes after the check (DPO's reference
# precompute, evaluation) used to do it: the following training steps then moved the LoRA adapters 0.23-0.84
# (relative) away from the same steps without those passes, with no error. ``repacking_cpu`` makes bitsandbytes
# take that path where the CPU lacks AVX512-BF16 (its inference kernel then computes garbage: any difference shows).


@pytest.fixture
def repacking_cpu(monkeypatch):
    """4-bit layers built in the test take bitsandbytes' CPU-inference repack path, whatever the CPU."""
    if not bnb.functional.has_avx512bf16():
        monkeypatch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: True)  # what Linear4bit.__init__ reads


def repacked(trainer) -> list[str]:
    return repacked_layers(four_bit_layers(trainer.model))


# preference pairs, two of them sharing a prompt
PAIRS = {
    "prompt": ["w10 w11 w12 w13", "w14 w15", "w10 w11 w12 w13", "w16 w17 w18"],
    "chosen": [" w20 w21", " w22", " w23 w24 w25", " w26 w27"],
    "rejected": [" w20 w28 w29 w30", " w31 w32", " w33", " w26"],
}


def dpo_step(checkpoint: str, precompute: bool) -> tuple:
    """One step of ``TreeDPOTrainer`` on the nf4 checkpoint with LoRA (float32 adapters), the reference (adapters
    disabled) precomputed in ``__init__`` or computed in the step."""
    init = {"dtype": torch.float32, "quantization_config": QUANTIZATIONS["nf4"]}
    args = tiny_trl_config(
        TreeDPOConfig,
        checkpoint,
        torch.float32,
        model_init_kwargs=init,
        max_steps=1,
        learning_rate=1.0,
        precompute_ref_log_probs=precompute,
    )
    trainer = TreeDPOTrainer(
        checkpoint,
        args=args,
        train_dataset=datasets.Dataset.from_dict(PAIRS),
        processing_class=word_tokenizer(),
        peft_config=copy.deepcopy(LORA),
    )
    float32_adapters(trainer)
    return trainer, train_and_measure_updates(trainer)


def test_dpo_reference_precompute_keeps_the_training_kernels(checkpoint, repacking_cpu):
    """``precompute_ref_log_probs=True`` runs the reference (the LoRA model with its adapters disabled) in eval mode
    without gradients inside ``__init__``, after the first-use check: no layer is repacked, and the step equals the
    one whose reference pass runs in the step (float32 rounding: the reference log-probs come from other batches)."""
    precomputed, updates = dpo_step(checkpoint, precompute=True)
    assert not repacked(precomputed)
    _, reference = dpo_step(checkpoint, precompute=False)
    difference = largest_update_difference(updates, reference)
    print(f"\ndpo nf4 precomputed reference vs in-step reference: {difference:.2e}")
    assert difference <= MIN_TRL_BOUND


def test_evaluation_between_steps_keeps_the_training_kernels(checkpoint, repacking_cpu):
    """``eval_strategy="steps"`` evaluates (eval mode, no gradients: ``prediction_step``) between the two steps:
    no layer is repacked, and the two steps move the adapters exactly as without the evaluation."""
    two_steps = dict(max_steps=2, gradient_accumulation_steps=1, per_device_train_batch_size=4)
    evaluated, updates = sft_step(
        TreeSFTTrainer,
        TreeSFTConfig,
        checkpoint,
        "nf4",
        evaluate=True,
        eval_strategy="steps",
        eval_steps=1,
        **two_steps,
    )
    assert any("eval_loss" in log for log in evaluated.state.log_history) and not repacked(evaluated)
    _, reference = sft_step(TreeSFTTrainer, TreeSFTConfig, checkpoint, "nf4", **two_steps)
    assert largest_update_difference(updates, reference) <= MIN_TRL_BOUND


class RepackAfterStep(TrainerCallback):
    """After the first step, a forward hf_tree does not see repacks every 4-bit layer (bitsandbytes' own inference
    path, forced on: a path that bypasses hf_tree's keeping them off it, e.g. a model reloaded into the trainer)."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 1:
            for _, layer in four_bit_layers(model):
                layer.support_avx512bf16_for_cpu = True
            model.eval()
            with torch.no_grad():
                model(input_ids=torch.tensor([[5, 6, 7]]))
            model.train()


def test_a_repack_after_the_check_is_refused_at_the_next_step(checkpoint, repacking_cpu):
    """Whatever repacks the layers between steps, the next tree pass refuses by name instead of training without
    gradients through them."""
    with pytest.raises(ValueError, match=r"repacked the 4-bit weights of 14 layers .* no gradient would flow"):
        sft_step(
            TreeSFTTrainer,
            TreeSFTConfig,
            checkpoint,
            "nf4",
            callbacks=[RepackAfterStep()],
            max_steps=2,
            per_device_train_batch_size=4,
        )
