"""Shared fixtures."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo


@pytest.fixture
def one_thread():
    """One intra-op thread (tiny ops only fight over 2 cores) and a fresh dynamo cache."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    yield
    torch.set_num_threads(threads)
