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
