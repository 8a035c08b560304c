"""``hf-tree`` subcommands end to end (in-process): ``stats`` (report, JSON, PNG), ``show`` (PNG), ``demo``.

Expected numbers come from the input trees themselves (branch lengths, branch counts), not from constants.
"""

from __future__ import annotations

import json

import datasets
import pytest

from hf_tree import Tree
from hf_tree.builders import TREE_FEATURES
from hf_tree.cli import main
from hf_tree.stats import plan_rows

GROUPS = [
    [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 3, 6, 7, 8]],
    [[9, 10, 11], [9, 12]],
    [[13, 14, 15, 16, 17, 18, 19], [13, 14, 15, 20, 21, 22, 23], [13, 14, 24]],
]


@pytest.fixture
def saved_trees(tmp_path):
    trees = [Tree.from_sequences(g) for g in GROUPS]
    folder = tmp_path / "trees"
    datasets.Dataset.from_list([t.to_dict() for t in trees], features=datasets.Features(TREE_FEATURES)).save_to_disk(
        str(folder)
    )
    return str(folder), trees


def _png_shape(path) -> tuple[int, ...]:
    image = pytest.importorskip("matplotlib.image")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    return image.imread(str(path)).shape


def test_stats_json_counts_the_input(saved_trees, capsys):
    folder, trees = saved_trees
    main(["stats", folder, "--json", "--max-packed-tokens", "12"])
    out = json.loads(capsys.readouterr().out)
    assert out["num_trees"] == len(GROUPS)
    assert out["num_branches"] == sum(len(g) for g in GROUPS)
    assert out["num_branch_tokens"] == sum(len(b) for g in GROUPS for b in g)
    assert out["num_tree_tokens"] == sum(t.num_tokens for t in trees)
    assert out["packing"]["num_rows"] == len(plan_rows(trees, 12, overlong="drop").rows)


def test_stats_report_and_plot(saved_trees, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    folder, _ = saved_trees
    png = tmp_path / "stats.png"
    main(["stats", folder, "--max-packed-tokens", "12", "--plot", str(png)])
    report = capsys.readouterr().out
    assert f"branches               {sum(len(g) for g in GROUPS)}" in report
    assert "fan-out histogram" in report and "packing at max_packed_tokens=12" in report
    height, width, _ = _png_shape(png)
    assert height > 300 and width > 500
    assert png.stat().st_size < 200_000


def test_show_draws_a_packed_row(saved_trees, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    folder, trees = saved_trees
    png = tmp_path / "row.png"
    main(["show", folder, "--max-packed-tokens", "12", "--index", "-1", "--out", str(png), "--window", "1:"])
    printed = capsys.readouterr().out
    last_row = plan_rows(trees, 12, overlong="drop").rows[-1]
    assert printed.count("tree part") == len(last_row)
    height, width, _ = _png_shape(png)
    assert height > 300 and width > 300
    with pytest.raises(SystemExit, match=r"--index 99 is out of range: DATA packs into \d+ rows"):
        main(["show", folder, "--max-packed-tokens", "12", "--index", "99", "--out", str(png)])


def test_stats_tokenizes_a_user_file_with_the_default_tokenizer(tmp_path, capsys):
    from hf_tree.assets import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except FileNotFoundError as error:
        pytest.skip(f"offline SmolLM2 asset missing (CI installs it): {error}")
    records = [{"prompt": "Say a number:", "completions": [" one", " two", " three"]}]
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(records[0]) + "\n")
    main(["stats", str(path), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert (out["num_trees"], out["num_branches"]) == (1, len(records[0]["completions"]))
    assert out["dedup_ratio"] > 1.0


def test_missing_data_is_explained(tmp_path):
    expected = r"^hf-tree stats: data .* does not exist \(no such file or folder: .*\); pass a saved tree dataset"
    with pytest.raises(SystemExit, match=expected):
        main(["stats", str(tmp_path / "nothing.jsonl")])


def test_stats_stops_where_training_would(saved_trees, capsys):
    """overlong='error' stops `hf-tree stats` (exit status 1, one line) at a branch longer than the branch limit, as
    it would stop training; --overlong drop counts the drops instead, and the default (hf-tree sft's "truncate")
    counts the truncations."""
    folder, _ = saved_trees
    limit = ["--max-packed-tokens", "6", "--max-branch-tokens", "6"]
    with pytest.raises(SystemExit, match=r"^hf-tree stats: training with these packing settings would stop: .*"):
        main(["stats", folder, *limit, "--overlong", "error"])
    main(["stats", folder, *limit, "--overlong", "drop", "--json"])
    assert json.loads(capsys.readouterr().out)["packing"]["num_dropped_branches"] == 2  # the 2 branches over 6
    main(["stats", folder, *limit, "--json"])
    assert json.loads(capsys.readouterr().out)["packing"]["num_truncated_branches"] == 2


def test_demo_still_runs(capsys):
    main(["demo", "--prompt-tokens", "16", "--completion-tokens", "16", "--turns", "3", "--max-packed-tokens", "512"])
    assert "dedup ratio" in capsys.readouterr().out


def test_stats_reads_what_dataset_name_reads(tmp_path, capsys):
    """A folder of .jsonl files, a hub-style folder (data/train-*.parquet) and the single file give the same trees,
    with the trainers' underscore flags (--max_packed_tokens, --dataset_name) as well as the dashed ones."""
    from hf_tree.assets import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except FileNotFoundError as error:
        pytest.skip(f"offline SmolLM2 asset missing (CI installs it): {error}")
    records = [{"prompt": "Say a number:", "completion": f" {n}"} for n in ("one", "two", "three")]
    flat, hub = tmp_path / "flat", tmp_path / "hub" / "data"
    flat.mkdir()
    hub.mkdir(parents=True)
    (flat / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    datasets.Dataset.from_list(records).to_parquet(str(hub / "train-00000-of-00001.parquet"))
    reports = []
    for argv in (
        [str(flat / "train.jsonl"), "--max-packed-tokens", "64"],
        [str(flat), "--max_packed_tokens", "64"],
        ["--dataset_name", str(tmp_path / "hub"), "--max_packed_tokens", "64", "--per_device_train_batch_size", "8"],
    ):
        main(["stats", *argv, "--json"])
        reports.append(json.loads(capsys.readouterr().out))
    assert reports[0]["num_branches"] == len(records)
    assert reports[0] == reports[1] == reports[2]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match=r"^hf-tree stats: data .*empty' is a folder with no data files"):
        main(["stats", str(empty)])


def test_stats_defaults_are_hf_tree_sfts():
    """`hf-tree stats` plans what `hf-tree sft` does with its defaults: it has none of its own, the fields it is not
    given are TreeSFTConfig's (packing, batching, tree building), and the ones it is given are set there."""
    from hf_tree.cli import SFT_DATA_FIELDS, _training_config, build_parser
    from hf_tree.sft_stats import trainer_batching
    from hf_tree.trl.sft import TreeSFTConfig

    config = _training_config(build_parser().parse_args(["stats", "data"]))
    default = TreeSFTConfig(output_dir="unused", bf16=False, use_cpu=True)
    assert config.packing_config() == default.packing_config() and default.max_branch_tokens == 1024  # max_length
    assert trainer_batching(config) == trainer_batching(default)
    assert all(getattr(config, name) == getattr(default, name) for name in SFT_DATA_FIELDS)
    given = build_parser().parse_args(["stats", "data", "--messages_branches", "per_turn", "--merge_in_batch", "false"])
    config = _training_config(given)
    assert (config.messages_branches, config.packing_config().merge_in_batch) == ("per_turn", False)
