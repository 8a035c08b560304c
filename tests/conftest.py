"""Fixtures shared by several test modules (each module opts in; none is autouse here)."""

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
