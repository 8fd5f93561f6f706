"""Fixtures shared by the test files."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """One torch thread, as the gloo worker processes use, restored afterwards: left at 1
    it would change the reduction order (and results) of every later test in the process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
