"""Run a function when a module finishes importing (a post-import hook), or now if it already has.

``import hf_tree`` uses it to set itself up in transformers only once transformers' modeling code loads:
``transformers.modeling_utils`` alone imports ``torch._dynamo`` and ``torch._inductor`` (seconds), which
``hf-tree --help`` and data-only scripts need not pay. Standard library only (``importlib`` meta-path finder).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType

ModuleCallback = Callable[[ModuleType], None]


class _ThenCall(importlib.abc.Loader):
    """Wraps a module's loader: executes the module, then calls the callbacks on it."""

    def __init__(self, loader: importlib.abc.Loader, callbacks: list[ModuleCallback]) -> None:
        self.loader = loader
        self.callbacks = callbacks

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # the module keeps its own loader (tracebacks, inspect.getsource and reloads read it)
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        for callback in self.callbacks:
            callback(module)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched module it asks the other finders and wraps the loader they return."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list[ModuleCallback]] = {}
        self._finding: set[str] = set()  # names being looked up through the other finders (no recursion)

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.callbacks or fullname in self._finding:
            return None
        self._finding.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding.discard(fullname)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenCall(spec.loader, self.callbacks[fullname])
        return spec


_FINDER = _PostImportFinder()


def when_imported(module_name: str, callback: ModuleCallback) -> None:
    """Call ``callback(module)`` once ``module_name`` has been imported: now if it is in ``sys.modules``, else right
    after its code runs (inside that import, so the importer already sees the callback's effect); and again after
    every later run of its code (``importlib.reload``, or an import after it left ``sys.modules``), which would
    otherwise undo what the callback did. Callbacks must therefore be idempotent."""
    _FINDER.callbacks.setdefault(module_name, []).append(callback)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)
