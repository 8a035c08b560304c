"""TreeSFTTrainer: an existing TRL SFT script switches by class names only.

Oracle for the swap: the same script with TRL's own ``SFTConfig``/``SFTTrainer`` on a prompt/completion dataset,
one tree per row, same sequential order and batch: the first step's loss must be the same objective (float32).
"""

from __future__ import annotations

import copy
import json

import datasets
import pytest
import torch
import torch.nn.functional as F
from trl import SFTConfig, SFTTrainer

from hf_tree.assets import load_smollm2_tokenizer
from hf_tree.builders import GROUP_BY_PROMPT_TOKENS, GROUP_BY_ROW
from hf_tree.collator import TreeDataCollator, pop_packing_stats
from hf_tree.data.synthetic_agent import synthetic_agent_dataset
from hf_tree.depth_first import DepthFirstConfig, depth_first_backward
from hf_tree.loss import tree_causal_lm_loss
from hf_tree.row_batching import TreePart, plan_row_batches
from hf_tree.sft_losses import sft_token_loss
from hf_tree.tree import Tree
from hf_tree.trl.sft import TreeSFTConfig, TreeSFTTrainer, train_every_token
from tests.helpers import (
    QWEN3_TEMPLATE,
    SMOLLM2_VOCAB,
    exact_sgd_args,
    float64_norms,
    grads_of,
    max_grad_relative_error,
    rendered,
    tiny_model,
    train_and_measure_updates,
)
from tests.workloads import prompt_completion_dataset


@pytest.fixture(scope="module")
def tokenizer():
    return load_smollm2_tokenizer()


def trl_script(config_cls, trainer_cls, tokenizer, dataset, output_dir, **extra):
    """What a user's TRL SFT script does; only the two classes change between runs."""
    args = config_cls(
        output_dir=output_dir,
        max_steps=1,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        gradient_checkpointing=False,
        train_sampling_strategy="sequential",
        seed=0,
        **extra,
    )
    model = tiny_model(vocab_size=SMOLLM2_VOCAB, dtype=torch.float32, attn="sdpa")
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset, processing_class=copy.deepcopy(tokenizer))
    trainer.train()
    return trainer


def first_loss(trainer) -> float:
    return next(h["loss"] for h in trainer.state.log_history if "loss" in h)


def test_class_name_swap_trains_the_same_objective(tmp_path, tokenizer):
    dataset = prompt_completion_dataset()
    trl = trl_script(SFTConfig, SFTTrainer, tokenizer, dataset, str(tmp_path / "trl"))
    tree = trl_script(TreeSFTConfig, TreeSFTTrainer, tokenizer, dataset, str(tmp_path / "tree"), group_by=GROUP_BY_ROW)
    assert first_loss(tree) == pytest.approx(first_loss(trl), rel=1e-5)


def test_depth_first_execution_trains_the_same_objective(tmp_path, tokenizer):
    """TreeSFTTrainer with every tree run depth-first (units of 8 tokens) logs the packed run's first loss."""
    dataset = prompt_completion_dataset()
    packed = trl_script(TreeSFTConfig, TreeSFTTrainer, tokenizer, dataset, str(tmp_path / "packed"))
    depth_first = trl_script(
        TreeSFTConfig,
        TreeSFTTrainer,
        tokenizer,
        dataset,
        str(tmp_path / "depth_first"),
        tree_execution="depth_first",
        max_packed_tokens=8,
        max_length=None,
        max_branch_tokens=64,
    )
    assert first_loss(depth_first) == pytest.approx(first_loss(packed), rel=1e-5)


@pytest.mark.parametrize("loss_type", ["nll", pytest.param("dft", marks=pytest.mark.slow)])
def test_depth_first_steps_equal_trl(tmp_path, tokenizer, loss_type):
    """Two SGD steps (two micro-batches of 2 rows) of TreeSFTTrainer with every tree run depth-first (units of 8
    tokens), float64, with clipping on (TRL's default 1.0; DFT's gradients are ~1e-4 here, so 1e-5), = TRL's
    SFTTrainer (its cross-entropy runs on float32 logits even in a float64 model: 1e-5)."""
    clipping = 1.0 if loss_type == "nll" else 1e-5
    settings = dict(max_steps=2, learning_rate=0.5, per_device_train_batch_size=2, max_grad_norm=clipping, bf16=False)
    settings |= dict(train_sampling_strategy="sequential", loss_type=loss_type, use_cpu=True, max_length=None)
    depth_first = dict(tree_execution="depth_first", max_packed_tokens=8, max_branch_tokens=64, group_by=GROUP_BY_ROW)
    runs = {}
    for name, (config, trainer) in {"trl": (SFTConfig, SFTTrainer), "tree": (TreeSFTConfig, TreeSFTTrainer)}.items():
        args = config(**exact_sgd_args(str(tmp_path / name), **settings), **(depth_first if name == "tree" else {}))
        model = tiny_model(vocab_size=SMOLLM2_VOCAB, dtype=torch.float64, attn="sdpa")
        run = trainer(model, args=args, train_dataset=prompt_completion_dataset(), processing_class=tokenizer)
        runs[name] = (run, train_and_measure_updates(run))
    (trl, trl_updates), (tree, tree_updates) = runs["trl"], runs["tree"]
    trl_logs, tree_logs = ([h for h in t.state.log_history if "loss" in h] for t in (trl, tree))
    assert max(h["grad_norm"] for h in trl_logs) > clipping  # clipping rescaled an update
    assert [h["loss"] for h in tree_logs] == pytest.approx([h["loss"] for h in trl_logs], rel=1e-5)
    assert max_grad_relative_error(tree_updates, trl_updates) <= 1e-5


def test_completions_of_one_prompt_merge_in_their_batch(tmp_path, tokenizer):
    """One tree per row by default (TRL's batches, tests/test_same_rows_as_trl.py); the rows of a batch that share a
    prompt merge there."""
    trainer = trl_script(TreeSFTConfig, TreeSFTTrainer, tokenizer, prompt_completion_dataset(), str(tmp_path))
    assert len(trainer.train_dataset) == 4  # 4 rows, 2 prompts
    log = next(h for h in trainer.state.log_history if "loss" in h)
    assert log["dedup_ratio"] > 1.0 and log["trees_per_step"] == 4


def test_agent_conversations_with_reasoning_and_tools_train(tmp_path, tokenizer):
    dataset = synthetic_agent_dataset(3, seed=4, max_user_turns=2, max_tool_steps=1)
    assert {"reasoning_content", "tool_calls"} <= set(dataset[0]["messages"][2])
    trainer = trl_script(
        TreeSFTConfig,
        TreeSFTTrainer,
        tokenizer,
        dataset,
        str(tmp_path),
        max_length=None,
        chat_template_path=QWEN3_TEMPLATE,
        per_device_eval_batch_size=3,
        messages_branches="per_turn",  # the agent-data trees (TRL's default would be one branch per row)
    )
    log = next(h for h in trainer.state.log_history if "loss" in h)
    assert torch.isfinite(torch.tensor(log["loss"])) and log["dedup_ratio"] > 1.0
    assert json.loads(dataset[0]["tools"])  # TRL stores tools as JSON text; the builders read it
    assert "eval_loss" in trainer.evaluate(dataset)  # raw TRL rows passed to evaluate are built into trees too


@pytest.mark.parametrize(
    "field, value",
    [
        ("packing", True),
        ("padding_free", True),
        ("eval_packing", True),
        ("loss_type", "dpo"),
        ("batch_unit", "samples"),
        ("train_sampling_strategy", "group_by_length"),
    ],
)
def test_settings_that_cannot_apply_to_trees_are_refused(field, value):
    with pytest.raises(ValueError, match=f"{field}={value!r}"):
        TreeSFTConfig(output_dir="unused", bf16=False, **{field: value})


def test_max_length_becomes_the_branch_limit():
    assert TreeSFTConfig(output_dir="unused", bf16=False, max_length=512).max_branch_tokens == 512
    assert (
        TreeSFTConfig(output_dir="unused", bf16=False, max_length=None, max_packed_tokens=256).max_branch_tokens is None
    )
    capped = TreeSFTConfig(
        output_dir="unused", bf16=False, max_length=8192, max_packed_tokens=1024, tree_execution="packed"
    )
    assert capped.max_branch_tokens == 1024
    for execution in ("auto", "depth_first"):  # a longer branch runs depth-first: TRL's limit as it is
        uncapped = TreeSFTConfig(
            output_dir="unused", bf16=False, max_length=8192, max_packed_tokens=1024, tree_execution=execution
        )
        assert uncapped.max_branch_tokens == 8192
    default = TreeSFTConfig(output_dir="unused", bf16=False, max_length=8192, max_packed_tokens=1024)
    assert default.tree_execution == "auto" and default.max_branch_tokens == 8192


def test_truncation_keeps_the_start_as_trl_does(tmp_path, tokenizer):
    """TRL cuts a row longer than ``max_length`` to its first ``max_length`` tokens (``truncation_mode="keep_start"``,
    its default); ``overlong="truncate"`` cuts the branch the same way (counted), and the update equals TRL's (its
    cross-entropy runs on float32 logits even in a float64 model: 1e-5), and it is TreeSFTConfig's default (TRL's
    rows train as TRL trains them); the untruncated update does not. Under ``overlong="error"`` the longer branch is
    refused by name, and ``"keep_end"`` at init."""
    dataset = prompt_completion_dataset()
    prompts = [len(rendered(tokenizer, row["prompt"], add_generation_prompt=True)) for row in dataset]
    fulls = [len(rendered(tokenizer, row["prompt"] + row["completion"])) for row in dataset]
    max_length = max(prompts) + 2  # every row keeps a trained token, some lose their end
    assert any(length > max_length for length in fulls)
    settings = dict(max_steps=1, learning_rate=0.5, per_device_train_batch_size=4, bf16=False, use_cpu=True)
    settings |= dict(train_sampling_strategy="sequential")
    with pytest.raises(ValueError, match="truncation_mode='keep_end' cannot apply"):
        TreeSFTConfig(**exact_sgd_args(str(tmp_path), truncation_mode="keep_end", max_length=max_length, **settings))

    def run(config, trainer, name, **options):
        args = config(**exact_sgd_args(str(tmp_path / name), **settings, **options))
        model = tiny_model(vocab_size=SMOLLM2_VOCAB, dtype=torch.float64, attn="sdpa")
        return trainer(model, args=args, train_dataset=dataset, processing_class=copy.deepcopy(tokenizer))

    per_row = dict(group_by=GROUP_BY_ROW)
    with pytest.raises(ValueError, match=f"more than max_branch_tokens={max_length}"):
        run(TreeSFTConfig, TreeSFTTrainer, "refused", max_length=max_length, overlong="error", **per_row).train()
    trl = run(SFTConfig, SFTTrainer, "trl", max_length=max_length)
    assert max(len(ids) for ids in trl.train_dataset["input_ids"]) == max_length
    tree = run(TreeSFTConfig, TreeSFTTrainer, "tree", max_length=max_length, **per_row)  # overlong="truncate" default
    assert tree.args.overlong == "truncate"
    stats = pop_packing_stats(next(iter(tree.get_train_dataloader())))
    assert stats.num_truncated_branches == sum(length > max_length for length in fulls)
    whole = run(TreeSFTConfig, TreeSFTTrainer, "whole", max_length=None, **per_row)
    trl_updates, tree_updates, whole_updates = (train_and_measure_updates(t) for t in (trl, tree, whole))
    assert tree.state.log_history[0]["loss"] == pytest.approx(trl.state.log_history[0]["loss"], rel=1e-5)
    assert max_grad_relative_error(tree_updates, trl_updates) <= 1e-5
    assert max_grad_relative_error(whole_updates, trl_updates) > 1e-3


# Every TreeSFTConfig field beyond TrainingArguments (plus label_smoothing_factor) on text rows (prompt/completion(s)
# and 'messages'): where it is honoured or refused (a test), or why it cannot change the objective.
TEXT_ROW_FIELDS = {
    "max_length": "honoured: the branch limit (test_max_length_becomes_the_branch_limit, test_truncation_keeps_...)",
    "truncation_mode": "'keep_start' = overlong='truncate', 'keep_end' refused (test_truncation_keeps_the_start_...)",
    "overlong": "honoured: test_truncation_keeps_the_start_as_trl_does; tests/test_packing.py",
    "max_branch_tokens": "honoured: tests/test_packing.py",
    "completion_only_loss": "honoured: test_completion_only_loss_false_trains_prompts_with_the_weight_of_...",
    "assistant_only_loss": "honoured: tests/test_sft_messages.py",
    "messages_branches": "honoured: tests/test_sft_messages.py",
    "train_on": "honoured: tests/test_sft_messages.py",
    "chat_template_path": "honoured: TRL loads it into the tokenizer before the trees are built (tests/test_launch.py)",
    "eos_token": "honoured: TRL sets it on the tokenizer before the trees are built (test_eos_token_ends_text_rows)",
    "loss_type": "honoured: test_dft_and_label_smoothing_losses_equal_per_branch, test_depth_first_steps_equal_trl",
    "label_smoothing_factor": "honoured: test_dft_and_label_smoothing_losses_equal_per_branch",
    "normalization": "honoured: tests/test_trainer.py",
    "router_aux_loss_coef": "honoured: tests/test_moe_router_loss.py",
    "packing": "refused: test_settings_that_cannot_apply_to_trees_are_refused",
    "padding_free": "refused: test_settings_that_cannot_apply_to_trees_are_refused",
    "eval_packing": "refused: test_settings_that_cannot_apply_to_trees_are_refused",
    "dataset_text_field": "refused: 'text' (language-modeling) rows match no tree format (ValueError listing them)",
    "packing_strategy": "packing=True is refused",
    "tree_execution": "exact either way: test_depth_first_execution_trains_the_same_objective",
    "max_packed_tokens": "row size; trees larger than a row run depth-first or split exactly",
    "group_by": "which rows share a tree across the dataset (logged): tests/test_same_rows_as_trl.py",
    "batch_unit": "which rows share a step (test_row_batches_*)",
    "shuffle_dataset": "order only",
    "dataset_kwargs": "skip_prepare_dataset=True takes tree rows as they are (test_tree_rows_pass_through_unchanged)",
    "dataset_num_proc": "speed",
    "model_init_kwargs": "how the model loads",
    "trust_remote_code": "how the model loads",
    "pad_to_multiple_of": "padding is never trained",
    "pad_token": "padding is never trained",
    "activation_offloading": "memory only",
    "context_parallel_strategy": "exact: tests/test_context_parallel.py",
    "context_parallel_chunks_per_rank": "exact: tests/test_context_parallel.py",
    "context_parallel_query_block_size": "exact: tests/test_context_parallel.py",
    "tree_self_check": "a check, not the objective",
    "merge_in_batch": "exact either way: tests/test_in_batch_merging.py (merged = TRL's step = unmerged)",
}


def test_every_text_row_field_is_classified():
    """A new field of TreeSFTConfig (or of TRL's SFTConfig) fails here until it is honoured or refused on text rows
    (or named inert, with the reason); tests/test_vision_sft_options.py does the same on image rows."""
    import dataclasses

    import transformers

    base = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    names = {f.name for f in dataclasses.fields(TreeSFTConfig)} - base | {"label_smoothing_factor"}
    assert names == set(TEXT_ROW_FIELDS), (
        f"unclassified: {names - set(TEXT_ROW_FIELDS)}; stale: {set(TEXT_ROW_FIELDS) - names}"
    )


def test_eos_token_ends_text_rows(tmp_path, tokenizer):
    """TRL's ``eos_token`` (another token than the tokenizer's) ends a plain-text completion's branch."""
    dataset = datasets.Dataset.from_dict({"prompt": ["The sky is"], "completion": [" blue."]})
    other = "<|im_start|>"
    assert other != tokenizer.eos_token
    args = TreeSFTConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to=[], eos_token=other)
    trainer = TreeSFTTrainer(
        tiny_model(vocab_size=SMOLLM2_VOCAB),
        args=args,
        train_dataset=dataset,
        processing_class=copy.deepcopy(tokenizer),
    )
    assert Tree.from_dict(trainer.train_dataset[0]).branch_tokens(0)[-1] == tokenizer.convert_tokens_to_ids(other)


def test_sft_config_is_refused_by_tree_trainer(tokenizer):
    with pytest.raises(ValueError, match="TreeSFTConfig"):
        TreeSFTTrainer(
            model=tiny_model(vocab_size=SMOLLM2_VOCAB),
            args=SFTConfig(output_dir="unused", bf16=False),
            train_dataset=prompt_completion_dataset(),
            processing_class=tokenizer,
        )


def test_tree_rows_pass_through_unchanged(tmp_path, tokenizer):
    from hf_tree.builders import build_tree_dataset

    trees = build_tree_dataset(prompt_completion_dataset(), tokenizer)
    trainer = trl_script(TreeSFTConfig, TreeSFTTrainer, tokenizer, trees, str(tmp_path))
    assert trainer.train_dataset.to_list() == trees.to_list()


# ------------------------------------------------------------------ TRL's other objectives, exact on trees
def per_branch_sft_loss(model, sequences, masks, loss_type: str, smoothing: float) -> torch.Tensor:
    """The oracle: each branch alone through ``model`` (sdpa), TRL's per-token DFT / label-smoothed loss, summed over
    trained tokens and divided by their count (``torch``'s label smoothing is transformers' ``LabelSmoother``)."""
    model.set_attn_implementation("sdpa")
    total, count = 0.0, 0
    for sequence, mask in zip(sequences, masks):
        ids = torch.tensor([sequence])
        logits = model(input_ids=ids).logits[0, :-1]
        trained = torch.tensor(mask[1:], dtype=torch.bool)
        targets = ids[0, 1:]
        if loss_type == "dft":
            log_p = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
            per_token = -log_p * log_p.detach().exp()
        else:
            per_token = F.cross_entropy(logits, targets, reduction="none", label_smoothing=smoothing)
        total, count = total + per_token[trained].sum(), count + int(trained.sum())
    model.set_attn_implementation("tree_flash")
    return total / count


@pytest.mark.parametrize("loss_type, smoothing", [("dft", 0.0), ("nll", 0.1)], ids=["dft", "label_smoothing"])
def test_dft_and_label_smoothing_losses_equal_per_branch(loss_type, smoothing):
    sequences = [[5, 6, 7, 8, 9], [5, 6, 7, 10], [5, 6, 11, 12, 13, 14], [5, 6, 7, 8, 9]]
    masks = [[0, 0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1]]
    batch = TreeDataCollator(max_packed_tokens=64)([Tree.from_sequences(sequences, masks).to_dict()])
    model = tiny_model()
    token_loss = sft_token_loss(loss_type, smoothing)
    with float64_norms():
        loss = tree_causal_lm_loss(model, batch, token_loss=token_loss, chunk_size=3)  # several chunks
        loss.backward()
        ours = grads_of(model)
        model.zero_grad()
        depth_first = depth_first_backward(
            model, [Tree.from_sequences(sequences, masks)], DepthFirstConfig(3), token_loss=token_loss
        )  # units of 3 tokens: the scored edges of one node in several units
        depth_first_grads = grads_of(model)
        model.zero_grad()
        expected = per_branch_sft_loss(model, sequences, masks, loss_type, smoothing)
        expected.backward()
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-12)
    assert max_grad_relative_error(ours, grads_of(model)) <= 1e-9
    assert float(depth_first) == pytest.approx(float(expected.detach()), rel=1e-12)
    assert max_grad_relative_error(depth_first_grads, grads_of(model)) <= 1e-9


def test_dft_ignores_label_smoothing_as_trl_does():
    assert sft_token_loss("dft", 0.1).keywords == {"dft": True, "label_smoothing": 0.0}
    assert sft_token_loss("nll", 0.0) is None


def test_completion_only_loss_false_trains_prompts_with_the_weight_of_their_branches():
    tree = Tree.from_sequences([[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 7]], [[0, 0, 0, 1], [0, 0, 0, 1, 1], [0, 1]])
    full = Tree.from_dict(train_every_token(tree.to_dict()))
    assert full.num_branches == 3 and full.num_tokens == tree.num_tokens
    for branch in range(3):
        assert full.branch_loss_mask(branch)[1:] == [1] * (len(full.branch_tokens(branch)) - 1)
    rows = full.to_dict()
    weights = {t: w for ts, ws in zip(rows["node_tokens"], rows["node_token_weights"]) for t, w in zip(ts, ws)}
    assert weights == {1: 0, 2: 2, 3: 2, 4: 1, 5: 1, 6: 1, 7: 1}  # a prompt token: one per branch containing it


# ------------------------------------------------------------------ batch semantics: rows, as TRL counts them
def test_row_batches_give_trls_steps_for_equal_groups():
    sizes = [4] * 5  # 20 rows, 5 prompts x 4 completions
    assert plan_row_batches(range(5), sizes, rows_per_batch=4, batches_per_step=1) == [
        [TreePart(t, 0, 4)] for t in range(5)
    ]
    halves = plan_row_batches(range(5), sizes, rows_per_batch=2, batches_per_step=2)  # batch 2, accumulation 2
    assert halves[:2] == [[TreePart(0, 0, 2)], [TreePart(0, 2, 4)]] and len(halves) == 10  # 5 steps, as TRL
    assert len(plan_row_batches(range(5), sizes, rows_per_batch=8, batches_per_step=1)) == 3  # ceil(20 / 8)


def test_row_batches_never_cut_a_group_across_steps():
    sizes = [3, 1, 6, 2, 2, 1]
    for rows_per_batch, per_step in [(1, 1), (2, 1), (3, 2), (4, 1), (2, 3)]:
        batches = plan_row_batches(range(len(sizes)), sizes, rows_per_batch, per_step)
        steps = [batches[i : i + per_step] for i in range(0, len(batches), per_step)]
        seen = [(p.tree, b) for batch in batches for p in batch for b in range(p.first, p.last)]
        assert seen == [(t, b) for t, n in enumerate(sizes) for b in range(n)]  # every branch once, in order
        owners = {}
        for index, step in enumerate(steps):
            for part in (p for batch in step for p in batch):
                assert owners.setdefault(part.tree, index) == index  # a tree lives in one step
        assert all(batches), "no empty micro-batch"
        assert all(len(step) == per_step for step in steps[:-1])


def test_short_last_step_keeps_groups_whole():
    """The epoch's last step holds fewer rows (3) than micro-batches (4): one micro-batch per tree, whole (it used
    to deal one row per micro-batch, cutting the group into single branches); with more ranks than trees, one run
    per rank."""
    sizes = [4, 4, 3]
    batches = plan_row_batches(range(3), sizes, rows_per_batch=1, batches_per_step=4)
    assert batches[:8] == [[TreePart(t, b, b + 1)] for t in (0, 1) for b in range(4)]  # full steps: as before
    assert batches[8:] == [[TreePart(2, 0, 3)]]
    assert plan_row_batches(range(4), [4, 4, 1, 2], 1, 4)[8:] == [[TreePart(2, 0, 1)], [TreePart(3, 0, 2)]]
    assert plan_row_batches(range(3), sizes, 1, 4, ranks=2)[8:] == [[TreePart(2, 0, 2)], [TreePart(2, 2, 3)]]


def test_short_last_step_trains_as_trl(tmp_path, tokenizer):
    """One epoch of 11 rows (groups of 4, 4 and 3 completions) at batch 1 and 4 accumulation steps: TRL's 3 steps,
    the last of 3 micro-batches; the tree trainer runs that step as one whole tree (dedup > 1) and moves the
    parameters as TRL does (float64; TRL's cross-entropy runs on float32 logits: 1e-5)."""
    rows = [
        {"prompt": f"Question {q}?", "completion": f" answer {a} to {q}."}
        for q, n in zip("ABC", (4, 4, 3))
        for a in range(n)
    ]
    settings = dict(num_train_epochs=1, learning_rate=0.5, per_device_train_batch_size=1, gradient_accumulation_steps=4)
    settings |= dict(train_sampling_strategy="sequential", bf16=False, use_cpu=True, max_length=None)
    runs = {}
    for name, (config, trainer) in {"trl": (SFTConfig, SFTTrainer), "tree": (TreeSFTConfig, TreeSFTTrainer)}.items():
        grouped = dict(group_by=GROUP_BY_PROMPT_TOKENS) if name == "tree" else {}  # each group one step, as TRL's
        args = config(**exact_sgd_args(str(tmp_path / name), **settings), **grouped)
        model = tiny_model(vocab_size=SMOLLM2_VOCAB, dtype=torch.float64, attn="sdpa")
        run = trainer(model, args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer)
        runs[name] = (run, train_and_measure_updates(run))
    (trl, trl_updates), (tree, tree_updates) = runs["trl"], runs["tree"]
    tree_logs = [h for h in tree.state.log_history if "loss" in h]
    assert trl.state.global_step == tree.state.global_step == 3
    assert len(tree.get_train_dataloader()) == 9 and tree_logs[-1]["dedup_ratio"] > 1  # the last step: one tree
    assert max_grad_relative_error(tree_updates, trl_updates) <= 1e-5


@pytest.mark.slow  # the fast parity row "sft 1 epoch, batch 4" checks the same through TRL's own script
def test_swapped_epoch_has_trls_optimizer_steps(tmp_path, tokenizer):
    rows = [{"prompt": f"Question {q}?", "completion": f" answer {a}."} for q in range(5) for a in range(4)]
    dataset = datasets.Dataset.from_list(rows)
    # 20 rows at batch 4: TRL's 5 steps; batch_unit="trees" (the explicit tree unit) over trees grouped by prompt (asked
    # for: one tree per row is the default): 4 trees (16 rows) per batch
    for cls, config, extra, steps in (
        (SFTTrainer, SFTConfig, {}, 5),
        (TreeSFTTrainer, TreeSFTConfig, {}, 5),
        (TreeSFTTrainer, TreeSFTConfig, {"batch_unit": "trees", "group_by": GROUP_BY_PROMPT_TOKENS}, 2),
    ):
        args = config(
            output_dir=str(tmp_path / cls.__name__),
            num_train_epochs=1,
            per_device_train_batch_size=4,
            report_to="none",
            bf16=False,
            save_strategy="no",
            **extra,
        )
        trainer = cls(
            model=tiny_model(vocab_size=SMOLLM2_VOCAB, dtype=torch.float32, attn="sdpa"),
            args=args,
            train_dataset=dataset,
            processing_class=copy.deepcopy(tokenizer),
        )
        assert len(trainer.get_train_dataloader()) == steps, (cls.__name__, extra)
