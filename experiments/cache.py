"""Where experiments cache prepared data: one root, overridable per run and per machine."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root"]


def cache_root(kind: str, override: str | None = None) -> Path:
    """``override`` if given, else ``$COMERA_CACHE/<kind>``, else ``~/.cache/comera/<kind>``."""
    if override:  # ``~`` expanded: a config file or a quoted flag keeps it literal
        return Path(override).expanduser()
    base = os.environ.get("COMERA_CACHE") or Path.home() / ".cache" / "comera"
    return Path(base).expanduser() / kind
