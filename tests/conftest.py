"""Shared fixtures. (tests/test_triton_server.py runs with --noconftest in the serving env and uses none of these.)"""

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matmuls: one torch thread is faster and immune to a busy machine (restored afterwards)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
