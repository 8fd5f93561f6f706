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


@pytest.fixture(autouse=True)
def _cpu_malloc_not_applied(monkeypatch):
    """The experiment commands apply ``train.cpu_malloc`` to the whole process and no
    policy can be undone, so in the test process it is checked but not applied (the tests
    of its effect run child processes); nor may ``lean`` re-execute the test process."""
    import experiments.cli as cli
    from comera.train.config import CPU_MALLOC_POLICIES

    def check(policy: str) -> None:
        if policy not in CPU_MALLOC_POLICIES:
            raise ValueError(f"cpu_malloc={policy!r}")

    monkeypatch.setattr(cli, "apply_cpu_malloc", check)
    monkeypatch.setenv("COMERA_MALLOC_RESTARTED", "1")
