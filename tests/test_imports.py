"""The package has no import cycle between its modules and subpackages (issue 17: ``tree`` <-> ``validation``,
``attention`` -> ``parallel`` -> ``attention``). Read from the source with ``ast``: no imports run, so it is fast.

Nodes are hf_tree's top-level modules and subpackages (``hf_tree.attention.mask`` counts as
``hf_tree.attention``); an edge is an import at module level (``if TYPE_CHECKING:`` blocks included: a
cycle there is still a design cycle). Imports inside functions are deferred on purpose and not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

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
    assert "hf_tree.attention" in graph[ROOT]


def test_no_package_import_cycle():
    cycle = find_cycle(package_graph())
    assert cycle is None, (
        f"hf_tree has an import cycle: {' -> '.join(cycle)}. Move the shared piece into a leaf module, or "
        "import inside the function that needs it."
    )
