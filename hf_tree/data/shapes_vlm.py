"""Offline image questions with checkable answers: coloured shapes drawn with PIL, seeded.

Each image holds a few circles, squares and triangles of a few colours on a white canvas; its questions ask for counts
("How many red shapes are there?", "How many circles are there?") and for the colour of the largest shape, so an
answer can be checked exactly (``check_answer``). Several questions about one image are the tree-shaped case: their
samples share the image (and the prompt tokens before the question) and fork at the question.

Everything comes from ``random.Random(seed)``: the same arguments always give the same images and questions. Needs
Pillow (``pip install hf_tree[vision]``), imported when an image is drawn.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

COLORS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220), "yellow": (230, 200, 20)}
KINDS = ("circle", "square", "triangle")


@dataclass(frozen=True)
class Shape:
    kind: str
    color: str
    center: tuple[int, int]
    radius: int


def draw_shapes(rng: random.Random, size: int = 112, max_shapes: int = 5) -> tuple[Any, list[Shape]]:
    """One ``size x size`` RGB ``PIL.Image`` with 1..``max_shapes`` shapes of distinct sizes, and the shapes."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    radii = rng.sample(range(size // 16, size // 5), rng.randint(1, max_shapes))  # distinct: one largest shape
    shapes = []
    for radius in radii:
        kind, color = rng.choice(KINDS), rng.choice(list(COLORS))
        x, y = rng.randint(radius, size - radius), rng.randint(radius, size - radius)
        box = (x - radius, y - radius, x + radius, y + radius)
        if kind == "circle":
            draw.ellipse(box, fill=COLORS[color])
        elif kind == "square":
            draw.rectangle(box, fill=COLORS[color])
        else:
            draw.polygon([(x, y - radius), (x - radius, y + radius), (x + radius, y + radius)], fill=COLORS[color])
        shapes.append(Shape(kind, color, (x, y), radius))
    return image, shapes


def questions(shapes: list[Shape], rng: random.Random, count: int) -> list[tuple[str, str]]:
    """``count`` distinct (question, answer) pairs about ``shapes`` (fewer if the image offers fewer)."""
    pool = [(f"How many {c} shapes are there?", str(sum(s.color == c for s in shapes))) for c in COLORS]
    pool += [(f"How many {k}s are there?", str(sum(s.kind == k for s in shapes))) for k in KINDS]
    pool.append(("What color is the largest shape?", max(shapes, key=lambda s: s.radius).color))
    return rng.sample(pool, min(count, len(pool)))


def check_answer(completion: str, answer: str) -> bool:
    """Whether the completion's first word (lower case, trailing punctuation dropped) is the answer."""
    words = completion.strip().split()
    return bool(words) and words[0].lower().rstrip(".,!") == answer


def shape_questions(
    num_images: int, questions_per_image: int = 4, size: int = 112, seed: int = 0
) -> Iterator[tuple[Any, int, str, str]]:
    """``(image, image_id, question, answer)`` for ``num_images`` seeded images, ``questions_per_image`` each (fewer
    where an image offers fewer)."""
    rng = random.Random(seed)
    for image_id in range(num_images):
        image, shapes = draw_shapes(rng, size)
        for question, answer in questions(shapes, rng, questions_per_image):
            yield image, image_id, question, answer


def shapes_dataset(num_images: int, questions_per_image: int = 4, size: int = 112, seed: int = 0) -> Any:
    """A ``datasets.Dataset`` in TRL's vision format, one row per question: ``prompt`` (a user message with an image
    part and the question), ``image`` (the ``PIL.Image``), ``answer`` (text), ``image_id`` (rows of one image share
    it: group by it to build one tree per image)."""
    import datasets

    rows: dict[str, list] = {"prompt": [], "image": [], "answer": [], "image_id": []}
    for image, image_id, question, answer in shape_questions(num_images, questions_per_image, size, seed):
        rows["prompt"].append([user_turn(question)])
        rows["image"].append(image)
        rows["answer"].append(answer)
        rows["image_id"].append(image_id)
    return datasets.Dataset.from_dict(rows)


def shapes_sft_dataset(num_images: int, questions_per_image: int = 4, size: int = 112, seed: int = 0) -> Any:
    """The same questions as supervised conversations, TRL's vision SFT format: ``messages`` (the user turn of
    ``shapes_dataset`` and the answer as the assistant turn), ``images`` (``[image]``) and ``image_id``
    (TreeSFTTrainer's ``group_by="image_id"`` merges the questions about one image into one tree, the image encoded
    once)."""
    import datasets

    rows: dict[str, list] = {"messages": [], "images": [], "image_id": []}
    for image, image_id, question, answer in shape_questions(num_images, questions_per_image, size, seed):
        assistant = {"role": "assistant", "content": [{"type": "text", "text": answer}]}
        rows["messages"].append([user_turn(question), assistant])
        rows["images"].append([image])
        rows["image_id"].append(image_id)
    return datasets.Dataset.from_dict(rows)


def user_turn(question: str) -> dict[str, Any]:
    """A user message with the image part, then the question."""
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}
