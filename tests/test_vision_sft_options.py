"""Every ``TreeSFTConfig`` field that changes the objective, run on vision ``messages`` rows: honoured (equal to TRL's
``SFTTrainer`` where TRL has the option, to the per-branch objective otherwise) or refused by name at init.

Oracles: TRL's ``SFTTrainer`` on the same rows (its vision collator renders each row with the processor, asking for
``return_assistant_tokens_mask`` under ``assistant_only_loss``); for hf_tree's own options, each branch rendered by
the processor on its own (the conversation up to an assistant turn, with the images it shows) and run through the
model as an ordinary sequence, float64. Data: two conversations of three assistant turns about one image, one of them
showing a second image in a later turn (so a per-turn branch shows only the images of its history), merged into one
tree by a column.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import transformers
from datasets import Dataset

from hf_tree.trl.sft import TreeSFTConfig, TreeSFTTrainer
from tests.helpers import (
    clipped_sgd_updates,
    exact_sgd_args,
    float64_norms,
    max_grad_relative_error,
    train_and_measure_updates,
)
from tests.vision_models import llava_processor, role_chat_template, tiny_vlm

Image = pytest.importorskip("PIL.Image")  # hf_tree[vision]
pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Options run against their oracle below ("trl": TRL's SFTTrainer with the same option; else the per-branch mask).
HONOURED = {
    "assistant_only_loss": ({"assistant_only_loss": True}, "trl"),
    "completion_only_loss": ({"completion_only_loss": False}, "trl"),
    "loss_type": ({"loss_type": "dft"}, "trl"),
    "label_smoothing_factor": ({"label_smoothing_factor": 0.1}, "trl"),
    "messages_branches": ({"messages_branches": "per_turn"}, "last_assistant"),
    "train_on": ({"messages_branches": "per_turn", "train_on": "all_assistant"}, "all_assistant"),
    "normalization": ({"normalization": "sequence"}, "every_token"),
}
# Options refused at init, naming the field (a value that would change the objective, and the message).
REFUSED = {
    "completion_only_loss": ({"completion_only_loss": True}, "completion_only_loss=True cannot apply to vision"),
    "chat_template_path": ({"chat_template_path": "template.jinja"}, "chat_template_path cannot apply"),
    "truncation_mode": ({"truncation_mode": "keep_end", "max_length": 64}, "truncation_mode='keep_end' cannot apply"),
    # TreeSFTConfig's default "truncate" never cuts an image branch: a longer one is refused naming its row
    "overlong": ({"overlong": "truncate", "max_length": 8}, "Image branches are never truncated"),
    "tree_execution": ({"tree_execution": "depth_first"}, "tree_execution='depth_first' is not supported"),
    "max_length": ({"max_length": 8}, r"row 0 has a branch of \d+ tokens, more than max_branch_tokens=8"),
    "max_branch_tokens": ({"max_branch_tokens": 8}, "more than max_branch_tokens=8"),
    "packing": ({"packing": True}, "packing=True cannot apply"),
    "padding_free": ({"padding_free": True}, "padding_free=True cannot apply"),
    "eval_packing": ({"eval_packing": True}, "eval_packing=True cannot apply"),
}
# Fields that do not change which tokens are trained, their weights or their loss on these rows.
INERT = {
    "model_init_kwargs": "how the model loads",
    "trust_remote_code": "how the model loads",
    "dataset_text_field": "names the text column of 'text' rows; vision rows are 'messages' (TRL ignores it there too)",
    "dataset_kwargs": "dataset preparation is hf_tree's own for vision rows",
    "dataset_num_proc": "speed",
    "eos_token": "appended to plain-text rows only; 'messages' rows are rendered by the chat template (as TRL)",
    "shuffle_dataset": "order only",
    "packing_strategy": "packing=True is refused",
    "pad_to_multiple_of": "padding is never trained",
    "pad_token": "padding is never trained",
    "activation_offloading": "memory only",
    "max_packed_tokens": "row size (trees larger than a row are split exactly); its branch limit is max_branch_tokens",
    "context_parallel_strategy": "context parallel refuses image batches",
    "context_parallel_chunks_per_rank": "context parallel refuses image batches",
    "context_parallel_query_block_size": "context parallel refuses image batches",
    "tree_self_check": "a check, not the objective",
    "group_by": "which rows share a tree: merging is exact",
    "batch_unit": "which rows share a step (tests/test_sft.py covers both units)",
}
# Covered by another test because no tiny vision-language family here has the feature.
ELSEWHERE = {
    "router_aux_loss_coef": "MoE router loss: tests/test_moe_router_loss.py (no MoE VLM among the tiny ones)",
    "merge_in_batch": "test_image_trees_merge_in_the_batch_as_trl_trains_them (the rows above are one tree)",
}
# TrainingArguments fields that change the objective (the others are TRL's and hf_tree's own, walked by name).
TRAINING_ARGUMENT_OBJECTIVES = ("label_smoothing_factor",)


def test_every_objective_field_is_classified():
    """A new field of TreeSFTConfig (or of TRL's SFTConfig) fails here until it is honoured or refused on vision rows
    (or named inert, with the reason)."""
    base = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    fields = {f.name for f in dataclasses.fields(TreeSFTConfig)} - base | set(TRAINING_ARGUMENT_OBJECTIVES)
    classified = set(HONOURED) | set(REFUSED) | set(INERT) | set(ELSEWHERE)
    assert fields == classified, f"unclassified: {sorted(fields - classified)}; stale: {sorted(classified - fields)}"


def turns(*texts: str) -> list[dict]:
    """Alternating user/assistant messages of content parts; a text starting with ``"<image> "`` shows an image."""
    messages = []
    for k, text in enumerate(texts):
        parts = [{"type": "text", "text": text.removeprefix("<image> ")}]
        if text.startswith("<image> "):
            parts.insert(0, {"type": "image", "text": None})
        messages.append({"role": "assistant" if k % 2 else "user", "content": parts})
    return messages


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llava"))
    tiny_vlm("llava", attn="sdpa").save_pretrained(path)
    red, blue = Image.new("RGB", (8, 8), (200, 30, 30)), Image.new("RGB", (8, 8), (30, 30, 200))
    conversations = [
        turns("<image> w5 w6", "w7 w8", "w9", "w10 w11", "<image> w12", "w13"),
        turns("<image> w5 w6", "w7 w14", "w15", "w16", "w17", "w18 w19"),
    ]
    dataset = Dataset.from_dict({"messages": conversations, "images": [[red, blue], [red]], "group": [0, 0]})
    return path, dataset


def settings(tmp_path, **options) -> dict:
    common = dict(max_steps=1, learning_rate=1.0, use_cpu=True, bf16=False, shuffle_dataset=False, max_length=None)
    return exact_sgd_args(str(tmp_path), model_init_kwargs={"dtype": torch.float64}, **common) | options


def tree_trainer(path, dataset, tmp_path, **options) -> TreeSFTTrainer:
    args = TreeSFTConfig(
        **settings(tmp_path / "tree", per_device_train_batch_size=1, **options),
        max_packed_tokens=128,
        group_by="group",
        batch_unit="trees",
    )
    return TreeSFTTrainer(path, args=args, train_dataset=dataset, processing_class=llava_processor(role_template()))


def role_template() -> str:
    return role_chat_template("<image>")


def branch_updates(path: str, dataset: Dataset, objective: str, normalization: str) -> dict[str, torch.Tensor]:
    """SGD updates (learning rate 1, clipped at 1.0 as the trainer clips) of the per-branch objective: each branch
    rendered alone by the processor (its images' pixel_values with it) and run as an ordinary sequence.
    ``objective``: ``"every_token"`` (one branch per conversation, every token), ``"last_assistant"``/
    ``"all_assistant"`` (one branch per assistant turn, its own / every assistant message's tokens, from the
    template's assistant mask)."""
    from trl.data_utils import prepare_multimodal_messages

    processor, model = (
        llava_processor(role_template()),
        transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float64),
    )
    losses, counts = [], []
    for row in dataset:
        messages = prepare_multimodal_messages(row["messages"], images=row["images"])
        ends = [len(messages) - 1] if objective == "every_token" else [i for i, m in enumerate(messages) if i % 2]
        for end in ends:
            out = processor.apply_chat_template(
                messages[: end + 1],
                tokenize=True,
                return_dict=True,
                return_tensors="pt",
                return_assistant_tokens_mask=True,
                processor_kwargs={"add_special_tokens": False},
            )
            ids, mask = out["input_ids"], out["assistant_masks"][0].double()
            if objective == "every_token":
                mask = torch.ones_like(mask)
            elif objective == "last_assistant":  # only the last run of assistant tokens
                start = int(torch.nonzero(mask[: int(torch.nonzero(mask).max())] == 0).max()) + 1
                mask[:start] = 0
            with float64_norms():
                logits = model(input_ids=ids, pixel_values=out["pixel_values"].double()).logits[0, :-1]
            losses.append((F.cross_entropy(logits, ids[0, 1:], reduction="none") * mask[1:]).sum())
            counts.append(mask[1:].sum())
    if normalization == "token":
        loss = sum(losses) / sum(counts)
    else:
        loss = sum(l_ / c for l_, c in zip(losses, counts)) / len(losses)
    loss.backward()
    updates = clipped_sgd_updates(model)  # as the trainer's step (clipping at 1.0: exact_sgd_args)
    return {n: updates.get(n, torch.zeros_like(p)) for n, p in model.named_parameters()}


@pytest.mark.parametrize("field", sorted(HONOURED))
def test_honoured_on_vision_rows(setup, tmp_path, field):
    path, dataset = setup
    options, oracle = HONOURED[field]
    tree = tree_trainer(path, dataset, tmp_path, **options)
    assert len(tree.train_dataset) == 1  # both conversations in one tree
    updates = train_and_measure_updates(tree)
    if oracle == "trl":
        from trl import SFTConfig, SFTTrainer

        trl = SFTTrainer(
            path,
            args=SFTConfig(**settings(tmp_path / "trl", per_device_train_batch_size=2, **options)),
            train_dataset=dataset,
            processing_class=llava_processor(role_template()),
        )
        expected = train_and_measure_updates(trl)
        # TRL's cross-entropy runs on float32 logits even in a float64 model (tests/test_vision_trl.py)
        assert trl.state.log_history[0]["loss"] == pytest.approx(tree.state.log_history[0]["loss"], rel=1e-6)
        tolerance = 1e-5
    else:
        expected = branch_updates(path, dataset, oracle, options.get("normalization", "token"))
        tolerance = 1e-9
    assert any("vision_tower" in n for n in updates)
    assert max_grad_relative_error(updates, expected) <= tolerance


def test_image_trees_merge_in_the_batch_as_trl_trains_them(setup, tmp_path):
    """One tree per row, both in one micro-batch: merged by tokens and image identity (the red image's turn is
    shared, computed and encoded once), TRL's step on the same two rows; merge_in_batch=False takes the same step."""
    from trl import SFTConfig, SFTTrainer

    path, dataset = setup
    steps = []
    for merge in (True, False):
        args = TreeSFTConfig(
            **settings(tmp_path / f"tree{merge}", per_device_train_batch_size=2),
            max_packed_tokens=128,
            group_by="<row>",
            merge_in_batch=merge,
        )
        tree = TreeSFTTrainer(path, args=args, train_dataset=dataset, processing_class=llava_processor(role_template()))
        assert len(tree.train_dataset) == 2
        steps.append((tree, train_and_measure_updates(tree)))
    trl = SFTTrainer(
        path,
        args=SFTConfig(**settings(tmp_path / "trl", per_device_train_batch_size=2)),
        train_dataset=dataset,
        processing_class=llava_processor(role_template()),
    )
    expected = train_and_measure_updates(trl)
    (merged, merged_updates), (unmerged, unmerged_updates) = steps
    assert merged.state.log_history[0]["dedup_ratio"] > unmerged.state.log_history[0]["dedup_ratio"]
    assert trl.state.log_history[0]["loss"] == pytest.approx(merged.state.log_history[0]["loss"], rel=1e-6)
    assert max_grad_relative_error(merged_updates, expected) <= 1e-5  # TRL's float32 logits (see above)
    assert max_grad_relative_error(merged_updates, unmerged_updates) <= 1e-9


def test_per_turn_differs_from_every_token(setup, tmp_path):
    """The objectives differ on these rows (so the comparisons above can fail): per-turn vs every-token updates."""
    path, dataset = setup
    per_turn = branch_updates(path, dataset, "last_assistant", "token")
    assert max_grad_relative_error(per_turn, branch_updates(path, dataset, "every_token", "token")) > 0.1


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_refused_on_vision_rows_at_init(setup, tmp_path, field):
    path, dataset = setup
    options, message = REFUSED[field]
    with pytest.raises(ValueError, match=message):
        tree_trainer(path, dataset, tmp_path, **options)


def test_overlong_drop_is_counted(setup, tmp_path):
    """overlong='drop': image branches longer than max_length are left out and counted, never cut (the two first
    turns, 12 tokens each, stay; the four later ones, 18 tokens and more, go)."""
    from hf_tree.collator import pop_packing_stats

    path, dataset = setup
    trainer = tree_trainer(path, dataset, tmp_path, max_length=16, overlong="drop", messages_branches="per_turn")
    stats = pop_packing_stats(next(iter(trainer.get_train_dataloader())))
    assert stats.num_dropped_branches == 4 and stats.num_truncated_branches == 0 and stats.num_tree_tokens == 14
