"""TreeTrainer against the oracle: transformers.Trainer on the unrolled branches, float64 tiny models.

Each dataset row is one group of branches: TreeTrainer sees it as one tree, the reference Trainer as the
branches padded into a flat batch. Both use the same sampler seed and batch sizes, so each optimizer step
sees the same branches. SGD keeps any error in the gradient visible (Adam would normalise it away); both
clip at Trainer's default 1.0, each by its own gradient norm (``exact_sgd_args``).
"""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_tree import Tree, TreeDataCollator
from hf_tree.trainer import STEP_SUM_KEYS, TreeTrainer, TreeTrainingArguments, use_tree_attention
from hf_tree.training_arguments import CHECKPOINTING
from tests.helpers import (
    VOCAB,
    branch_loss_func,
    collate_branches,
    common_args,
    float64_norms,
    float64_qwen3_5_norms,
    hybrid_model,
    per_branch_loss,
    relative_error,
    tiny_model,
)
from tests.workloads import BRANCHES_PER_TREE, NUM_TREES, branch_dataset, branch_groups, tree_dataset

TOLERANCE = 1e-8


def train_tree(tmp_path, groups, normalization, batch_size, accumulation, max_packed_tokens=24, **overrides):
    """TreeTrainer; trees over ``max_packed_tokens`` are split (``"packed"``) unless ``overrides`` say otherwise."""
    model = tiny_model(vocab_size=VOCAB)
    overrides = {"tree_execution": "packed", **overrides}
    args = TreeTrainingArguments(
        **common_args(
            tmp_path, f"tree-{normalization}-{batch_size}-{accumulation}", batch_size, accumulation, **overrides
        ),
        max_packed_tokens=max_packed_tokens,
        normalization=normalization,
    )
    trainer = TreeTrainer(model=model, args=args, train_dataset=tree_dataset(groups))
    trainer.train()
    return model, trainer


def train_reference(tmp_path, groups, normalization, batch_size, accumulation):
    model = tiny_model(vocab_size=VOCAB, attn="sdpa")
    args = TrainingArguments(
        **common_args(tmp_path, f"ref-{normalization}", batch_size, accumulation), remove_unused_columns=False
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=branch_dataset(groups),
        data_collator=collate_branches,
        compute_loss_func=branch_loss_func(normalization, BRANCHES_PER_TREE * batch_size * accumulation),
    )
    trainer.train()
    return model, trainer


def max_param_relative_error(model, reference) -> float:
    ref = dict(reference.named_parameters())
    return max(relative_error(p, ref[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("normalization", ["token", pytest.param("sequence", marks=pytest.mark.slow)])
def test_three_sgd_steps_match_trainer_on_branches(tmp_path, normalization):
    groups = branch_groups()
    initial = tiny_model(vocab_size=VOCAB)
    with float64_norms():
        reference, ref_trainer = train_reference(tmp_path, groups, normalization, batch_size=2, accumulation=1)
        one_batch, tree_trainer = train_tree(tmp_path, groups, normalization, batch_size=2, accumulation=1)
        accumulated, _ = train_tree(tmp_path, groups, normalization, batch_size=1, accumulation=2)
    # the parameters moved well beyond the tolerance, so a wrong divisor or data order cannot pass
    assert max_param_relative_error(reference, initial) > 1e-3
    assert max_param_relative_error(one_batch, reference) <= TOLERANCE
    assert max_param_relative_error(accumulated, reference) <= TOLERANCE
    # the logged per-step losses agree too
    ref_losses = [h["loss"] for h in ref_trainer.state.log_history if "loss" in h]
    tree_losses = [h["loss"] for h in tree_trainer.state.log_history if "loss" in h]
    assert tree_losses == pytest.approx(ref_losses, rel=1e-9)


def test_depth_first_execution_matches_packed_and_trainer_on_branches(tmp_path):
    """Trees over 12 tokens run depth-first ("auto"; all with "depth_first") in units of at most 12 tokens, branches
    up to 21 tokens included: pieces of the prompts, completions over their cache, beside packed rows in the same
    micro-batch; 2 accumulated micro-batches share one divisor. Three SGD steps equal the packed TreeTrainer (rows of
    24, trees split) and Trainer on the branches."""
    groups = branch_groups()
    with float64_norms():
        reference, _ = train_reference(tmp_path, groups, "token", batch_size=2, accumulation=2)
        packed, packed_trainer = train_tree(tmp_path / "p", groups, "token", 2, 2)
        runs = {
            execution: train_tree(
                tmp_path / execution, groups, "token", 2, 2, 12, max_branch_tokens=24, tree_execution=execution
            )
            for execution in ("auto", "depth_first")
        }
    packed_losses = [h["loss"] for h in packed_trainer.state.log_history if "loss" in h]
    for depth_first, trainer in runs.values():
        batch = trainer.data_collator(tree_dataset(groups).to_list())
        assert len(batch["depth_first_trees"]) > 0  # the setting exercises depth-first execution
        assert max_param_relative_error(depth_first, packed) <= TOLERANCE
        assert max_param_relative_error(depth_first, reference) <= TOLERANCE
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        assert losses == pytest.approx(packed_losses, rel=1e-9)
    auto_batch = runs["auto"][1].data_collator(tree_dataset(groups).to_list())
    assert len(auto_batch["loss_positions"]) > 0  # "auto" packs the trees that fit a row beside them
    # Packing stats count forwarded rows only: with every tree depth-first, the batches' placeholder row never runs
    logs = {execution: [h for h in t.state.log_history if "loss" in h] for execution, (_, t) in runs.items()}
    assert all(h["rows_per_step"] == 0 and h["padding_fraction"] == 0 for h in logs["depth_first"])
    assert any(h["rows_per_step"] > 0 for h in logs["auto"])  # (its first step also ran depth-first only)


@pytest.mark.slow
def test_depth_first_trains_a_recurrent_hybrid_as_packed(tmp_path):
    """Qwen3.5 (GatedDeltaNet, its states carried between units; tests/test_depth_first.py checks them against the
    branches): three SGD steps with every tree depth-first in units of 12 tokens equal the packed TreeTrainer (rows
    of 24, trees split)."""
    groups, models = branch_groups(), {}
    for execution, max_packed_tokens in (("packed", 24), ("depth_first", 12)):
        models[execution] = hybrid_model("qwen3_5_text")
        args = TreeTrainingArguments(
            **common_args(tmp_path, execution, 2, 1),
            max_packed_tokens=max_packed_tokens,
            max_branch_tokens=24,
            tree_execution=execution,
        )
        with float64_qwen3_5_norms():  # float32 norms would round each run differently (~1e-7)
            TreeTrainer(model=models[execution], args=args, train_dataset=tree_dataset(groups)).train()
    assert max_param_relative_error(models["packed"], hybrid_model("qwen3_5_text")) > 1e-3
    assert max_param_relative_error(models["depth_first"], models["packed"]) <= TOLERANCE


def test_trees_are_split_across_rows_in_the_equivalence_setting():
    """max_packed_tokens=24 in the equivalence test forces splitting of the larger trees and several rows."""
    args = TreeTrainingArguments(
        output_dir="unused", max_packed_tokens=24, use_cpu=True, report_to=[], tree_execution="packed"
    )
    batch = args.make_tree_collator()(tree_dataset(branch_groups()).to_list())
    assert int(batch["num_split_trees"]) > 0 and batch["input_ids"].shape[0] > 1


class RecordLogs(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def test_logs_packing_metrics_through_callbacks(tmp_path):
    groups = branch_groups()
    recorder = RecordLogs()
    model = tiny_model(vocab_size=VOCAB, dtype=torch.float32)
    args = TreeTrainingArguments(**common_args(tmp_path, "logs", 4, 1), max_packed_tokens=64)
    trainer = TreeTrainer(model=model, args=args, train_dataset=tree_dataset(groups), callbacks=[recorder])
    trainer.train()
    train_logs = [log for log in recorder.logs if "loss" in log]
    assert len(train_logs) == 3
    for log in train_logs:
        assert log["trees_per_step"] == 4
        assert log["rows_per_step"] >= 1
        assert log["dedup_ratio"] > 1.0  # every group shares its prompt
        assert 0.0 <= log["padding_fraction"] < 1.0
        assert log["branch_tokens_per_second"] == pytest.approx(log["tree_tokens_per_second"] * log["dedup_ratio"])
    # whole-run dedup equals the trees' own figure on the same 12 trees (3 steps x 4 trees, one epoch)
    trees = [Tree.from_sequences(s, m) for s, m in groups]
    expected = sum(t.num_branch_tokens for t in trees) / sum(t.num_tokens for t in trees)
    totals = dict(zip(STEP_SUM_KEYS, trainer._tree_total_sums.tolist()))
    assert totals["num_branch_tokens"] / totals["num_tree_tokens"] == pytest.approx(expected)
    assert totals["num_trees"] == NUM_TREES


@pytest.mark.parametrize(
    "execution",
    [{}, {"tree_execution": "auto", "max_packed_tokens": 12, "max_branch_tokens": 32}],
    ids=["packed", "auto"],
)
def test_eval_loss_is_the_tree_loss_over_the_whole_set(tmp_path, execution):
    groups = branch_groups(seed=3, num_trees=5)
    with float64_norms():
        model = tiny_model(vocab_size=VOCAB)
        args = TreeTrainingArguments(
            **common_args(tmp_path, "eval", 2, 1),
            per_device_eval_batch_size=2,
            **{"max_packed_tokens": 32, **execution},
            normalization="sequence",
        )
        trainer = TreeTrainer(
            model=model, args=args, train_dataset=tree_dataset(groups), eval_dataset=tree_dataset(groups)
        )
        metrics = trainer.evaluate()
        sequences = [s for seqs, _ in groups for s in seqs]
        masks = [m for _, ms in groups for m in ms]
        with torch.no_grad():
            total, divisor = per_branch_loss(model, sequences, masks, "sequence")
    assert metrics["eval_loss"] == pytest.approx(float(total / divisor), rel=1e-9)


def test_gradient_checkpointing_gives_the_same_update(tmp_path):
    groups = branch_groups()
    with float64_norms():
        plain, _ = train_tree(tmp_path / "a", groups, "token", batch_size=2, accumulation=1)
        checkpointed, _ = train_tree(
            tmp_path / "b", groups, "token", batch_size=2, accumulation=1, **{CHECKPOINTING: True}
        )
    assert max_param_relative_error(checkpointed, plain) <= TOLERANCE


def test_resume_from_checkpoint_continues_the_same_run(tmp_path):
    groups = branch_groups()
    overrides = dict(save_strategy="steps", save_steps=2, max_steps=4)
    full, _ = train_tree(tmp_path / "full", groups, "token", 2, 1, **overrides)
    model = tiny_model(vocab_size=VOCAB)
    args = TreeTrainingArguments(  # the same settings as train_tree's run (which splits its larger trees)
        **common_args(tmp_path / "full", "tree-token-2-1", 2, 1, **overrides),
        max_packed_tokens=24,
        tree_execution="packed",
    )
    resumed = TreeTrainer(model=model, args=args, train_dataset=tree_dataset(groups))
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "tree-token-2-1" / "checkpoint-2"))
    assert resumed.state.global_step == 4
    assert max_param_relative_error(model, full) <= 1e-12


@pytest.mark.slow
def test_bf16_autocast_update_error_is_no_worse_than_plain_trainer(tmp_path):
    """One SGD step under bf16 autocast vs float32: the tree trainer's update error is at most 2x the reference's."""
    groups = branch_groups()
    initial = {n: p.detach().clone() for n, p in tiny_model(vocab_size=VOCAB, dtype=torch.float32).named_parameters()}

    def update(tree: bool, bf16: bool) -> torch.Tensor:
        args = common_args(tmp_path, f"{'tree' if tree else 'ref'}-{bf16}", 4, 1, bf16=bf16, max_steps=1)
        model = tiny_model(vocab_size=VOCAB, dtype=torch.float32, attn="tree_flash" if tree else "sdpa")
        if tree:
            trainer = TreeTrainer(
                model=model,
                args=TreeTrainingArguments(**args, max_packed_tokens=64),
                train_dataset=tree_dataset(groups),
            )
        else:
            trainer = Trainer(
                model=model,
                args=TrainingArguments(**args, remove_unused_columns=False),
                train_dataset=branch_dataset(groups),
                data_collator=collate_branches,
                compute_loss_func=branch_loss_func("token", 0),
            )
        trainer.train()
        return torch.cat([(p.detach() - initial[n]).flatten() for n, p in model.named_parameters()])

    ref32, tree32 = update(False, False), update(True, False)
    assert relative_error(tree32, ref32) <= 1e-5
    ref_error = relative_error(update(False, True), ref32)
    tree_error = relative_error(update(True, True), ref32)
    assert 0 < ref_error < 0.1  # autocast really ran in bf16
    assert tree_error <= 2 * ref_error


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("max_packed_tokens", 1, "max_packed_tokens=1"),
        ("max_branch_tokens", 1, "max_branch_tokens=1"),
        ("overlong", "cut", "overlong='cut'"),
        ("normalization", "mean", "normalization='mean'"),
        ("pad_to_multiple_of", 0, "pad_to_multiple_of=0"),
        ("tree_execution", "dfs", "tree_execution='dfs'"),
        ("remove_unused_columns", True, "remove_unused_columns=True"),
        ("context_parallel_strategy", "ring", "context_parallel_strategy='ring'"),
        ("context_parallel_chunks_per_rank", 0, "context_parallel_chunks_per_rank=0"),
        ("context_parallel_query_block_size", -2, "context_parallel_query_block_size=-2"),
    ],
)
def test_arguments_validation_names_the_field(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        TreeTrainingArguments(output_dir="unused", use_cpu=True, **{"max_packed_tokens": 64, field: value})


def test_context_parallel_fields_come_from_context_parallel_config():
    """``context_parallel_<name>`` flags carry ``ContextParallelConfig.<name>``'s default, help and choices, and
    ``context_parallel_config()`` builds the config the trainer hands to ``TreeContextParallel``."""
    from transformers import HfArgumentParser

    from hf_tree.config import CONTEXT_PARALLEL_FIELDS
    from hf_tree.parallel import STRATEGIES, ContextParallelConfig

    flags = {a.dest: a for a in HfArgumentParser(TreeTrainingArguments)._actions}
    for name in CONTEXT_PARALLEL_FIELDS:
        spec = ContextParallelConfig.__dataclass_fields__[name]
        flag = flags[f"context_parallel_{name}"]
        assert (flag.default, flag.help) == (spec.default, spec.metadata["help"]), name
    assert tuple(flags["context_parallel_strategy"].choices) == STRATEGIES
    (args,) = HfArgumentParser(TreeTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "unused", "--use_cpu", "--context_parallel_strategy", "contiguous"]
        + ["--context_parallel_chunks_per_rank", "3"]
    )
    assert args.context_parallel_config(pad_token_id=7) == ContextParallelConfig(
        strategy="contiguous", chunks_per_rank=3, pad_token_id=7
    )


def test_plain_training_arguments_with_a_tree_collator_train_as_branches(tmp_path):
    """The docstring's other way in: plain ``TrainingArguments`` (remove_unused_columns=False) and a
    ``TreeDataCollator``. It trained nothing before issue 25 (AttributeError: no ``tree_self_check``)."""
    groups, eval_groups = branch_groups(), branch_groups(seed=3, num_trees=4)
    with float64_norms():
        reference, ref_trainer = train_reference(tmp_path, groups, "token", batch_size=1, accumulation=2)
        ref_eval = ref_trainer.evaluate(branch_dataset(eval_groups))
        model = tiny_model(vocab_size=VOCAB)
        trainer = TreeTrainer(
            model=model,
            args=TrainingArguments(
                **common_args(tmp_path, "plain", 1, 2, per_device_eval_batch_size=4), remove_unused_columns=False
            ),
            data_collator=TreeDataCollator(max_packed_tokens=24),
            train_dataset=tree_dataset(groups),
        )
        trainer.train()
        tree_eval = trainer.evaluate(tree_dataset(eval_groups))
    assert max_param_relative_error(model, reference) <= TOLERANCE
    ref_losses = [h["loss"] for h in ref_trainer.state.log_history if "loss" in h]
    assert [h["loss"] for h in trainer.state.log_history if "loss" in h] == pytest.approx(ref_losses, rel=1e-9)
    assert tree_eval["eval_loss"] == pytest.approx(ref_eval["eval_loss"], rel=1e-9)


def test_plain_training_arguments_are_refused():
    with pytest.raises(ValueError, match="TreeTrainingArguments"):
        TreeTrainer(
            model=tiny_model(vocab_size=VOCAB),
            args=TrainingArguments(output_dir="unused", use_cpu=True),
            train_dataset=tree_dataset(branch_groups(num_trees=2)),
        )


def test_model_is_switched_to_tree_attention(tmp_path):
    model = tiny_model(vocab_size=VOCAB, attn="sdpa")
    TreeTrainer(
        model=model,
        args=TreeTrainingArguments(**common_args(tmp_path, "switch", 2, 1)),
        train_dataset=tree_dataset(branch_groups(num_trees=2)),
    )
    assert model.config._attn_implementation == "tree_flash"


@pytest.mark.parametrize("mode", ["non_padding", "all"])
def test_depth_first_trees_count_in_num_input_tokens_seen(tmp_path, mode):
    """One epoch in order with trees over 12 tokens run depth-first ("auto"): "non_padding" counts every branch token
    (Trainer's attention_mask sum on the branches), "all" the tokens forwarded: packed rows with their padding plus
    each depth-first tree's tokens once (no placeholder row of an all-depth-first batch)."""
    groups = branch_groups(num_trees=6)
    settings = dict(max_steps=-1, num_train_epochs=1, train_sampling_strategy="sequential")
    _, trainer = train_tree(
        tmp_path, groups, "token", 2, 1, 12, max_branch_tokens=24, tree_execution="auto",
        include_num_input_tokens_seen=mode, **settings,
    )  # fmt: skip
    if mode == "non_padding":
        expected = sum(len(seq) for sequences, _ in groups for seq in sequences)
    else:
        rows = tree_dataset(groups).to_list()
        batches = [trainer.data_collator(rows[i : i + 2]) for i in range(0, len(rows), 2)]
        assert sum(len(b.get("depth_first_trees", ())) for b in batches) > 0
        assert any(len(b["loss_positions"]) == 0 for b in batches)  # an all-depth-first batch: placeholder row
        forwarded_rows = sum(b["input_ids"].numel() for b in batches if len(b["loss_positions"]))
        expected = forwarded_rows + sum(t.num_tokens for b in batches for t in b.get("depth_first_trees", ()))
    assert trainer.state.num_input_tokens_seen == expected


def test_no_attention_switch_message_for_a_model_without_attention(caplog):
    """RWKV has no attention layer: switching it to tree_flash says nothing about attention, only why it is refused
    (its mixer); a Llama on sdpa gets the one line."""
    for family, expected in (("rwkv", 0), ("llama", 1)):
        caplog.clear()
        model = tiny_model(family, dtype=torch.float32, attn="eager") if family == "rwkv" else tiny_model(attn="sdpa")
        with caplog.at_level("WARNING", logger="hf_tree"):
            if family == "rwkv":
                with pytest.raises(ValueError, match="RwkvSelfAttention"):
                    use_tree_attention(model)
            else:
                use_tree_attention(model)
        assert sum("switched model from" in r.getMessage() for r in caplog.records) == expected
