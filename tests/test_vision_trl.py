"""TRL trainers on images: TreeGRPOTrainer on image prompts against TRL's own GRPOTrainer (same saved tiny
vision-language model), and TreeSFTTrainer's refusal of vision datasets.

Oracle: TRL's ``_get_per_token_logps_and_entropies`` on padded rows carrying each row's copy of its prompt's image
(TRL chunks rows by ``batch_size``). The tree passes merge rows by tokens *and* image (two prompts with the same
tokens but different images stay apart) and encode each distinct image once per pass.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from hf_tree.trl.grpo import TreeGRPOConfig, TreeGRPOTrainer
from tests.helpers import (
    FLOAT32_FLOOR,
    TRL_STEP_TOLERANCE,
    TRL_TOLERANCE,
    float32_floor_grad_error,
    float64_norms,
    max_grad_relative_error,
    relative_error,
    trainer_args,
    word_tokenizer,
    zero_reward,
)
from tests.vision_models import (
    FLOAT32_INTERNALS,
    IMAGE_TOKEN,
    float64_vision_rotary,
    is_mrope,
    placeholders,
    processor_batch,
    tiny_image,
    tiny_vlm,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
COMPLETIONS = [[20, 21, 22], [20, 21, 1], [23, 24, 25, 26], [20, 21, 22]]  # a duplicate and shared prefixes
ROLLOUTS = [[20, 21, 22], [20, 21, 2], [23, 24, 25], [20, 26, 1]]  # varied_reward (id sum mod 7): 0, 1, 2, 4


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "llava", "llava_next"])
def trainers(request, tmp_path_factory):
    family = request.param
    path = str(tmp_path_factory.mktemp(family))
    tiny_vlm(family, attn="sdpa").save_pretrained(path)
    setup = dict(train_dataset=Dataset.from_dict({"prompt": ["w3"]}), processing_class=word_tokenizer())
    trl = GRPOTrainer(path, zero_reward, trainer_args(GRPOConfig, path, torch.float64), **setup)
    tree = TreeGRPOTrainer(path, zero_reward, trainer_args(TreeGRPOConfig, path, torch.float64), **setup)
    return family, trl, tree


def image_groups(family: str) -> tuple[torch.Tensor, torch.Tensor, int, dict, int]:
    """Three groups of 4 completions: two prompts with the same tokens and different images, one with another
    image size (Qwen) and text. Returns ids, mask ``[12, T]``, completion columns, the image inputs TRL passes and the
    number of distinct images' encoder rows (patches for Qwen, images for LLaVA)."""
    first, same_size, other = tiny_image(family, 1), tiny_image(family, 3), tiny_image(family, 2, height=4, width=8)
    prompts = [
        ([3, 4, *placeholders(family, first), 5], first),
        ([3, 4, *placeholders(family, same_size), 5], same_size),
        ([6, *placeholders(family, other), 5], other),
    ]
    rows = [(prompt, image, completion) for prompt, image in prompts for completion in COMPLETIONS]
    prompt_width, width = max(len(p) for p, _ in prompts), max(len(c) for c in COMPLETIONS)
    ids = torch.zeros(len(rows), prompt_width + width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, (prompt, _, completion) in enumerate(rows):  # left-padded prompts, right-padded completions
        ids[r, prompt_width - len(prompt) : prompt_width + len(completion)] = torch.tensor(prompt + completion)
        mask[r, prompt_width - len(prompt) : prompt_width + len(completion)] = 1
    inputs = processor_batch([image for _, image, _ in rows])  # LLaVA-Next: tiles padded to the most (5)
    inputs["num_images"] = [1] * len(rows)
    if is_mrope(family):
        inputs["mm_token_type_ids"] = (ids == IMAGE_TOKEN).int()
    pixels = [image["pixel_values"] for _, image in prompts]  # encoder rows: LLaVA-Next's tiles (3, 3 and 5)
    distinct = sum(p.shape[1] if p.dim() == 5 else p.shape[0] for p in pixels)
    return ids, mask, width, inputs, distinct


def log_probs_and_grads(trainer, model, batch) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    ids, mask, keep, inputs, _ = batch
    model.zero_grad()
    with float64_norms(), float64_vision_rotary():
        logps, entropy, _ = trainer._get_per_token_logps_and_entropies(
            model, ids, mask, keep, batch_size=4, compute_entropy=True, **inputs
        )
        (logps * torch.linspace(0.1, 1.0, keep)).sum().backward()
    return logps.detach(), entropy, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_image_logprobs_entropies_and_gradients_match_trl(trainers):
    family, trl, tree = trainers
    batch = image_groups(family)
    encoded = []
    encoder = tree.model.model.visual.patch_embed if is_mrope(family) else tree.model.model.vision_tower
    hook = encoder.register_forward_hook(lambda m, args, out: encoded.append(args[0].shape[0]))
    logps, entropy, grads = log_probs_and_grads(tree, tree.model, batch)
    hook.remove()
    trl_logps, trl_entropy, trl_grads = log_probs_and_grads(trl, trl.model, batch)
    assert relative_error(logps, trl_logps) <= TRL_TOLERANCE
    assert relative_error(entropy, trl_entropy) <= TRL_TOLERANCE
    if family in FLOAT32_INTERNALS:  # GatedDeltaNet's float32 decay gradients (tests/test_hybrid_mixers.py's floor)
        assert float32_floor_grad_error(grads, trl_grads) <= FLOAT32_FLOOR
    else:  # TRL's fused kernel computes its gradients in float32 even for float64 models (docs/grpo_dpo.md)
        assert max_grad_relative_error(grads, trl_grads) <= TRL_STEP_TOLERANCE
    assert encoded == [batch[4]], "one encoder call over the 3 distinct images (TRL: 12 images in 3 chunks)"
    stats = tree.tree_head.layout_stats  # tries by first token: the two "3 4 <image> 5" prompts share one
    assert stats.num_trees == 2 and stats.dedup_ratio > 2


def test_reference_pass_matches_trl(trainers):
    family, trl, tree = trainers
    ids, mask, keep, inputs, _ = image_groups(family)
    with torch.no_grad(), float64_norms(), float64_vision_rotary():
        ref = tree._get_per_token_logps_and_entropies(tree.ref_model, ids, mask, keep, batch_size=4, **inputs)[0]
        trl_ref = trl._get_per_token_logps_and_entropies(trl.ref_model, ids, mask, keep, batch_size=4, **inputs)[0]
    assert relative_error(ref, trl_ref) <= TRL_TOLERANCE


def test_unsupported_image_inputs_raise(trainers):
    family, _, tree = trainers
    ids, mask, keep, inputs, _ = image_groups(family)
    name, unknown = unknown_image_input(inputs, ids.shape[0])
    with pytest.raises(ValueError, match=rf"\['{name}'\]"):
        tree._get_per_token_logps_and_entropies(tree.model, ids, mask, keep, **inputs, **unknown)
    with pytest.raises(ValueError, match=r"num_images=\[2, 0"):
        tree._get_per_token_logps_and_entropies(
            tree.model, ids, mask, keep, **{**inputs, "num_images": [2, 0] + [1] * (ids.shape[0] - 2)}
        )


def test_several_images_per_prompt_match_trl(trainers):
    """Prompts showing two images (LLaVA, LLaVA-Next: their placeholders adjacent, one run of two images' tokens,
    LLaVA-Next's of two sizes; Qwen: each image between its vision start/end tokens), TRL's ``num_images=[2, ...]``:
    log-probs and gradients equal TRL's; a prompt with the same images swapped forks at its first placeholder."""
    family, trl, tree = trainers
    first, second = tiny_image(family, 1), tiny_image(family, 2, height=4, width=8)
    prompts = [([3, *placeholders(family, first), *placeholders(family, second), 5], [first, second])]
    prompts.append(([3, *placeholders(family, second), *placeholders(family, first), 5], [second, first]))
    rows = [(prompt, images, completion) for prompt, images in prompts for completion in COMPLETIONS[:2]]
    width = max(len(c) for c in COMPLETIONS[:2])
    ids = torch.tensor([prompt + completion for prompt, _, completion in rows])
    inputs = processor_batch([image for _, images, _ in rows for image in images])
    inputs["num_images"] = [2] * len(rows)
    if is_mrope(family):
        inputs["mm_token_type_ids"] = (ids == IMAGE_TOKEN).int()
    batch = (ids, torch.ones_like(ids), width, inputs, None)
    logps, _, grads = log_probs_and_grads(tree, tree.model, batch)
    trl_logps, _, trl_grads = log_probs_and_grads(trl, trl.model, batch)
    assert relative_error(logps, trl_logps) <= TRL_TOLERANCE
    if family in FLOAT32_INTERNALS:
        assert float32_floor_grad_error(grads, trl_grads) <= FLOAT32_FLOOR
    else:
        assert max_grad_relative_error(grads, trl_grads) <= TRL_STEP_TOLERANCE
    assert (logps[0] - logps[2]).abs().max() > 1e-3  # swapping the images matters: a wrong merge would show


def unknown_image_input(inputs: dict, rows: int) -> tuple[str, dict]:
    """An image input the family does not take: ``image_sizes`` (LLaVA-Next: ``pixel_attention_mask``)."""
    if "image_sizes" in inputs:
        return "pixel_attention_mask", {"pixel_attention_mask": torch.ones(rows, 8, 8, dtype=torch.bool)}
    return "image_sizes", {"image_sizes": torch.tensor([[8, 8]] * rows)}


@pytest.mark.parametrize(
    "family, num_images",
    [
        ("llava", 1),
        ("gemma3", 1),
        ("gemma3", 2),
        pytest.param("llava", 2, marks=pytest.mark.slow),  # two images in one step: Gemma 3's case covers it
    ],
    ids=["1-llava", "1-gemma3", "2-gemma3", "2-llava"],
)
def test_vision_sft_step_matches_trl(tmp_path, family, num_images):
    """TreeSFTTrainer on TRL's vision rows (``messages`` + ``images``, grouped into one tree by a column: the same
    question about two images forks at the image) = TRL's SFTTrainer (which tokenizes in its vision collator): one SGD
    step, same loss and updates, on a LLaVA with a real processor. With two images per row (the row's, then the other
    colour), LLaVA's placeholders of both form one run, split by each image's placeholder count."""
    Image = pytest.importorskip("PIL.Image")  # hf_tree[vision]
    from trl import SFTConfig, SFTTrainer

    from hf_tree.trl.sft import TreeSFTConfig, TreeSFTTrainer
    from tests.helpers import exact_sgd_args, train_and_measure_updates
    from tests.vision_models import PROCESSORS

    red, blue = Image.new("RGB", (8, 8), (200, 30, 30)), Image.new("RGB", (8, 8), (30, 30, 200))

    def chat(question: str, answer: str) -> list[dict]:
        return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]

    rows = [(red, chat("w5 w6", "w7 w8")), (red, chat("w5 w6", "w9")), (blue, chat("w5 w6", "w7 w8"))]
    rows.append((red, chat("w10", "w11 w12 w13")))
    images = [[r[0], blue if r[0] is red else red][:num_images] for r in rows]
    dataset = Dataset.from_dict({"messages": [r[1] for r in rows], "images": images, "group": [0] * 4})
    path = str(tmp_path / family)
    tiny_vlm(family, attn="sdpa").save_pretrained(path)
    settings = dict(max_steps=1, learning_rate=1.0, per_device_train_batch_size=4, use_cpu=True, bf16=False)
    settings |= dict(model_init_kwargs={"dtype": torch.float64}, max_length=None, shuffle_dataset=False)
    trl = SFTTrainer(
        path,
        args=SFTConfig(**exact_sgd_args(str(tmp_path / "trl"), **settings)),
        train_dataset=dataset,
        processing_class=PROCESSORS[family](),
    )
    tree = TreeSFTTrainer(
        path,
        args=TreeSFTConfig(
            **exact_sgd_args(str(tmp_path / "tree"), **settings), max_packed_tokens=64, group_by="group"
        ),
        train_dataset=dataset,
        processing_class=PROCESSORS[family](),
    )
    assert len(tree.train_dataset) == 1 and len(tree.train_dataset[0]["media"]) == 2  # one tree, each image once
    trl_updates, tree_updates = train_and_measure_updates(trl), train_and_measure_updates(tree)
    # TRL's loss is transformers' ForCausalLMLoss, whose cross-entropy runs on float32 logits even in a float64 model
    # (measured: 1e-7 loss, 4.5e-7 updates); a branch scored against the wrong image is off by O(1)
    assert trl.state.log_history[0]["loss"] == pytest.approx(tree.state.log_history[0]["loss"], rel=1e-6)
    assert trl_updates.keys() == tree_updates.keys() and any("vision_tower" in n for n in tree_updates)
    assert max_grad_relative_error(tree_updates, trl_updates) <= 1e-5


def test_vision_sft_refusals(tmp_path):
    Image = pytest.importorskip("PIL.Image")  # hf_tree[vision]

    from hf_tree.trl.sft import TreeSFTConfig, TreeSFTTrainer

    messages = [{"role": "user", "content": "w3"}, {"role": "assistant", "content": "w4"}]
    dataset = Dataset.from_dict({"messages": [messages], "images": [[Image.new("RGB", (8, 8))]]})
    args = TreeSFTConfig(str(tmp_path), max_packed_tokens=64, use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match="needs the model's processor as processing_class"):
        TreeSFTTrainer(tiny_vlm("llava"), args=args, train_dataset=dataset, processing_class=word_tokenizer())
    prompts = Dataset.from_dict({"prompt": ["w3"], "completion": ["w4"], "image": [Image.new("RGB", (8, 8))]})
    from tests.vision_models import llava_processor

    with pytest.raises(ValueError, match="'messages' \\+ 'images'"):
        TreeSFTTrainer(tiny_vlm("llava"), args=args, train_dataset=prompts, processing_class=llava_processor())


@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3"])
def test_tree_trainer_step_on_image_trees_equals_per_branch_sgd(tmp_path, family):
    """``TreeTrainer`` with ``MediaTreeCollator`` on ``MediaTree.to_dict()`` rows: one SGD step moves every parameter
    (vision tower included) as the per-sample loss's gradient does (Gemma 3: with its bidirectional image blocks)."""
    from hf_tree import TreeTrainer, TreeTrainingArguments
    from hf_tree.vision import MediaTree, MediaTreeCollator
    from tests.helpers import clipped_sgd_updates, exact_sgd_args
    from tests.vision_models import per_branch_vlm_loss

    first, second = tiny_image(family, 1), tiny_image(family, 2)
    a, b = placeholders(family, first), placeholders(family, second)
    sequences = [[1, 2, *a, 5, 6, 7], [1, 2, *a, 5, 8], [1, 2, *b, 5, 6, 7]]
    images = [[first], [first], [second]]
    rows = [
        MediaTree.from_samples(sequences[:2], images[:2], IMAGE_TOKEN),
        MediaTree.from_samples(*[[x[2]] for x in (sequences, images)], IMAGE_TOKEN),
    ]
    reference = tiny_vlm(family)
    with float64_norms(), float64_vision_rotary():
        per_branch_vlm_loss(reference, sequences, images).backward()
    expected = clipped_sgd_updates(reference)  # SGD at learning rate 1, clipped as the trainer clips
    model = tiny_vlm(family)
    args = TreeTrainingArguments(
        **exact_sgd_args(str(tmp_path), max_steps=1, learning_rate=1.0, per_device_train_batch_size=2, use_cpu=True),
        max_packed_tokens=64,
    )
    trainer = TreeTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list([r.to_dict() for r in rows]),
        data_collator=MediaTreeCollator(max_packed_tokens=64),
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with float64_norms(), float64_vision_rotary():
        trainer.train()
    updates = {n: p.detach() - before[n] for n, p in model.named_parameters() if n in expected}
    assert any("visual" in n or "vision_tower" in n for n in updates)
    assert max_grad_relative_error(updates, expected) <= 1e-9


def image_rollout(prompts: list, trainer) -> dict:
    """Generation replaced by fixed completions (TRL's ``rollout_func``), keyed by the prompt image's colour."""
    seen: dict[tuple, int] = {}
    output = {"prompt_ids": [], "completion_ids": [], "logprobs": None}
    for prompt in prompts:
        image = next(part["image"] for part in prompt[0]["content"] if part["type"] == "image")
        colour = image.getpixel((0, 0))
        k = seen[colour] = seen.get(colour, -1) + 1
        rendered = trainer.processing_class.apply_chat_template(prompt, tokenize=True, return_dict=True)
        output["prompt_ids"].append(list(rendered["input_ids"][0]))
        output["completion_ids"].append(ROLLOUTS[(k + sum(colour)) % 4])
    return output


@pytest.mark.parametrize(
    "trainer, peft, family, num_images",
    [
        ("grpo", False, "llava", 1),
        ("grpo", True, "llava", 1),
        ("rloo", False, "llava", 1),
        ("grpo", False, "gemma3", 1),
        ("grpo", False, "llava", 2),
        # two images per prompt again (RLOO, Gemma 3): grpo-2-images covers the path, gemma3's blocks run above
        pytest.param("rloo", False, "llava", 2, marks=pytest.mark.slow),
        pytest.param("grpo", False, "gemma3", 2, marks=pytest.mark.slow),
    ],
    ids=["grpo", "grpo-lora", "rloo", "grpo-gemma3", "grpo-2-images", "rloo-2-images", "grpo-gemma3-2-images"],
)
def test_one_step_on_image_prompts_matches_trl(tmp_path, monkeypatch, trainer, peft, family, num_images):
    """One optimizer step of TreeGRPOTrainer (TreeRLOOTrainer) = TRL's GRPOTrainer (RLOOTrainer) on a LLaVA (Gemma 3:
    bidirectional image blocks, ``token_type_ids``) with a real processor: two prompts with the same text and
    different images (they must not merge), old-policy, reference and policy passes (2 micro-batches, 2 iterations
    per generation), SGD clipped at 1.0. GRPO's completions are fixed (``rollout_func``); RLOO has no such hook and
    samples (the same seed and weights give both the same). With two images per prompt (the same two, swapped in the
    second prompt), LLaVA's processor writes their placeholders as one run."""
    from peft import LoraConfig
    from trl import RLOOConfig, RLOOTrainer

    from hf_tree.trl.rloo import TreeRLOOConfig, TreeRLOOTrainer

    Image = pytest.importorskip("PIL.Image")  # hf_tree[vision]

    from tests.helpers import train_and_measure_updates, varied_reward
    from tests.vision_models import PROCESSORS

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    path = str(tmp_path / family)
    tiny_vlm(family, attn="sdpa").save_pretrained(path)
    question = [{"role": "user", "content": [{"type": "image"}] * num_images + [{"type": "text", "text": "w5 w6 w7"}]}]
    images = [Image.new("RGB", (8, 8), colour) for colour in ((200, 30, 30), (30, 30, 200))]
    column = {"image": images} if num_images == 1 else {"images": [images, images[::-1]]}
    dataset = Dataset.from_dict({"prompt": [question, question], **column})
    classes = {
        "grpo": ((GRPOTrainer, GRPOConfig), (TreeGRPOTrainer, TreeGRPOConfig)),
        "rloo": ((RLOOTrainer, RLOOConfig), (TreeRLOOTrainer, TreeRLOOConfig)),
    }[trainer]
    results = []
    for cls, config in classes:
        args = trainer_args(
            config, path, torch.float64, gradient_accumulation_steps=2, num_iterations=2, max_steps=1, learning_rate=1.0
        )
        run = cls(
            path,
            varied_reward,
            args,
            train_dataset=dataset,
            processing_class=PROCESSORS[family](),
            peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]) if peft else None,
            **({"rollout_func": image_rollout} if trainer == "grpo" else {}),
        )
        results.append((run, train_and_measure_updates(run)))
    (trl, trl_updates), (tree, tree_updates) = results
    assert "tree/dedup_ratio" in tree.state.log_history[0]  # the policy pass ran on trees
    assert trl.state.log_history[0]["loss"] == pytest.approx(tree.state.log_history[0]["loss"], rel=TRL_TOLERANCE)
    assert trl_updates.keys() == tree_updates.keys() and any(u.norm() > 0 for u in trl_updates.values())
    # CLIP's k_proj biases have a zero true gradient (softmax is shift-invariant): their ~1e-19 updates are rounding
    # noise on both sides, so updates are measured against 1e-6 of the largest one (max_grad_relative_error)
    assert max_grad_relative_error(tree_updates, trl_updates) <= TRL_STEP_TOLERANCE
    assert any("vision_tower" in n for n in tree_updates) or peft


@pytest.mark.parametrize(
    "trainer, peft, family, num_images",
    [
        ("dpo", False, "llava", 1),
        ("dpo", True, "llava", 1),
        ("kto", False, "llava", 1),
        ("dpo", False, "gemma3", 1),
        ("dpo", False, "llava", 2),
        pytest.param("kto", False, "llava", 2, marks=pytest.mark.slow),  # two images: the DPO run above covers them
    ],
    ids=["dpo-full-ref_model", "dpo-lora", "kto", "dpo-gemma3", "dpo-2-images", "kto-2-images"],
)
def test_one_preference_step_on_image_prompts_matches_trl(tmp_path, trainer, peft, family, num_images):
    """One SGD step of TreeDPOTrainer (TreeKTOTrainer) = TRL's DPOTrainer (KTOTrainer) on a LLaVA with a real
    processor: chosen and rejected (KTO: completions of one prompt and image) share their image prompt, the same
    question about another image must not merge with it. KTO's KL pass (mismatched pairs) runs on trees too. With two
    images per prompt (the row's image, then the other colour), LLaVA's placeholders of both form one run."""
    from peft import LoraConfig
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer

    from hf_tree.trl.dpo import TreeDPOConfig, TreeDPOTrainer
    from hf_tree.trl.kto import TreeKTOConfig, TreeKTOTrainer
    from tests.helpers import tiny_trl_config, train_and_measure_updates
    from tests.vision_models import PROCESSORS

    Image = pytest.importorskip("PIL.Image")  # hf_tree[vision]
    red, blue = Image.new("RGB", (8, 8), (200, 30, 30)), Image.new("RGB", (8, 8), (30, 30, 200))

    def question(text: str) -> list[dict]:
        return [{"role": "user", "content": [{"type": "image"}] * num_images + [{"type": "text", "text": text}]}]

    def answer(text: str) -> list[dict]:
        return [{"role": "assistant", "content": text}]

    rows = [(red, "w5 w6", "w7 w8", "w9"), (blue, "w5 w6", "w7 w8", "w9 w10"), (red, "w11", "w12 w13 w14", "w12")]
    rows.append((red, "w5 w6", "w7 w8", "w15"))
    if trainer == "dpo":
        columns = {"chosen": [answer(r[2]) for r in rows], "rejected": [answer(r[3]) for r in rows]}
        classes = ((DPOTrainer, DPOConfig), (TreeDPOTrainer, TreeDPOConfig))
    else:  # each pair as a desirable and an undesirable row, listed together (KTO's sequential order)
        columns = {"completion": [answer(r[k]) for r in rows for k in (2, 3)], "label": [True, False] * len(rows)}
        rows = [r for r in rows for _ in range(2)]
        classes = ((KTOTrainer, KTOConfig), (TreeKTOTrainer, TreeKTOConfig))
    pairs = [[r[0], blue if r[0] is red else red] for r in rows]
    column = {"image": [r[0] for r in rows]} if num_images == 1 else {"images": pairs}
    dataset = Dataset.from_dict({"prompt": [question(r[1]) for r in rows], **column, **columns})
    path = str(tmp_path / family)
    tiny_vlm(family, attn="sdpa").save_pretrained(path)
    results = []
    for cls, config in classes:
        run = cls(
            path,
            args=tiny_trl_config(config, path, torch.float64, max_steps=1, learning_rate=1.0, max_length=None),
            train_dataset=dataset,
            processing_class=PROCESSORS[family](),
            peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]) if peft else None,
        )
        with float64_norms():
            results.append((run, train_and_measure_updates(run)))
    (trl, trl_updates), (tree, tree_updates) = results
    assert tree.tree_head.layout_stats.dedup_ratio > 1  # rows shared their image prompt
    assert trl.state.log_history[0]["loss"] == pytest.approx(tree.state.log_history[0]["loss"], rel=TRL_TOLERANCE)
    assert trl_updates.keys() == tree_updates.keys() and any(u.norm() > 0 for u in trl_updates.values())
    # CLIP's k_proj biases have a zero true gradient: measured against 1e-6 of the largest update (as for GRPO)
    assert max_grad_relative_error(tree_updates, trl_updates) <= TRL_STEP_TOLERANCE
    assert any("vision_tower" in n for n in tree_updates) or peft


def test_preference_trainers_refuse_unsupported_vision_language_models(tmp_path):
    """DPO and KTO: a vision-language family outside hf_tree.vision.rows' families is refused at set-up."""
    from hf_tree.trl.dpo import TreeDPOConfig, TreeDPOTrainer
    from hf_tree.trl.kto import TreeKTOConfig, TreeKTOTrainer
    from tests.helpers import tiny_trl_config

    pairs = Dataset.from_dict({"prompt": ["w10 w11"], "chosen": [" w20"], "rejected": [" w21"]})
    rows = Dataset.from_dict({"prompt": ["w10 w11"], "completion": [" w20"], "label": [True]})
    path = str(tmp_path / "idefics3")
    tiny_vlm("idefics3", attn="sdpa").save_pretrained(path)
    for trainer, config, dataset in ((TreeDPOTrainer, TreeDPOConfig, pairs), (TreeKTOTrainer, TreeKTOConfig, rows)):
        with pytest.raises(ValueError, match="model_type='idefics3'.*tree log-probs support text-only causal LMs"):
            trainer(
                path,
                args=tiny_trl_config(config, path, torch.float64),
                train_dataset=dataset,
                processing_class=word_tokenizer(),
            )


def test_dpo_on_text_pairs_with_a_vision_language_model_matches_trl(tmp_path):
    """Text pairs on a Qwen2-VL (no images: its text positions are the depths): one SGD step = TRL's."""
    from trl import DPOConfig, DPOTrainer

    from hf_tree.trl.dpo import TreeDPOConfig, TreeDPOTrainer
    from tests.helpers import tiny_trl_config, train_and_measure_updates

    pairs = {"prompt": ["w10 w11", "w10 w11", "w12"], "chosen": [" w20 w21", " w22", " w23"]}
    pairs["rejected"] = [" w21", " w20 w24", " w25 w26"]
    path = str(tmp_path / "qwen2_vl")
    tiny_vlm("qwen2_vl", attn="sdpa").save_pretrained(path)
    results = []
    for cls, config in ((DPOTrainer, DPOConfig), (TreeDPOTrainer, TreeDPOConfig)):
        args = tiny_trl_config(
            config, path, torch.float64, max_steps=1, learning_rate=1.0, per_device_train_batch_size=3
        )
        trainer = cls(path, args=args, train_dataset=Dataset.from_dict(pairs), processing_class=word_tokenizer())
        with float64_norms():
            results.append(train_and_measure_updates(trainer))
    assert max_grad_relative_error(results[1], results[0]) <= TRL_STEP_TOLERANCE
