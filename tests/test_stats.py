"""``hf_tree.stats`` on hand-built datasets: every expected number is derived in the test from the input branches
(the set of their distinct prefixes is the trie), never hard-coded; packing plans are checked against the real
``TreeDataCollator``."""

from __future__ import annotations

import random

import pytest

from hf_tree import Tree, TreeDataCollator
from hf_tree.collator import pop_packing_stats
from hf_tree.packing import DEPTH_FIRST_KEY, PackingConfig, PackingStats
from hf_tree.row_batching import TreePartDataset, TreeRowBatchSampler
from hf_tree.stats import (
    ModelShape,
    TrainerBatching,
    compute_stats,
    format_report,
    plan_batches,
    plan_rows,
    text_histogram,
    trainer_batches,
)


def _random_groups(seed: int, num_trees: int) -> list[list[list[int]]]:
    """Per tree, branches that fork from random points of earlier branches (duplicates and prefixes included)."""
    rng = random.Random(seed)
    trees = []
    for _ in range(num_trees):
        branches = [[rng.randrange(1, 50) for _ in range(rng.randint(2, 12))]]
        for _ in range(rng.randint(0, 5)):
            base = rng.choice(branches)
            kind = rng.random()
            if kind < 0.15:
                branches.append(list(base))  # an identical branch
            elif kind < 0.3:
                branches.append(base[: rng.randint(2, len(base))])  # a prefix of another branch
            else:
                branches.append(
                    base[: rng.randint(0, len(base))] + [rng.randrange(1, 50) for _ in range(rng.randint(1, 8))]
                )
        trees.append(branches)
    return trees


def _prefixes(branches: list[list[int]]) -> set[tuple[int, ...]]:
    return {tuple(b[:k]) for b in branches for k in range(1, len(b) + 1)}


def _expected_fan_outs(branches: list[list[int]]) -> list[int]:
    """Children of every compressed-trie node with children: a node ends at a prefix with != 1 children or where a
    branch ends, and its children are that prefix's one-token extensions; several roots count as one fan-out."""
    prefixes = _prefixes(branches)
    ends = {tuple(b) for b in branches}
    children = {p: 0 for p in prefixes}
    for p in prefixes:
        if len(p) > 1:
            children[p[:-1]] += 1
    out = [c for p, c in children.items() if c > 0 and (c != 1 or p in ends)]
    roots = len({b[0] for b in branches})
    return out + [roots] if roots > 1 else out


@pytest.fixture(scope="module")
def dataset():
    groups = _random_groups(seed=3, num_trees=25)
    return groups, [Tree.from_sequences(g) for g in groups]


def test_counts_match_the_prefix_sets(dataset):
    groups, trees = dataset
    stats = compute_stats(trees)
    assert stats.num_trees == len(groups)
    assert stats.num_branches == sum(len(g) for g in groups)
    assert stats.num_branch_tokens == sum(len(b) for g in groups for b in g)
    assert stats.num_tree_tokens == sum(len(_prefixes(g)) for g in groups)
    assert stats.num_trained_tokens == sum(len(b) - 1 for g in groups for b in g)  # all but the first token
    assert stats.dedup_ratio == pytest.approx(stats.num_branch_tokens / stats.num_tree_tokens)
    assert sorted(stats.branch_lengths) == sorted(len(b) for g in groups for b in g)
    assert sorted(stats.fan_outs) == sorted(f for g in groups for f in _expected_fan_outs(g))
    assert stats.branches_per_tree == [len(g) for g in groups]


def test_flop_savings_follow_the_stated_formulas(dataset):
    groups, trees = dataset
    shape = ModelShape(num_layers=3, hidden_size=16, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2)
    stats = compute_stats(trees, model_shape=shape)
    # A branch of L tokens alone: L(L+1)/2 visible pairs; in the trie every token (prefix p) sees len(p) keys.
    branch_pairs = sum(len(b) * (len(b) + 1) // 2 for g in groups for b in g)
    tree_pairs = sum(len(p) for g in groups for p in _prefixes(g))
    assert (stats.num_branch_attention_pairs, stats.num_tree_attention_pairs) == (branch_pairs, tree_pairs)
    assert stats.linear_flop_saving == pytest.approx(1 - stats.num_tree_tokens / stats.num_branch_tokens)
    assert stats.attention_flop_saving == pytest.approx(1 - tree_pairs / branch_pairs)
    head_dim = 16 // 4
    params = 3 * (16 * 16 * 2 + 2 * 16 * head_dim * 2 + 3 * 16 * 40)  # q, o; k, v; gate, up, down
    flops = lambda tokens, pairs: 6 * params * tokens + 12 * 3 * 16 * pairs  # noqa: E731
    expected = 1 - flops(stats.num_tree_tokens, tree_pairs) / flops(stats.num_branch_tokens, branch_pairs)
    assert stats.total_flop_saving == pytest.approx(expected)


@pytest.mark.parametrize("overlong", ["drop", "truncate"])
@pytest.mark.parametrize(("trees_per_batch", "pad_to_multiple_of"), [(None, None), (7, None), (7, 5)])
def test_packing_plan_equals_the_collators_packing(dataset, overlong, trees_per_batch, pad_to_multiple_of):
    """``hf-tree stats``'s plan is what the real collator packs on the same trees: the same rows (tokens, in layout
    order), the same splits and drops, and the same padding (row length included)."""
    groups, trees = dataset
    packing = PackingConfig(16, max_branch_tokens=10, overlong=overlong, pad_to_multiple_of=pad_to_multiple_of)
    plan = plan_rows(trees, packing, trees_per_batch=trees_per_batch)
    collator = TreeDataCollator(packing=packing)
    step = trees_per_batch or len(trees)
    collated_rows, collated = [], PackingStats()
    for start, planned in zip(range(0, len(trees), step), plan.batches, strict=True):
        batch = collator([t.to_dict() for t in trees[start : start + step]])
        assert batch["input_ids"].shape[1] == planned.row_length  # same padding per batch
        collated.add(pop_packing_stats(batch))
        collated_rows += batch["input_ids"].tolist()
    planned_rows = [[t for part in row for t in part.input_ids.tolist()] for row in plan.rows]
    assert len(planned_rows) == len(collated_rows)
    for planned, collated_row in zip(planned_rows, collated_rows):  # the test's tokens are >= 1, padding is 0
        assert collated_row[: len(planned)] == planned and not any(collated_row[len(planned) :])
    assert plan.stats == collated
    assert compute_stats(trees, packing, trees_per_batch=trees_per_batch).packing == collated
    if pad_to_multiple_of:
        assert all(p.row_length % pad_to_multiple_of == 0 for p in plan.batches)
    overlong_branches = sum(len(b) > 10 for g in groups for b in g)
    counted = plan.stats.num_dropped_branches if overlong == "drop" else plan.stats.num_truncated_branches
    assert counted == overlong_branches > 0 and plan.stats.num_split_trees > 0
    assert all(sum(p.num_tokens for p in row) <= 16 for row in plan.rows)


@pytest.mark.parametrize("shuffle", [True, False])
def test_trainer_batches_are_the_samplers(dataset, shuffle):
    """``hf-tree stats``'s default plan: the micro-batches ``TreeSFTTrainer``'s sampler deals (trees cut between
    micro-batches included), each merged and packed as the collator packs it; per-step dedup = the steps' sums."""
    _, trees = dataset
    batching = TrainerBatching(per_device_train_batch_size=3, gradient_accumulation_steps=2, shuffle=shuffle, seed=7)
    sampler = TreeRowBatchSampler([t.num_branches for t in trees], 3, 2, shuffle=shuffle, seed=7)
    parts = TreePartDataset([t.to_dict() for t in trees])
    packing = PackingConfig(24)
    collator = TreeDataCollator(packing=packing)
    collated = [pop_packing_stats(collator([parts[p] for p in batch])) for batch in sampler.batches()]
    batches = trainer_batches(trees, batching)
    assert any(t not in trees for batch in batches for t in batch)  # some trees were cut between micro-batches
    plan = plan_batches(batches, packing)
    assert [p.stats for p in plan.batches] == collated
    stats = compute_stats(trees, packing, batching=batching)
    steps: list[PackingStats] = []
    for k, batch_stats in enumerate(collated):  # 2 micro-batches per optimizer step
        if k % 2 == 0:
            steps.append(PackingStats())
        steps[-1].add(batch_stats)
    assert stats.step_dedup_ratios == [s.dedup_ratio for s in steps]
    total = PackingStats()
    for batch_stats in collated:
        total.add(batch_stats)
    assert stats.training_dedup_ratio == total.dedup_ratio  # cut and split trees lose some of the trees' sharing
    with pytest.raises(ValueError, match="pass batching .* or trees_per_batch, not both"):
        compute_stats(trees, packing, batching=batching, trees_per_batch=4)


@pytest.mark.parametrize("tree_execution", ["auto", "depth_first"])
def test_stats_count_forwarded_rows_only(dataset, tree_execution):
    """With depth-first trees, a batch whose trees all run depth-first carries a 1-token placeholder row that the
    trainer never forwards (tests/test_trainer.py: its logged ``rows_per_step`` is 0 then): the stats leave it and
    its padding out, as the collated batches read with the trainer's rule say, and the rows' fill stays <= 100%."""
    _, trees = dataset
    # each tree as it is (merge_in_batch=False): the depth-first count below is of the input trees
    packing = PackingConfig(12, max_branch_tokens=40, tree_execution=tree_execution, merge_in_batch=False)
    collator = TreeDataCollator(packing=packing)
    forwarded, row_tokens = PackingStats(), 0
    for start in range(0, len(trees), 3):
        batch = collator([t.to_dict() for t in trees[start : start + 3]])
        counted = pop_packing_stats(batch)
        if batch.get(DEPTH_FIRST_KEY) and not len(batch["loss_positions"]):  # TreeTrainer._rows_run
            counted.num_rows = counted.num_padding_tokens = 0
        else:
            row_tokens += int((batch["input_ids"] != 0).sum())  # the test's tokens are >= 1, padding is 0
        forwarded.add(counted)
    stats = compute_stats(trees, packing, trees_per_batch=3)
    assert stats.packing == forwarded
    assert stats.num_row_tokens == row_tokens
    assert stats.num_depth_first_trees == sum(t.num_tokens > 12 or tree_execution == "depth_first" for t in trees)
    assert 0.0 <= stats.row_fill <= 1.0
    if tree_execution == "depth_first":  # nothing is packed: no row, no padding, no fill
        assert (stats.packing.num_rows, stats.packing.num_padding_tokens, stats.row_fill) == (0, 0, 0.0)
    else:
        assert stats.packing.num_rows > 0 and stats.row_fill == pytest.approx(row_tokens / (12 * forwarded.num_rows))
    assert f"fill {stats.row_fill:.1%}" in format_report(stats)


def test_report_and_histograms_show_the_numbers(dataset):
    _, trees = dataset
    packing = PackingConfig(24, max_branch_tokens=10, overlong="drop")
    stats = compute_stats(trees, packing, dropped={"rows dropped": {"empty": 2}})
    report = format_report(stats)
    expected = [
        f"trees                  {stats.num_trees}",
        f"dedup ratio            {stats.dedup_ratio:.3f}",
        f"branches dropped     {stats.packing.num_dropped_branches}",
        "rows dropped           2 {'empty': 2}",
    ]
    for text in expected:
        assert text in report
    histogram = text_histogram(stats.branch_lengths)
    assert sum(int(line.split()[-2] if line.split()[-1].startswith("#") else line.split()[-1])
               for line in histogram.splitlines()) == len(stats.branch_lengths)  # fmt: skip
    assert stats.to_dict()["packing"]["num_rows"] == stats.packing.num_rows


def test_bad_options_are_rejected(dataset):
    _, trees = dataset
    with pytest.raises(ValueError, match=r"trees_per_batch=0 must be a positive integer"):
        plan_rows(trees, 24, trees_per_batch=0)
    with pytest.raises(ValueError, match=r"max_branch_tokens=30 must be an integer in \[2, max_packed_tokens=24\]"):
        plan_rows(trees, 24, max_branch_tokens=30)
    with pytest.raises(ValueError, match=r"tree \d+: branch \d+ has \d+ tokens, more than max_branch_tokens=10"):
        plan_rows(trees, 24, max_branch_tokens=10, overlong="error")
