"""Vision-language trees: a GRPO-style group (one image prompt, 8 completions) and a multi-turn screenshot trajectory
(one sample per turn, each repeating the history's screenshots); tree vs a padded batch (as TRL) vs one branch at a
time.

    python benchmarks/vlm_group.py            # group: 448x448 image (256 image tokens), 8 completions of 64 tokens;
                                              # trajectory: 4 turns, a 224x224 screenshot and a 32-token reply each
    python benchmarks/vlm_group.py --quick    # smoke test: small images, short texts, one repeat

Model: a random float32 Qwen2-VL (text: hidden 256, 4 layers, vocabulary 4096; vision: depth 4, width 128, patch
14, 2x2 merge), CPU. The image is a shapes picture (``hf_tree.data.shapes_vlm``) through transformers' own Qwen2-VL
image processor (PIL backend); the prompt is some text, the image, a question; completions are random tokens. The
trajectory's screenshots are shapes pictures too, one per turn, between random user text; replies are random tokens.

Methods (forward + backward of the whole step, no optimizer step; both losses divided by the trained tokens):
- ``per_branch``: each sample as one sequence through the model's own forward (``sdpa``, ``pixel_values`` and
  ``image_grid_thw`` of its images, mRoPE positions from the model): the vision tower encodes every image of every
  sample;
- ``padded``: all samples in one right-padded batch through the model's own forward, each row carrying its own
  copies of its images (as TRL's GRPO, DPO and vision SFT batches do): one vision-tower call over all copies, shared
  prefixes computed once per row;
- ``hf_tree``: one ``MediaTree`` (the group, the trajectory), ``MediaTreeCollator``, ``tree_vision_lm_loss`` with
  ``tree_flash``: each image is encoded once and each shared prefix computed once.

Timings: medians of ``--repeats`` interleaved repeats after one warm-up run each; peak memory: torch's CPU
allocator peak during one step (``_profiling.cpu_peak_bytes``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import transformers
from _profiling import cpu_peak_bytes

import hf_tree  # noqa: F401  (registers tree_flash)
from hf_tree.data.shapes_vlm import draw_shapes
from hf_tree.vision import MediaTree, MediaTreeCollator, tree_vision_lm_loss

VOCAB, IMAGE_TOKEN, VISION_START, VISION_END = 4096, 4000, 4001, 4002


def qwen2_vl(quick: bool) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    text = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4)
    text |= dict(num_key_value_heads=2, rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12]})
    vision = dict(depth=4, embed_dim=128, hidden_size=256, num_heads=4, mlp_ratio=2, patch_size=14)
    if quick:
        text |= dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 3, 3]}  # head_dim 16
        vision |= dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2)
    config = transformers.Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_TOKEN,
        video_token_id=4003,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )
    return transformers.Qwen2VLForConditionalGeneration(config).float()


def image_inputs(image, size: int) -> dict[str, torch.Tensor]:
    """``pixel_values`` and ``image_grid_thw`` of one ``size x size`` picture (transformers' own image processor)."""
    processor = transformers.Qwen2VLImageProcessorPil(min_pixels=size * size, max_pixels=size * size)
    inputs = processor(images=[image], return_tensors="pt")
    return {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}


def placeholders(image: dict[str, torch.Tensor]) -> list[int]:
    """The image's placeholder run, wrapped in vision start/end tokens (2x2 merge: a token per 4 patches)."""
    return [VISION_START] + [IMAGE_TOKEN] * (int(image["image_grid_thw"].prod()) // 4) + [VISION_END]


def random_text(generator: torch.Generator) -> Callable[[int], list[int]]:
    return lambda n: torch.randint(3, IMAGE_TOKEN, (n,), generator=generator).tolist()


def group(size: int, completions: int, length: int) -> Workload:
    """GRPO: the prompt (text, the image, a question) and ``completions`` random completions of ``length``."""
    image = image_inputs(draw_shapes(random.Random(0), size)[0], size)
    text = random_text(torch.Generator().manual_seed(0))
    prompt = text(24) + placeholders(image) + text(16)
    sequences = [prompt + text(length) for _ in range(completions)]
    masks = [[0] * len(prompt) + [1] * length for _ in sequences]
    return Workload(
        f"GRPO group: 1 image, {completions} completions of {length}", sequences, masks, [[image]] * completions
    )


def trajectory(size: int, turns: int, length: int) -> Workload:
    """A multi-turn screenshot trajectory: each turn a user message with a new screenshot, then the agent's reply of
    ``length`` tokens; one sample per turn (its whole history as context, its own reply trained), as agent SFT data
    repeats the history in every turn's sample."""
    rng = random.Random(1)
    text = random_text(torch.Generator().manual_seed(1))
    history: list[int] = []
    shots: list[dict[str, torch.Tensor]] = []
    sequences, masks, images = [], [], []
    for _ in range(turns):
        shots.append(image_inputs(draw_shapes(rng, size)[0], size))
        history += text(12) + placeholders(shots[-1]) + text(8)
        reply = text(length)
        sequences.append(history + reply)
        masks.append([0] * len(history) + [1] * length)
        images.append(list(shots))
        history = history + reply
    return Workload(
        f"screenshot trajectory: {turns} turns, one screenshot and a reply of {length} each", sequences, masks, images
    )


@dataclass
class Workload:
    """Samples as the processor writes them: tokens (placeholder runs included), loss masks, images per sample."""

    name: str
    sequences: list[list[int]]
    masks: list[list[int]]
    images: list[list[dict[str, torch.Tensor]]]

    def sample_images(self, index: int) -> dict[str, torch.Tensor]:
        """The processor tensors of one sample's images, concatenated (as a one-sample batch carries them)."""
        return {k: torch.cat([image[k] for image in self.images[index]]) for k in ("pixel_values", "image_grid_thw")}

    @property
    def patches(self) -> list[int]:
        return [sum(int(image["pixel_values"].shape[0]) for image in images) for images in self.images]


def per_branch_step(model, work: Workload) -> float:
    trained, total = sum(sum(m) for m in work.masks), 0.0
    for index, (seq, mask) in enumerate(zip(work.sequences, work.masks)):
        ids = torch.tensor([seq])
        images = work.sample_images(index)
        logits = model(input_ids=ids, mm_token_type_ids=(ids == IMAGE_TOKEN).int(), **images).logits[0, :-1]
        weights = torch.tensor(mask[1:], dtype=logits.dtype)
        loss = (F.cross_entropy(logits, ids[0, 1:], reduction="none") * weights).sum().div(trained)
        loss.backward()
        total += float(loss.detach())
    return total


def padded_step(model, work: Workload) -> float:
    """One forward/backward of all rows right-padded (``[B, T]``), each row carrying its own images' tensors."""
    sequences, masks = work.sequences, work.masks
    width = max(len(s) for s in sequences)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    weights = torch.tensor([m[1:] + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
    rows = [work.sample_images(i) for i in range(len(sequences))]
    copies = {k: torch.cat([row[k] for row in rows]) for k in rows[0]}
    logits = model(
        input_ids=ids, attention_mask=attention, mm_token_type_ids=(ids == IMAGE_TOKEN).int(), **copies
    ).logits[:, :-1]
    ce = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view_as(weights)
    loss = (ce * weights).sum().div(weights.sum())
    loss.backward()
    return float(loss.detach())


def tree_step(model, batch) -> float:
    loss = tree_vision_lm_loss(model, batch)
    loss.backward()
    return float(loss.detach())


def measure(model: transformers.PreTrainedModel, work: Workload, repeats: int) -> None:
    """Time (medians of ``repeats`` interleaved runs after a warm-up) and peak memory of the three methods on
    ``work``; print its table."""
    tree = MediaTree.from_samples(work.sequences, work.images, IMAGE_TOKEN, work.masks)
    batch = MediaTreeCollator(max_packed_tokens=tree.tree.num_tokens)([tree])

    def on(attention: str, step: Callable[[], float]) -> Callable[[], float]:
        def run() -> float:
            model.set_attn_implementation(attention)
            return step()

        return run

    methods = {
        "per_branch": on("sdpa", lambda: per_branch_step(model, work)),
        "padded": on("sdpa", lambda: padded_step(model, work)),
        "hf_tree": on("tree_flash", lambda: tree_step(model, batch)),
    }
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    losses = {}
    for name, run in methods.items():  # warm-up (and hf_tree's one-time model check)
        losses[name] = run()
        model.zero_grad(set_to_none=True)
    for _ in range(repeats):
        for name, run in methods.items():
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    peaks = {}
    for name, run in methods.items():
        peaks[name] = cpu_peak_bytes(run)
        model.zero_grad(set_to_none=True)

    encoded = {
        "per_branch": sum(map(len, work.images)),
        "padded": sum(map(len, work.images)),
        "hf_tree": len(tree.media),
    }
    tree_patches = sum(int(image["pixel_values"].shape[0]) for image in tree.media)
    print(
        f"\n{work.name} (Qwen2-VL, float32, CPU, {torch.get_num_threads()} threads): {tree.tree.num_branch_tokens} "
        f"branch tokens, {tree.tree.num_tokens} tree tokens (token dedup ratio {tree.tree.dedup_ratio:.2f}), "
        f"{sum(work.patches)} image patches per branch, {tree_patches} in the tree; medians of {repeats}"
    )
    print("| method | step time (s) | peak memory (MiB) | images encoded |")
    print("|---|---|---|---|")
    for name in methods:
        time_s, peak = statistics.median(seconds[name]), peaks[name] / 2**20
        print(f"| {name} | {time_s:.3f} | {peak:.1f} | {encoded[name]} |")
    spread = max(abs(v - losses["hf_tree"]) / abs(losses["hf_tree"]) for v in losses.values())
    print(f"same loss: {losses['hf_tree']:.6f} (largest relative difference between methods {spread:.1e}, float32)")
    # The target counts the vision tower's work: text tokens plus image patches, per branch and in the tree
    work_ratio = (tree.tree.num_branch_tokens + sum(work.patches)) / (tree.tree.num_tokens + tree_patches)
    print(f"dedup ratio with the vision tower counted (text tokens + image patches): {work_ratio:.2f}")
    tree_time = statistics.median(seconds["hf_tree"])
    for name in ("per_branch", "padded"):
        speed, memory = statistics.median(seconds[name]) / tree_time, peaks["hf_tree"] / peaks[name]
        print(
            f"step total: hf_tree {speed:.2f}x faster than {name} ({speed / work_ratio:.2f} x that dedup ratio); "
            f"peak memory hf_tree / {name} = {memory:.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes for the smoke test")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--completions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4, help="trajectory: turns, a screenshot each")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1: on a shared machine more threads spin)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    size, length, repeats = (112, 16, 1) if args.quick else (448, 64, args.repeats)
    model = qwen2_vl(args.quick)
    measure(model, group(size, args.completions, length), repeats)
    measure(model, trajectory(size // 2, args.turns, length // 2), repeats)


if __name__ == "__main__":
    main()
