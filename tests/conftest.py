"""Fixtures shared by several test modules (each module opts in; none is autouse here), and the hook that skips
``gpu``-marked tests without a CUDA device."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_torch_thread():
    """Tiny tensors: intra-op threads only add synchronisation, which costs seconds on a shared 2-core box."""
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A ``@pytest.mark.gpu`` test needs CUDA: without a device it is skipped, never failed."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu test: no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
