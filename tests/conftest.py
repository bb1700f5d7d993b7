"""Shared fixtures."""

from __future__ import annotations

import os

import pytest
import torch
import torch._dynamo
import torch.distributed as dist


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


@pytest.fixture
def restore_process_state():
    """For a test that fits a DDP strategy (``"vlmbalance"``) in this process: the fit
    initialises a world-size-1 process group here and sets Lightning's launch variables
    (``MASTER_PORT``, ``LOCAL_RANK``, ``WORLD_SIZE``, ...), which every later subprocess job
    would inherit (and then fail: it would think it was launched as a rank already). Undone
    after the test."""
    env = dict(os.environ)
    os.environ["OMP_NUM_THREADS"] = "1"  # else Lightning sets torch's threads to cores // ranks
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)
