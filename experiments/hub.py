"""What the experiments share when they load from the Hugging Face Hub: telling an
unreachable hub from other failures, the advice for working offline, and keeping the
hub client's retry warnings off stderr (a failed load is one line)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from comera.errors import quiet_logger

__all__ = ["hub_unreachable", "offline_tip", "quiet_hub"]


def offline_tip() -> str:
    """How to skip the hub client's retries (offline, about 25 s per name before it gives
    up), or "" when ``HF_HUB_OFFLINE`` is already set."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return ""
    return "HF_HUB_OFFLINE=1 makes a hub name fail at once instead of after retries"


def hub_unreachable(exc: BaseException) -> bool:
    """True when ``exc`` (or an error it came from) says the hub could not be reached or
    the client is offline, rather than that the name or the files are wrong."""
    names = {"LocalEntryNotFoundError", "OfflineModeIsEnabled", "ConnectError", "ConnectTimeout"}
    keys = ("offline", "connect", "network", "name or service", "timed out", "resolve host")
    chain: BaseException | None = exc
    while chain is not None:
        if isinstance(chain, ConnectionError | TimeoutError) or names & {
            c.__name__ for c in type(chain).__mro__
        }:
            return True
        if any(k in str(chain).lower() for k in keys):
            return True
        chain = chain.__cause__ or chain.__context__
    return False


@contextlib.contextmanager
def quiet_hub() -> Iterator[None]:
    """Hide huggingface_hub's warnings (one per retried request) while a load runs: its
    failure is reported in one line by the caller."""
    # the client's logging module sets the level when first imported (inside a load, by
    # datasets), which undid ours: imported first, then ours set
    with contextlib.suppress(ImportError):
        import huggingface_hub.utils.logging  # noqa: F401
    with quiet_logger("huggingface_hub"):
        yield
