"""What a command does to a user's data without refusing it, said on stderr."""

from __future__ import annotations

import os
import sys

__all__ = ["note"]


def note(message: str) -> None:
    """Print ``note: MESSAGE`` on stderr, on rank 0 only (every rank of a torchrun job
    loads the data, and the note would otherwise repeat once per rank)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"note: {message}", file=sys.stderr)
