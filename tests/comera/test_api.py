"""The package's public face: a short ``__all__``, a version, a table of contents, and an
import with no side effects."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import comera

PACKAGE = Path(comera.__file__).parent


def test_all_is_short_and_every_name_imports():
    """At most 30 names, no duplicates, each one a real attribute of ``comera``."""
    names = comera.__all__
    assert len(names) <= 30, f"comera exports {len(names)} names; keep helpers in submodules"
    assert len(set(names)) == len(names)
    missing = [n for n in names if not hasattr(comera, n)]
    assert not missing, missing
    namespace: dict[str, object] = {}
    exec("from comera import *", namespace)  # noqa: S102 - what a star import gives
    assert set(names) <= set(namespace)


def test_version_is_a_string():
    assert isinstance(comera.__version__, str) and comera.__version__.strip()
    assert "__version__" in comera.__all__


def test_docstring_names_every_submodule():
    """``help(comera)`` is a table of contents: one line per submodule, none left out and
    none that does not exist."""
    doc = comera.__doc__ or ""
    listed = {line.split("``")[1] for line in doc.splitlines() if line.startswith("- ``comera.")}
    modules = {
        f"comera.{p.stem if p.is_file() else p.name}"
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py" and not p.name.startswith("_")) or (p / "__init__.py").is_file()
    }
    assert listed == modules


def test_import_has_no_side_effects():
    """A fresh ``import comera`` changes no environment variable, leaves torch's thread
    count alone and does not load ``torch._dynamo`` (1.6 s at every process start: CLI,
    bench workers, torchrun ranks); nor do the entry points' imports load dynamo."""
    code = (
        "import json, os, sys, torch\n"
        "env, threads = dict(os.environ), torch.get_num_threads()\n"
        "import comera\n"
        "after = {'env_same': dict(os.environ) == env,\n"
        "         'threads_same': torch.get_num_threads() == threads,\n"
        "         'dynamo': 'torch._dynamo' in sys.modules}\n"
        "import loaders, experiments.cli, experiments.mnli\n"
        "after['dynamo_entry_points'] = 'torch._dynamo' in sys.modules\n"
        "print(json.dumps(after))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=PACKAGE.parent,
    )
    assert json.loads(out.stdout) == {
        "env_same": True,
        "threads_same": True,
        "dynamo": False,
        "dynamo_entry_points": False,
    }
