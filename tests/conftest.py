"""Shared fixtures."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "jobs(name, ...): the subprocess jobs of its module that a test checks (harness/jobs.py)",
    )


@pytest.fixture
def one_thread():
    """One intra-op thread (tiny ops only fight over 2 cores) and a fresh dynamo cache."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    yield
    torch.set_num_threads(threads)
