"""Each prompt prefilled once per group in generation (``hf_tree.trl.group_generation``) gives TRL's samples.

Oracle: the model's own ``generate`` on the left-padded batch of repeated prompts (what TRL's ``_generate_single_turn``
calls) and TRL's own ``GRPOTrainer``/``RLOOTrainer`` generation, with the same seed: greedy and sampled completions
must be token-identical in float64 (the sampling draws are consumed by a batch of the same size). The prefill's work
is counted with a forward hook on the real model's input embeddings.
"""

from __future__ import annotations

import logging

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import GenerationConfig
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from hf_tree.trl.group_generation import (
    PREFILL_SAVED_METRIC,
    GroupPrefillStats,
    generate_prefilling_once,
    generation_fallback_cause,
)
from hf_tree.trl.grpo import TreeGRPOConfig, TreeGRPOTrainer
from hf_tree.trl.rloo import TreeRLOOConfig, TreeRLOOTrainer
from tests.helpers import hybrid_model, saved_tiny_model, tiny_model, trainer_args, word_tokenizer, zero_reward

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17, 18]]  # unequal lengths: left padding differs
GROUP = 4


def repeated_batch(prompts=PROMPTS, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``[len(prompts) * group, W]`` left-padded ids and mask, each prompt's copies adjacent (``RepeatSampler``)."""
    width = max(map(len, prompts))
    rows = [p for p in prompts for _ in range(group)]
    ids = torch.tensor([[0] * (width - len(p)) + p for p in rows])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    return ids, mask


def sampling(do_sample: bool, new_tokens: int = 10) -> GenerationConfig:
    return GenerationConfig(
        max_new_tokens=new_tokens, do_sample=do_sample, temperature=1.0, top_p=1.0, pad_token_id=0, eos_token_id=1
    )


MODELS = {
    "llama": lambda: tiny_model("llama"),
    "qwen2": lambda: tiny_model("qwen2"),
    "qwen3_5_text": lambda: hybrid_model("qwen3_5_text"),  # GatedDeltaNet: conv and recurrent states
    "lfm2": lambda: hybrid_model("lfm2"),  # short convolutions
    "bamba": lambda: hybrid_model("bamba"),  # Mamba2 mixers
}


# Every family greedy and Llama sampled in the fast tier; the hybrids' (and Qwen2's, Bamba's) sampled runs repeat the
# same cache expansion with another draw (slow).
@pytest.mark.parametrize(
    ("family", "do_sample"),
    [
        pytest.param(family, sample, marks=[pytest.mark.slow] if sample and family != "llama" else [])
        for family in MODELS
        for sample in (False, True)
    ],
    ids=[f"{family}-{'sampled' if sample else 'greedy'}" for family in MODELS for sample in (False, True)],
)
def test_same_completions_as_generate(family, do_sample):
    """float64: token-identical to ``generate`` on the repeated batch, with shuffled rows (groups not adjacent)."""
    model = MODELS[family]().eval()
    ids, mask = repeated_batch()
    order = torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(0))
    ids, mask = ids[order], mask[order]
    config = sampling(do_sample)
    assert generation_fallback_cause(model, config) is None
    torch.manual_seed(1)
    expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    stats = GroupPrefillStats()
    torch.manual_seed(1)
    got = generate_prefilling_once(model, model.generate, ids, mask, stats, generation_config=config)
    assert torch.equal(got, expected)
    assert (expected[:, ids.shape[1] :] != 0).any(), "nothing was generated"
    assert stats.distinct_prompts == len(PROMPTS) and stats.rows == ids.shape[0]


def test_float32_greedy_and_sampled_match():
    """float32 Llama: identical too here (a prompt forwarded in a batch of another size may round differently; the
    benchmark reports the agreement on SmolLM2)."""
    model = tiny_model("llama", dtype=torch.float32).eval()
    ids, mask = repeated_batch()
    for seed in range(3):
        for do_sample in (False, True):
            torch.manual_seed(seed)
            expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=sampling(do_sample))
            torch.manual_seed(seed)
            got = generate_prefilling_once(model, model.generate, ids, mask, generation_config=sampling(do_sample))
            assert torch.equal(got, expected)


def test_fallback_causes():
    model = tiny_model("llama").eval()
    assert "beam" in generation_fallback_cause(model, GenerationConfig(num_beams=2, max_new_tokens=2))
    assert "static" in generation_fallback_cause(model, GenerationConfig(cache_implementation="static"))
    assert "dropout" in generation_fallback_cause(tiny_model("llama", attention_dropout=0.1).train(), None)


class EmbeddingTokens:
    """Counts the token positions the model embeds per forward (a forward hook on the input embeddings)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.shapes: list[tuple[int, int]] = []
        self.handle = model.get_input_embeddings().register_forward_hook(
            lambda _m, args, _o: self.shapes.append(tuple(args[0].shape))
        )

    def total(self) -> int:
        return sum(b * n for b, n in self.shapes)


TRAINERS = {
    "grpo": (GRPOTrainer, GRPOConfig, TreeGRPOTrainer, TreeGRPOConfig),
    "rloo": (RLOOTrainer, RLOOConfig, TreeRLOOTrainer, TreeRLOOConfig),
    "grpo_lora": (GRPOTrainer, GRPOConfig, TreeGRPOTrainer, TreeGRPOConfig),  # generate() of a PeftModel
}


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", list(TRAINERS))
def test_trainer_generation_equals_trl(kind, do_sample, tmp_path, caplog):
    """TRL's trainer and the tree trainer generate the same completions from the same seed, float64, and the tree
    trainer's prefill embeds ``(rows - distinct) * (W - 1)`` fewer prompt positions (hook on the real model)."""
    trl_cls, trl_config, tree_cls, tree_config = TRAINERS[kind]
    path = saved_tiny_model(tmp_path / "model", torch.float64)
    prompts = ["w10 w11 w12 w13 w14", "w15 w16 w17"]
    batch = [p for p in prompts for _ in range(GROUP)]
    settings = dict(num_generations=GROUP, max_completion_length=6, per_device_train_batch_size=8)
    if not do_sample:
        settings["generation_kwargs"] = {"do_sample": False}
    setup = dict(train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=word_tokenizer())
    if kind == "grpo_lora":
        setup["peft_config"] = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    completions, embedded = {}, {}
    for name, cls, config in (("trl", trl_cls, trl_config), ("tree", tree_cls, tree_config)):
        trainer = cls(path, zero_reward, trainer_args(config, path, torch.float64, **settings), **setup)
        trainer.model.train()  # TRL generates between training steps
        hook = EmbeddingTokens(trainer.model)
        torch.manual_seed(7)
        with torch.no_grad():
            completions[name] = trainer._generate(batch)[1]
        hook.handle.remove()
        embedded[name] = hook.total()
    assert completions["tree"] == completions["trl"]
    assert any(completions["trl"])
    stats = trainer.group_prefill_stats
    width = 5  # the longer prompt
    assert stats.calls == 1 and stats.distinct_prompts == 2
    assert embedded["trl"] - embedded["tree"] == (len(batch) - 2) * (width - 1)
    assert stats.trl_prefill_tokens - stats.prefill_tokens == (len(batch) - 2) * (width - 1)
    assert trainer._metrics["train"][PREFILL_SAVED_METRIC] == [(len(batch) - 2) * (width - 1)]  # logged by TRL's log

    off = tree_cls(path, zero_reward, trainer_args(tree_config, path, torch.float64, **settings), **setup)
    off.args.tree_prefill_once_per_group = False
    torch.manual_seed(7)
    with torch.no_grad():
        assert off._generate(batch)[1] == completions["trl"]
    assert off.group_prefill_stats.calls == 0


def test_fallback_is_logged_once(tmp_path, caplog):
    """A generation config it cannot share (a static cache) runs TRL's own call and says so once."""
    path = saved_tiny_model(tmp_path / "model", torch.float64)
    args = trainer_args(TreeGRPOConfig, path, torch.float64, num_generations=2, cache_implementation="static")
    setup = dict(train_dataset=Dataset.from_dict({"prompt": ["w3 w4"]}), processing_class=word_tokenizer())
    trainer = TreeGRPOTrainer(path, zero_reward, args, **setup)
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="hf_tree"):
        for _ in range(2):
            trainer._generate(["w3 w4", "w3 w4"])
    lines = [r.message for r in caplog.records if "prefills each copy" in r.message]
    assert len(lines) == 1 and "cache_implementation='static'" in lines[0]
    assert trainer.group_prefill_stats.calls == 0
