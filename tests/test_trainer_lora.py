"""LoRA through TreeTrainer (float64 tiny model): only the adapter trains, merging keeps outputs, it reloads."""

from __future__ import annotations

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from hf_tree.trainer import TreeTrainer, TreeTrainingArguments
from tests.helpers import VOCAB, common_args, relative_error, tiny_model
from tests.workloads import branch_groups, tree_dataset

PROBE = torch.tensor([[5, 17, 42, 8, 63, 21, 9, 77]])  # a plain (non-tree) batch: tree_flash runs SDPA


def lora_model() -> PeftModel:
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    return get_peft_model(tiny_model(vocab_size=VOCAB), config)


def trained_lora(tmp_path) -> tuple[PeftModel, dict[str, torch.Tensor]]:
    model = lora_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = TreeTrainingArguments(**common_args(tmp_path, "lora", 4, 1, learning_rate=0.5), max_packed_tokens=64)
    TreeTrainer(model=model, args=args, train_dataset=tree_dataset(branch_groups())).train()
    return model, before


def test_only_adapter_weights_change(tmp_path):
    model, before = trained_lora(tmp_path)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    adapters = {n for n, _ in model.named_parameters() if "lora_" in n}
    # every adapter matrix moved (lora_B starts at zero, lora_A moves from step 2 on), nothing else did
    assert changed == adapters and len(adapters) == 2 * 7 * 2


def test_merge_and_unload_keeps_outputs(tmp_path):
    model, _ = trained_lora(tmp_path)
    model.eval()
    with torch.no_grad():
        adapted = model(input_ids=PROBE).logits
        base = model.get_base_model()
        with model.disable_adapter():
            plain = base(input_ids=PROBE).logits
        merged = model.merge_and_unload()(input_ids=PROBE).logits
    assert relative_error(adapted, plain) > 1e-4  # the adapter changes the outputs ...
    assert relative_error(merged, adapted) <= 1e-10  # ... and merging keeps them


def test_saved_adapter_reloads(tmp_path):
    model, _ = trained_lora(tmp_path)
    model.save_pretrained(tmp_path / "adapter")
    model.eval()
    reloaded = PeftModel.from_pretrained(tiny_model(vocab_size=VOCAB), tmp_path / "adapter").eval()
    with torch.no_grad():
        assert relative_error(reloaded(input_ids=PROBE).logits, model(input_ids=PROBE).logits) <= 1e-12
