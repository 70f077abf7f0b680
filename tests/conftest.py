"""Shared pytest fixtures: every test starts from a fixed seed."""

import os
import random

import pytest
import torch

# Limit intra-op threads: CI has 2 cores and small matmuls do not profit from more.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _no_capture_left_recording():
    """A test must not leave an attention capture recording: the open recording is process-wide state, and later
    tests (and later fits in a user's process) would see it. Fails the test that leaks it, and clears it."""
    yield
    try:
        from lightning_streamkl.capture.base import _RECORDING
    except ImportError:  # the op's tests without lightning installed
        return
    leaked = list(_RECORDING)
    _RECORDING.clear()
    assert not leaked, f"the test left attention captures recording: {leaked}"


def pytest_collection_modifyitems(config, items):
    """Tests marked ``multi_gpu`` skip with fewer than two CUDA devices, and run one after another in one pytest-xdist
    worker (``--dist loadgroup``, as ``./scripts/test --gpu`` runs): each takes both GPUs for its spawned ranks."""
    enough = torch.cuda.device_count() >= 2
    for item in items:
        if item.get_closest_marker("multi_gpu") is None:
            continue
        if not enough:
            item.add_marker(pytest.mark.skip(reason="needs 2 CUDA devices"))
        elif config.pluginmanager.hasplugin("xdist"):
            item.add_marker(pytest.mark.xdist_group("multi_gpu"))
