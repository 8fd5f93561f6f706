"""``experiments.hub``: an unreachable hub is one line that says how to work offline, and
the hub client's retry warnings stay off stderr."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from experiments.hub import hub_unreachable, offline_tip, quiet_hub


def test_the_offline_tip_is_given_until_offline_mode_is_set(monkeypatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert offline_tip().startswith("HF_HUB_OFFLINE=1 makes a hub name fail at once")
    for value in ("1", "true", "ON"):
        monkeypatch.setenv("HF_HUB_OFFLINE", value)
        assert offline_tip() == ""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert offline_tip()


def test_unreachable_is_told_from_a_wrong_name() -> None:
    try:
        try:
            raise ConnectionError("[Errno -2] Name or service not known")
        except ConnectionError as e:
            raise OSError("We couldn't reach the files") from e
    except OSError as e:
        assert hub_unreachable(e)
    assert not hub_unreachable(OSError("bert-nope is not a valid model identifier"))


def test_quiet_hub_hides_the_clients_warnings_and_restores_its_level() -> None:
    pytest.importorskip("huggingface_hub.utils.logging")  # whose import sets the level
    logger = logging.getLogger("huggingface_hub")
    before = logger.level
    with quiet_hub():
        assert not logger.isEnabledFor(logging.WARNING)
        assert logger.isEnabledFor(logging.ERROR)
    assert logger.level == before


def test_quiet_hub_holds_when_the_client_is_first_imported_inside_it() -> None:
    """huggingface_hub sets its logger's level when imported: a first import inside the
    block (datasets loading MNLI) undid the block's level, and its retries printed."""
    import subprocess
    import sys

    pytest.importorskip("datasets")
    code = ("import logging\nfrom experiments.hub import quiet_hub\nwith quiet_hub():\n"
            "    import datasets\n"
            "    print(logging.getLogger('huggingface_hub').getEffectiveLevel())\n")  # fmt: skip
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=root, check=True, env={"PYTHONPATH": str(root)})  # fmt: skip
    assert out.stdout.split()[-1] == str(logging.ERROR)


def test_finetune_on_an_unreachable_hub_is_one_line_with_the_tip(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """The load fails as transformers fails offline, after the hub client logged a
    warning per retry: one line naming --model, the way out, and nothing else."""
    tf = pytest.importorskip("transformers")
    from experiments.finetune import main

    def unreachable(*args, **kwargs):
        logging.getLogger("huggingface_hub").warning("'[Errno -2]' thrown while requesting")
        try:
            raise ConnectionError("[Errno -2] Name or service not known")
        except ConnectionError as e:
            raise OSError("We couldn't connect to 'https://huggingface.co'") from e

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(tf.AutoModelForSequenceClassification, "from_pretrained", unreachable)
    argv = ["--preset", "smoke", "--model", "org/absent", "--run-dir", str(tmp_path / "r"),
            "--no-progress", "--wandb", "disabled"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "--model org/absent: cannot load a model there" in err[0]
    assert "pass a local folder (HF_HUB_OFFLINE=1 makes a hub name fail at once" in err[0]
    assert not (tmp_path / "r").exists()
