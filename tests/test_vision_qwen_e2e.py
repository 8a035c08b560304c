"""Vision paths end to end that tests/test_vision_trl.py leaves out: SFT and DPO on the Qwen VL families and
LLaVA-Next through their real processors, KTO on Qwen2-VL, GRPO on Qwen2-VL, Qwen3.5 and LLaVA-Next, and the launcher
fully fine-tuning a saved VLM. The fast tier runs each trainer on Qwen2-VL (``FAST_FAMILY``); the other families
(and KTO, whose image path tests/test_vision_trl.py covers) run under ``slow``: their packed forward is exact in the
fast tier (tests/test_vision_forward.py), and these repeat the trainer's path on it.

Oracle: TRL's own trainer (SFTTrainer, DPOTrainer, KTOTrainer, GRPOTrainer) on the same saved tiny model, dataset and
processor; one SGD step in float64 with clipping on and biting (``max_grad_norm=1.0``, TRL's default; GRPO: 0.5, its
gradient norms lie near 1), compared by the logged gradient norm and the update of every parameter. The Qwen
processors are the real ones with their video processor left out (it needs torchvision, which has no wheel for this
CPU torch; ``tests/vision_models.qwen_processor``).
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from tests.helpers import (
    FLOAT32_FLOOR,
    TRL_STEP_TOLERANCE,
    TRL_TOLERANCE,
    exact_sgd_args,
    float32_floor_grad_error,
    max_grad_relative_error,
    tiny_trl_config,
    train_and_measure_updates,
)
from tests.vision_models import (
    FLOAT32_INTERNALS,
    float64_vision_rotary,
    llava_next_processor,
    qwen_processor,
    tiny_vlm,
)

Image = pytest.importorskip("PIL.Image")  # hf_tree[vision]
pytestmark = pytest.mark.usefixtures("one_torch_thread")
QWEN_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")
FAST_FAMILY = "qwen2_vl"


def fast_on_one_family(cases: list) -> list:
    """``cases`` (families, or (trainer, family) pairs) with every one but ``FAST_FAMILY``'s (DPO's, for pairs)
    marked slow."""
    fast = (FAST_FAMILY, ("dpo", FAST_FAMILY))
    values = [case if isinstance(case, tuple) else (case,) for case in cases]
    return [pytest.param(*value, marks=() if case in fast else pytest.mark.slow) for case, value in zip(cases, values)]


CLIPPED = dict(max_grad_norm=1.0)  # TRL's default: the exactness below holds with clipping on
RED, BLUE = Image.new("RGB", (8, 8), (200, 30, 30)), Image.new("RGB", (8, 8), (30, 30, 200))
WIDE = Image.new("RGB", (16, 10), (30, 200, 30))  # another grid (Qwen: 4x8 patches; LLaVA-Next: 5 tiles)


def processor(family: str):
    """The family's real processor (tests/vision_models.py)."""
    return llava_next_processor() if family == "llava_next" else qwen_processor(family)


def assert_same_update(family: str, trl, trl_updates: dict, tree, tree_updates: dict, tolerance: float) -> None:
    """Both clipped the same gradient norm (over ``max_grad_norm``: clipping rescaled the step) and moved every
    parameter as TRL moved it (the vision tower too); GatedDeltaNet's float32 decay internals (Qwen3.5) are measured
    against their float32 floor."""
    trl_norm, tree_norm = trl.state.log_history[0]["grad_norm"], tree.state.log_history[0]["grad_norm"]
    assert tree_norm > tree.args.max_grad_norm > 0 and tree_norm == pytest.approx(trl_norm, rel=1e-6)
    assert trl_updates.keys() == tree_updates.keys() and any(u.norm() > 0 for u in trl_updates.values())
    assert any("visual" in n or "vision_tower" in n for n, u in tree_updates.items() if u.norm() > 0)
    if family in FLOAT32_INTERNALS:
        assert float32_floor_grad_error(tree_updates, trl_updates) <= FLOAT32_FLOOR
    else:
        assert max_grad_relative_error(tree_updates, trl_updates) <= tolerance


def run_both(classes, path: str, family: str, dataset: Dataset, make_args) -> list[tuple]:
    """Each ``(trainer, config)`` class pair built on the saved model at ``path`` with ``family``'s processor and
    trained one step."""
    results = []
    for cls, config in classes:
        trainer = cls(path, args=make_args(config), train_dataset=dataset, processing_class=processor(family))
        with float64_vision_rotary():
            results.append((trainer, train_and_measure_updates(trainer)))
    return results


def chat(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


@pytest.mark.parametrize("family", fast_on_one_family([*QWEN_FAMILIES, "llava_next"]))
def test_vision_sft_step_on_qwen_and_llava_next_matches_trl(tmp_path, family):
    """TreeSFTTrainer on ``messages`` + ``images`` rows grouped into one tree (the same question about two images
    forks at the image; a row with two images of two grid sizes, LLaVA-Next: of 3 and 5 tiles) = TRL's SFTTrainer:
    one clipped SGD step."""
    from trl import SFTConfig, SFTTrainer

    from hf_tree.trl.sft import TreeSFTConfig, TreeSFTTrainer

    rows = [([RED], "w5 w6", "w7 w8"), ([RED], "w5 w6", "w9"), ([BLUE], "w5 w6", "w7 w8"), ([RED, WIDE], "w10", "w11")]
    dataset = Dataset.from_dict(
        {"messages": [chat(q, a) for _, q, a in rows], "images": [i for i, _, _ in rows], "group": [0] * len(rows)}
    )
    path = str(tmp_path / family)
    tiny_vlm(family, attn="sdpa").save_pretrained(path)
    settings = dict(max_steps=1, learning_rate=1.0, per_device_train_batch_size=4, use_cpu=True, bf16=False, **CLIPPED)
    settings |= dict(model_init_kwargs={"dtype": torch.float64}, max_length=None, shuffle_dataset=False)

    def make_args(config):
        tree = dict(max_packed_tokens=128, group_by="group") if config is TreeSFTConfig else {}
        return config(**exact_sgd_args(str(tmp_path / config.__name__), **settings), **tree)

    classes = ((SFTTrainer, SFTConfig), (TreeSFTTrainer, TreeSFTConfig))
    (trl, trl_updates), (tree, tree_updates) = run_both(classes, path, family, dataset, make_args)
    # one tree, each image once; LLaVA-Next's red image shown beside the wide one carries its processor's zero tiles
    # (padded to the row's most), so it is stored apart from its unpadded copy (correct, encoded twice)
    assert len(tree.train_dataset) == 1 and len(tree.train_dataset[0]["media"]) == 3 + (family == "llava_next")
    # TRL's loss runs its cross-entropy on float32 logits (tests/test_vision_trl.py: 1e-7 loss, 4.5e-7 updates)
    assert trl.state.log_history[0]["loss"] == pytest.approx(tree.state.log_history[0]["loss"], rel=1e-6)
    assert_same_update(family, trl, trl_updates, tree, tree_updates, 1e-5)


def preference_rows(trainer: str) -> Dataset:
    """DPO pairs (KTO: each pair as a desirable and an undesirable row) on image prompts: two share their prompt and
    image, the same question about another image must not merge with them, one prompt shows two images."""

    def question(images: int, text: str) -> list[dict]:
        return [{"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": text}]}]

    def answer(text: str) -> list[dict]:
        return [{"role": "assistant", "content": text}]

    rows = [([RED], "w5 w6", "w7 w8", "w9"), ([BLUE], "w5 w6", "w7 w8", "w9 w10"), ([RED], "w5 w6", "w7 w8", "w15")]
    rows.append(([WIDE, RED], "w11", "w12 w13 w14", "w12"))
    if trainer == "dpo":
        columns = {"chosen": [answer(r[2]) for r in rows], "rejected": [answer(r[3]) for r in rows]}
    else:  # KTO's rows listed pair by pair
        columns = {"completion": [answer(r[k]) for r in rows for k in (2, 3)], "label": [True, False] * len(rows)}
        rows = [r for r in rows for _ in range(2)]
    prompts = [question(len(r[0]), r[1]) for r in rows]
    return Dataset.from_dict({"prompt": prompts, "images": [r[0] for r in rows], **columns})


@pytest.mark.parametrize(
    "trainer, family",
    fast_on_one_family([("dpo", f) for f in (*QWEN_FAMILIES, "llava_next")] + [("kto", "qwen2_vl")]),
    ids=lambda x: x,
)
def test_preference_step_on_qwen_and_llava_next_matches_trl(tmp_path, trainer, family):
    """TreeDPOTrainer (TreeKTOTrainer, its KL pass included) on image prompts = TRL's DPOTrainer (KTOTrainer): one
    clipped SGD step, same loss and updates; the rows sharing a prompt and image merged."""
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer

    from hf_tree.trl.dpo import TreeDPOConfig, TreeDPOTrainer
    from hf_tree.trl.kto import TreeKTOConfig, TreeKTOTrainer

    classes = {
        "dpo": ((DPOTrainer, DPOConfig), (TreeDPOTrainer, TreeDPOConfig)),
        "kto": ((KTOTrainer, KTOConfig), (TreeKTOTrainer, TreeKTOConfig)),
    }[trainer]
    path = str(tmp_path / family)
    tiny_vlm(family, attn="sdpa").save_pretrained(path)
    dataset = preference_rows(trainer)

    def make_args(config):
        return tiny_trl_config(
            config, path, torch.float64, max_steps=1, learning_rate=1.0, max_length=None, beta=1.0, **CLIPPED
        )  # beta 1: a gradient norm over 1, which the clipping rescales

    (trl, trl_updates), (tree, tree_updates) = run_both(classes, path, family, dataset, make_args)
    assert tree.tree_head.layout_stats.dedup_ratio > 1  # rows shared their image prompt
    assert trl.state.log_history[0]["loss"] == pytest.approx(tree.state.log_history[0]["loss"], rel=TRL_TOLERANCE)
    assert_same_update(family, trl, trl_updates, tree, tree_updates, TRL_STEP_TOLERANCE)


def test_launcher_fully_fine_tunes_a_saved_vision_language_model(tmp_path):
    """``hf-tree train`` (hf_tree.launcher.main) with ``--use_peft False`` on a tiny LLaVA saved with its processor and
    the offline image questions (``builtin:shapes``, one tree per image): it trains every weight, saves the full
    model and processor, and the saved folder loads as an image-text-to-text model whose weights (vision tower, text
    model, projector) moved from the initial ones."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from hf_tree import launcher
    from tests.vision_models import llava_processor

    path, out = tmp_path / "llava", tmp_path / "out"
    initial = tiny_vlm("llava", dtype=torch.float32, attn="sdpa")
    initial.save_pretrained(path)
    llava_processor().save_pretrained(path)
    argv = ["--model_name_or_path", str(path), "--dataset_name", "builtin:shapes", "--group_by", "image_id"]
    argv += [
        "--max_train_samples",
        "8",
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "2",
        "--use_peft",
        "False",
    ]
    argv += ["--learning_rate", "1e-2", "--output_dir", str(out), "--report_to", "none", "--save_strategy", "no"]
    argv += ["--max_packed_tokens", "512"]
    summary = launcher.main(argv)
    assert torch.isfinite(torch.tensor(summary["train_loss"])) and summary["dedup_ratio"] > 1
    saved = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    assert (
        type(saved) is type(initial)
        and AutoProcessor.from_pretrained(out).image_token_id == initial.config.image_token_id
    )
    before, after = initial.state_dict(), saved.state_dict()
    assert before.keys() == after.keys()
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    for part in ("vision_tower", "multi_modal_projector", "language_model", "lm_head"):
        assert any(part in name for name in moved), part


@pytest.mark.parametrize("family", fast_on_one_family(["qwen2_vl", "qwen3_5", "llava_next"]))
def test_grpo_step_on_image_prompts_matches_trl(tmp_path, monkeypatch, family):
    """TreeGRPOTrainer = TRL's GRPOTrainer through the family's real processor: two prompts with the same text and
    images of two sizes, completions sampled by both from the same seed and weights (no ``rollout_func``), old-policy,
    reference and policy passes (2 micro-batches, 2 iterations per generation), one clipped SGD step."""
    from trl import GRPOConfig, GRPOTrainer

    from hf_tree.trl.grpo import TreeGRPOConfig, TreeGRPOTrainer
    from tests.helpers import trainer_args, varied_reward

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    path = str(tmp_path / family)
    tiny_vlm(family, attn="sdpa").save_pretrained(path)
    question = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "w5 w6 w7"}]}]
    dataset = Dataset.from_dict({"prompt": [question, question], "image": [RED, WIDE]})
    # max_grad_norm 0.5: these policy gradients' norms lie near 1, the clipping must bite
    settings = dict(gradient_accumulation_steps=2, num_iterations=2, max_steps=1, learning_rate=1.0, max_grad_norm=0.5)
    results = []
    for cls, config in ((GRPOTrainer, GRPOConfig), (TreeGRPOTrainer, TreeGRPOConfig)):
        args = trainer_args(config, path, torch.float64, seed=0, **settings)
        prompts = processor(family)
        prompts.tokenizer.padding_side = "left"  # as TRL loads it: mm_token_type_ids must line up with its prompts
        trainer = cls(path, varied_reward, args, train_dataset=dataset, processing_class=prompts)
        with float64_vision_rotary():
            results.append((trainer, train_and_measure_updates(trainer)))
    (trl, trl_updates), (tree, tree_updates) = results
    assert "tree/dedup_ratio" in tree.state.log_history[0]  # the policy pass ran on trees
    assert trl.state.log_history[0]["loss"] == pytest.approx(tree.state.log_history[0]["loss"], rel=TRL_TOLERANCE)
    assert_same_update(family, trl, trl_updates, tree, tree_updates, TRL_STEP_TOLERANCE)


def test_vision_sft_refuses_a_processor_with_other_image_inputs(tmp_path):
    """Idefics3's processor returns a ``pixel_attention_mask``, which vision SFT rows do not carry: refused at set-up,
    naming it, instead of training without it."""
    from hf_tree.trl.sft import TreeSFTConfig, TreeSFTTrainer
    from tests.vision_models import idefics3_processor

    dataset = Dataset.from_dict({"messages": [chat("w3", "w4")], "images": [[RED]]})
    args = TreeSFTConfig(str(tmp_path), max_packed_tokens=64, use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match=r"Idefics3Processor returns \['pixel_attention_mask'\]"):
        TreeSFTTrainer(tiny_vlm("idefics3"), args=args, train_dataset=dataset, processing_class=idefics3_processor())
