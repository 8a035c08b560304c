"""Vision-language GRPO-style group: one image prompt, 8 completions; tree vs a padded batch (as TRL) vs one branch
at a time.

    python benchmarks/vlm_group.py            # 448x448 image (256 image tokens), 8 completions of 64 tokens
    python benchmarks/vlm_group.py --quick    # smoke test: 112x112 image, short completions, one repeat

Model: a random float32 Qwen2-VL (text: hidden 256, 4 layers, vocabulary 4096; vision: depth 4, width 128, patch
14, 2x2 merge), CPU. The image is a shapes picture (``hf_tree.data.shapes_vlm``) through transformers' own Qwen2-VL
image processor (PIL backend); the prompt is some text, the image, a question; completions are random tokens.

Methods (forward + backward of the whole step, no optimizer step; both losses divided by the trained tokens):
- ``per_branch``: each completion with its prompt as one sequence through the model's own forward (``sdpa``,
  ``pixel_values`` and ``image_grid_thw`` of its image, mRoPE positions from the model): the vision tower encodes the
  image once per completion;
- ``padded``: all completions in one right-padded batch through the model's own forward, each row carrying its own
  copy of the image (``pixel_values``/``image_grid_thw`` repeated per row, as TRL's GRPO and DPO batches do): one
  vision-tower call over all copies, the prompt computed once per row;
- ``hf_tree``: one ``MediaTree`` (the group), ``MediaTreeCollator``, ``tree_vision_lm_loss`` with ``tree_flash``: the
  image is encoded once and the prompt computed once.

Timings: medians of ``--repeats`` interleaved repeats after one warm-up run each; peak memory: torch's CPU
allocator peak during one step (``_profiling.cpu_peak_bytes``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

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


def group(size: int, completions: int, length: int) -> tuple[list[list[int]], list[list[int]], dict]:
    """The prompt (text, the image's placeholders, a question) and ``completions`` random completions; masks."""
    image, _ = draw_shapes(random.Random(0), size)
    processor = transformers.Qwen2VLImageProcessorPil(min_pixels=size * size, max_pixels=size * size)
    inputs = processor(images=[image], return_tensors="pt")
    tokens = int(inputs["image_grid_thw"].prod()) // 4
    rng = torch.Generator().manual_seed(0)
    text = lambda n: torch.randint(3, IMAGE_TOKEN, (n,), generator=rng).tolist()  # noqa: E731
    prompt = text(24) + [VISION_START] + [IMAGE_TOKEN] * tokens + [VISION_END] + text(16)
    sequences = [prompt + text(length) for _ in range(completions)]
    masks = [[0] * len(prompt) + [1] * length for _ in sequences]
    return sequences, masks, {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}


def per_branch_step(model, sequences, masks, image) -> float:
    trained, total = sum(sum(m) for m in masks), 0.0
    for seq, mask in zip(sequences, masks):
        ids = torch.tensor([seq])
        logits = model(input_ids=ids, mm_token_type_ids=(ids == IMAGE_TOKEN).int(), **image).logits[0, :-1]
        weights = torch.tensor(mask[1:], dtype=logits.dtype)
        loss = (F.cross_entropy(logits, ids[0, 1:], reduction="none") * weights).sum().div(trained)
        loss.backward()
        total += float(loss.detach())
    return total


def padded_step(model, sequences, masks, image) -> float:
    """One forward/backward of all rows right-padded (``[B, T]``), the image's tensors repeated once per row."""
    width = max(len(s) for s in sequences)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    weights = torch.tensor([m[1:] + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
    copies = {k: torch.cat([v] * len(sequences)) for k, v in image.items()}
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes for the smoke test")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--completions", type=int, default=8)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1: on a shared machine more threads spin)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    size, length, repeats = (112, 16, 1) if args.quick else (448, 64, args.repeats)
    model = qwen2_vl(args.quick)
    sequences, masks, image = group(size, args.completions, length)
    tree = MediaTree.from_samples(sequences, [[image]] * len(sequences), IMAGE_TOKEN, masks)
    batch = MediaTreeCollator(max_packed_tokens=tree.tree.num_tokens)([tree])

    def per_branch() -> float:
        model.set_attn_implementation("sdpa")
        return per_branch_step(model, sequences, masks, image)

    def padded() -> float:
        model.set_attn_implementation("sdpa")
        return padded_step(model, sequences, masks, image)

    def hf_tree_run() -> float:
        model.set_attn_implementation("tree_flash")
        return tree_step(model, batch)

    methods = {"per_branch": per_branch, "padded": padded, "hf_tree": hf_tree_run}
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

    patches = int(image["pixel_values"].shape[0])
    print(
        f"VLM group step (Qwen2-VL, float32, CPU, {torch.get_num_threads()} threads): 1 image "
        f"({size}x{size}, {patches} patches, {patches // 4} image tokens), prompt {len(sequences[0]) - length} "
        f"tokens, {len(sequences)} completions of {length}; token dedup ratio {tree.tree.dedup_ratio:.2f}; "
        f"medians of {repeats}"
    )
    print("| method | step time (s) | peak memory (MiB) | images encoded |")
    print("|---|---|---|---|")
    for name in methods:
        encoded = 1 if name == "hf_tree" else len(sequences)
        time_s, peak = statistics.median(seconds[name]), peaks[name] / 2**20
        print(f"| {name} | {time_s:.3f} | {peak:.1f} | {encoded} |")
    spread = max(abs(v - losses["hf_tree"]) / abs(losses["hf_tree"]) for v in losses.values())
    print(f"same loss: {losses['hf_tree']:.6f} (largest relative difference between methods {spread:.1e}, float32)")
    # The target counts the vision tower's work: text tokens plus image patches, per branch and in the tree
    branch_work = tree.tree.num_branch_tokens + len(sequences) * patches
    work_ratio = branch_work / (tree.tree.num_tokens + patches)
    print(f"dedup ratio with the vision tower counted (text tokens + image patches): {work_ratio:.2f}")
    tree_time = statistics.median(seconds["hf_tree"])
    for name in ("per_branch", "padded"):
        speed, memory = statistics.median(seconds[name]) / tree_time, peaks["hf_tree"] / peaks[name]
        print(
            f"step total: hf_tree {speed:.2f}x faster than {name} ({speed / work_ratio:.2f} x that dedup ratio); "
            f"peak memory hf_tree / {name} = {memory:.2f}"
        )


if __name__ == "__main__":
    main()
