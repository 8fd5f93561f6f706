"""Fixtures shared by the test files, and a guard over the committed reports."""

import hashlib
from pathlib import Path

import pytest
import torch

REPORTS = Path(__file__).resolve().parents[1] / "reports"


def _report_digests() -> dict[str, str]:
    """Every file under ``reports/`` (the GPU logs aside) and a digest of its bytes."""
    return {
        str(p.relative_to(REPORTS)): hashlib.blake2b(p.read_bytes(), digest_size=16).hexdigest()
        for p in sorted(REPORTS.rglob("*"))
        if p.is_file() and "logs" not in p.relative_to(REPORTS).parts
    }


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_BEFORE] = _report_digests()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if a test wrote into ``reports/``: the committed reports are what
    their commands measured, and a test that forgets its ``--out`` (or ``--reports``)
    would replace one with toy figures (it once emptied an ablation report)."""
    before = session.config.stash.get(_BEFORE, None)
    if before is None:
        return
    after = _report_digests()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if changed:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        line = f"tests wrote into reports/: {', '.join(changed)} (give each command an --out)"
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(line, red=True)
        if exitstatus == pytest.ExitCode.OK:  # an interrupted or failed run keeps its status
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


_BEFORE = pytest.StashKey[dict]()


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
