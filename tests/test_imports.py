"""Imports: no import cycle between the package's modules and subpackages (issue 17: ``tree`` <-> ``validation``,
``attention`` -> ``parallel`` -> ``attention``), the lower floors free of the upper ones (issue 45: ``models``
imports neither the collator nor ``parallel``), no test module importing another, and (at the end) the start-up
cost of ``import hf_tree`` and ``hf-tree --help`` (fresh interpreters). The cycles are read from the source with
``ast``: no imports run, so that check is fast.

Nodes are hf_tree's top-level modules and subpackages (``hf_tree.attention.mask`` counts as
``hf_tree.attention``); an edge is an import at module level (``if TYPE_CHECKING:`` blocks included: a
cycle there is still a design cycle). Imports inside functions are deferred on purpose and not counted.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "hf_tree"  # read, not imported
ROOT = "hf_tree"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str:
    """``hf_tree.attention.mask`` -> ``hf_tree.attention``; ``hf_tree.tree`` and ``hf_tree`` stay."""
    return ".".join(module.split(".")[:2])


def _module_level_imports(tree: ast.Module, module: str, is_package: bool) -> set[str]:
    """Absolute names of the hf_tree modules imported outside functions and classes."""
    found: set[str] = set()
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If | ast.Try | ast.With):  # still module level
            pending.extend(ast.iter_child_nodes(node))
        elif isinstance(node, ast.ExceptHandler):
            pending.extend(node.body)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # submodules imported by name
    return {name for name in found if name == ROOT or name.startswith(ROOT + ".")}


def package_graph() -> dict[str, set[str]]:
    """``{unit: units it imports}`` over hf_tree's modules (edges inside one subpackage dropped)."""
    files = sorted(PACKAGE_DIR.rglob("*.py"))
    modules = {_module_name(path) for path in files}
    graph: dict[str, set[str]] = {}
    for path in files:
        module = _module_name(path)
        imported = _module_level_imports(ast.parse(path.read_text()), module, path.name == "__init__.py")
        targets = {_unit(name) for name in imported if name in modules}
        graph.setdefault(_unit(module), set()).update(targets - {_unit(module)})
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or ``None`` (iterative DFS with colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_find_cycle_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_package_graph_has_the_known_edges():
    graph = package_graph()
    assert "hf_tree.attention" in graph["hf_tree.parallel"]
    assert "hf_tree.validation" in graph["hf_tree.tree"]
    assert "hf_tree.post_import" in graph[ROOT]


def test_no_package_import_cycle():
    cycle = find_cycle(package_graph())
    assert cycle is None, (
        f"hf_tree has an import cycle: {' -> '.join(cycle)}. Move the shared piece into a leaf module, or "
        "import inside the function that needs it."
    )


# ----------------------------------------------------------------------------------- floors (issue 45)
# The lower floors of the package, bottom up: a unit may import (at module level, directly or through other units)
# only units of the floors below its own. Units not listed sit above all of these. ``hf_tree.models`` (how hf_tree
# reads a model, its checks and the tree mixers) stays below the collator and context parallel: the length-switch
# check reads a collator's ``PackingConfig``, and the mixers find context parallel through the attention scope as a
# ``ShardedRows`` they declare themselves.
LOWER_FLOORS: list[set[str]] = [
    {"hf_tree.validation", "hf_tree.post_import", "hf_tree.versions"},
    {"hf_tree.tree", "hf_tree.attention", "hf_tree.distributed"},
    {"hf_tree.packing"},
    {"hf_tree.models"},
]


def reachable(graph: dict[str, set[str]], unit: str) -> set[str]:
    """The units ``unit`` imports, directly or through others."""
    seen: set[str] = set()
    pending = [unit]
    while pending:
        for target in graph.get(pending.pop(), ()):
            if target not in seen:
                seen.add(target)
                pending.append(target)
    return seen


def floor_violations(graph: dict[str, set[str]], floors: list[set[str]]) -> dict[str, set[str]]:
    """``{unit: the units it reaches that are not on a floor below its own}`` (units within the limits left out)."""
    violations = {}
    for level, floor in enumerate(floors):
        below = set().union(*floors[:level])
        for unit in sorted(floor):
            above = reachable(graph, unit) - below
            if above:
                violations[unit] = above
    return violations


def test_floor_check_sees_an_upward_import():
    floors = [{"a"}, {"b"}]
    assert floor_violations({"a": set(), "b": {"a"}}, floors) == {}
    assert floor_violations({"a": {"c"}, "b": {"a"}, "c": set()}, floors) == {"a": {"c"}, "b": {"c"}}


def test_lower_floors_import_nothing_above_them():
    graph = package_graph()
    assert all(unit in graph for floor in LOWER_FLOORS for unit in floor), "a floor names a unit that is gone"
    assert not {"hf_tree.collator", "hf_tree.parallel"} & reachable(graph, "hf_tree.models")
    violations = floor_violations(graph, LOWER_FLOORS)
    assert not violations, (
        f"lower floors import units above them: {violations}. Move the shared piece down (or declare the interface "
        "the lower floor needs there, as hf_tree.models.mixers.install.ShardedRows), or import inside the function."
    )


# ------------------------------------------------------------------------- no imports between test modules
# Issue 17: shared workloads and tiny-model factories live in tests/helpers.py and tests/workloads.py; a test module
# that imports another couples their runs (collection, fixtures, module state) and hides where a helper lives.
TESTS_DIR = Path(__file__).resolve().parent


def imported_test_modules(source: str) -> set[str]:
    """Names of the ``tests.test_*`` modules that ``source`` imports anywhere (functions included: a launched
    worker's imports count too): ``import tests.test_x``, ``from tests.test_x import ...``,
    ``from tests import test_x`` and the relative ``from .test_x import ...`` / ``from . import test_x``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("tests.test_"))
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 1:  # relative to the tests package
                module = f"tests.{module}" if module else "tests"
            elif node.level:
                continue
            if module.startswith("tests.test_"):
                found.add(module)
            elif module == "tests":
                found.update(f"tests.{alias.name}" for alias in node.names if alias.name.startswith("test_"))
    return found


def imports_between_test_modules(tests_dir: Path) -> dict[str, set[str]]:
    """``{test file name: the tests.test_* modules it imports}`` over ``tests_dir/test_*.py`` (files without any
    left out)."""
    imports = {path.name: imported_test_modules(path.read_text()) for path in sorted(tests_dir.glob("test_*.py"))}
    return {name: modules for name, modules in imports.items() if modules}


def test_finder_sees_every_import_form():
    source = (
        "import tests.test_a\n"
        "from tests.test_b import x\n"
        "from tests import test_c, helpers\n"
        "from .test_d import y\n"
        "def worker():\n"
        "    from tests.test_e import z\n"
        "from tests.helpers import tiny_model\n"
        "from tests.workloads import branch_groups\n"
    )
    assert imported_test_modules(source) == {f"tests.test_{c}" for c in "abcde"}


def test_no_test_module_imports_another():
    found = imports_between_test_modules(TESTS_DIR)
    assert not found, (
        f"test modules import other test modules: {found}. Move the shared piece into tests/helpers.py (models, "
        "oracles, training plumbing) or tests/workloads.py (data and tree workloads) and import it from there."
    )


# ------------------------------------------------------------------------------- start-up cost (issue 34)
# Checked in fresh interpreters (this one has everything imported) by what lands in sys.modules, not by time.
REPO_ROOT = TESTS_DIR.parent
# torch._dynamo and torch._inductor: seconds each (transformers.modeling_utils imports both); peft imports
# torch._inductor where bitsandbytes is installed
HEAVY_MODULES = ("torch", "torch._dynamo", "torch._inductor", "transformers", "peft", "trl", "datasets", "accelerate")


def run_fresh(code: str) -> str:
    """The output of a fresh interpreter running ``code`` in the repository root (this checkout's hf_tree)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def modules_after(code: str) -> set[str]:
    """The ``HEAVY_MODULES`` in ``sys.modules`` after a fresh interpreter runs ``code``."""
    output = run_fresh(f"{code}\nimport sys\nprint([m for m in {HEAVY_MODULES!r} if m in sys.modules])")
    return set(ast.literal_eval(output.splitlines()[-1]))


def test_import_hf_tree_imports_nothing_heavy():
    """``import hf_tree`` sets up tree_flash and the hybrid mixers for later (``hf_tree.post_import``), importing no
    torch, no transformers and none of the trainers' stacks."""
    assert modules_after("import hf_tree") == set()


@pytest.mark.parametrize("argv", [["--help"], ["stats", "--help"], ["show", "--help"], ["demo", "--help"]])
def test_cli_help_imports_no_torch(argv):
    """``hf-tree --help`` and the help of its own subcommands are built from light modules (<= 1 s)."""
    code = f"from hf_tree.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass"
    assert modules_after(code) == set()


# After FIRST, a tiny float64 Bamba (attention and Mamba2 mixers): the loss of a packed tree through tree_flash
# (registered when transformers.modeling_utils loads) and the tree-aware mixers (installed when modeling_bamba
# loads) against the same model run branch by branch with sdpa (the first use's self-check is off: it costs more than
# the rest and this oracle is stricter).
TREE_FLASH_CHECK = """
import sys
from transformers.models.bamba import modeling_bamba  # imports transformers.modeling_utils
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

stacks = {"peft", "trl", "datasets"} & set(sys.modules)
assert not stacks, f"setting up tree_flash and the mixers imported {stacks}"
import hf_tree
from hf_tree.attention import tree_attention_forward
from tests.helpers import FLOAT32_FLOOR, hybrid_model, per_branch_forest_loss, relative_error
from tests.workloads import grpo_row

assert ALL_ATTENTION_FUNCTIONS["tree_flash"] is tree_attention_forward
assert hasattr(modeling_bamba.mamba2_chunk_scan, "__hf_tree_original__")
model = hybrid_model("bamba")
assert model.config._attn_implementation == "tree_flash"
groups = grpo_row()
collator = hf_tree.TreeDataCollator(max_packed_tokens=64)
batch = collator([hf_tree.Tree.from_sequences(s, m).to_dict() for s, m in groups])
loss = hf_tree.tree_causal_lm_loss(model, batch, self_check=False)
error = relative_error(loss, per_branch_forest_loss(model, groups))
assert error <= FLOAT32_FLOOR, error
"""


@pytest.mark.parametrize(
    "first",
    [
        "import hf_tree",  # the usual order: set up as transformers' modeling code loads
        # hf_tree's attention package first: the usual order's set-up again (it imports hf_tree first)
        pytest.param("import hf_tree.attention.registration", marks=pytest.mark.slow),
        pytest.param(  # already loaded: set up at once (a fresh interpreter, ~8 s: the fast tier keeps the usual order)
            "import transformers.models.bamba.modeling_bamba\nimport hf_tree", marks=pytest.mark.slow
        ),
    ],
)
def test_tree_flash_and_mixers_work_right_after_import(first):
    """A model loaded with ``attn_implementation="tree_flash"`` right after ``import hf_tree`` trains trees exactly
    (hybrid mixers included), whichever is imported first; setting up imports none of peft, trl, datasets."""
    run_fresh(f"{first}\n{TREE_FLASH_CHECK}")


# ------------------------------------------------------------------------- the text trainer and vision (issue 45)
def module_level_closure(start: str) -> set[str]:
    """The hf_tree modules ``start`` imports at module level, directly or through others (file granularity)."""
    files = {_module_name(path): path for path in PACKAGE_DIR.rglob("*.py")}
    seen, pending = set(), [start]
    while pending:
        module = pending.pop()
        if module in seen or module not in files:
            continue
        seen.add(module)
        path = files[module]
        pending.extend(_module_level_imports(ast.parse(path.read_text()), module, path.name == "__init__.py"))
    return seen - {start}


def test_text_trainer_imports_no_vision_module():
    """``hf_tree.trainer`` reaches no ``hf_tree.vision`` module: image batches reach the model through the builder
    vision registers (``hf_tree.batch_inputs``), not through an import of the trainer's."""
    reached = module_level_closure("hf_tree.trainer")
    assert "hf_tree.batch_inputs" in reached and "hf_tree.depth_first_runner" in reached  # the closure is followed
    vision = sorted(name for name in reached if name == "hf_tree.vision" or name.startswith("hf_tree.vision."))
    assert not vision, f"hf_tree.trainer imports {vision}; let hf_tree.vision register its hooks instead."


# ------------------------------------------------------------------------------------ the core without TRL (issue 51)
# TRL is the `trl` extra: the core (trees, collator, tree_flash, TreeTrainer, the data builders) imports none of it,
# so hf_tree installs beside a framework that pins another TRL. Only hf_tree.trl (the TRL trainers) and the launcher
# (which trains TreeSFTTrainer) may import TRL at module level.
MAY_IMPORT_TRL = ("hf_tree.trl", "hf_tree.launcher")


def module_level_trl_imports() -> list[str]:
    """hf_tree's modules outside ``MAY_IMPORT_TRL`` that import ``trl`` at module level."""
    found = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        module = _module_name(path)
        if module.startswith(MAY_IMPORT_TRL):
            continue
        pending: list[ast.stmt] = list(ast.parse(path.read_text()).body)
        while pending:
            node = pending.pop()
            if isinstance(node, ast.If | ast.Try | ast.With | ast.ExceptHandler):
                pending.extend(ast.iter_child_nodes(node))
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            if any(name == "trl" or name.startswith("trl.") for name in names):
                found.append(module)
    return found


def test_the_core_imports_no_trl_at_module_level():
    found = module_level_trl_imports()
    assert not found, (
        f"{found} import trl at module level: the core must install and run without TRL (the trl extra). Import it "
        "inside the function that needs it, or move the code into hf_tree.trl."
    )


# A fresh interpreter in which `import trl` fails as it does where TRL is not installed: TreeTrainer trains one SGD step
# of a tiny float64 Llama on two trees, its loss that of the branches run one by one (each shared token computed once
# in the tree); nothing imported TRL, and the TRL trainers refuse with the fix.
WITHOUT_TRL = """
import importlib.abc, sys

class NoTRL(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "trl" or name.startswith("trl."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoTRL())
import tempfile
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from hf_tree import Tree, TreeTrainer
from hf_tree.trainer import TreeTrainingArguments

torch.manual_seed(0)
config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64)
model = LlamaForCausalLM(config).to(torch.float64)
groups = [[[5, 6, 7, 8, 9], [5, 6, 7, 10, 11, 12]], [[13, 14, 15], [13, 16, 17, 18]]]
rows = [Tree.from_sequences(branches).to_dict() for branches in groups]
with torch.no_grad():  # the oracle: every branch alone, token loss over all trained tokens of the step
    losses = [model(torch.tensor([b]), labels=torch.tensor([b])).loss * (len(b) - 1) for g in groups for b in g]
    expected = float(sum(losses) / sum(len(b) - 1 for g in groups for b in g))
with tempfile.TemporaryDirectory() as out:
    args = TreeTrainingArguments(output_dir=out, max_steps=1, per_device_train_batch_size=2, learning_rate=0.1,
                                 optim="sgd", logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                                 max_packed_tokens=32, disable_tqdm=True)
    trainer = TreeTrainer(model=model, args=args, train_dataset=rows)
    trainer.train()
loss = trainer.state.log_history[0]["loss"]
assert abs(loss - expected) <= 1e-6 * expected, (loss, expected)
assert not [m for m in sys.modules if m == "trl" or m.startswith("trl.")]
try:
    import hf_tree.trl.sft
except ImportError as error:
    print("refused:", error)
"""


@pytest.mark.slow  # a fresh interpreter importing torch, transformers and Trainer, training a step (~12 s)
def test_the_core_trains_without_trl():
    output = run_fresh(WITHOUT_TRL)
    assert "refused: hf_tree's TRL trainers cannot run without TRL, which is not installed" in output, output
    assert "pip install 'hf_tree[trl]'" in output, output
