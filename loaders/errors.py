"""What bad input to the loader raises (loaders never import comera, so it has its own).

:class:`LoaderInputError` means the loader's config, corpus or saved state is wrong, not the
code: its message names the problem and what to change. Commands print it as one line and
exit with status 2 (as they do ``comera.errors.UserError``); any other exception is a bug
and keeps its traceback. It is a ``ValueError`` (:class:`LoaderPathError` also a
``FileNotFoundError``), so callers' existing ``except`` clauses keep working.
"""

from __future__ import annotations

__all__ = [
    "EmptyStream",
    "LoaderInputError",
    "LoaderPathError",
    "MixingShortfall",
    "ReadersWithoutDocuments",
]


class LoaderInputError(ValueError):
    """A loader config, corpus file or saved loader state that cannot be used as given.

    ``fact``: what is wrong, without the advice in ``LoaderConfig``'s terms that follows it
    (a command that sets the config itself gives advice in its own flags)."""

    def __init__(self, message: str, *, fact: str | None = None) -> None:
        super().__init__(message)
        self.fact = message if fact is None else fact


class LoaderPathError(LoaderInputError, FileNotFoundError):
    """A data path (corpus folder, file, checkpoint folder) that does not exist or holds no
    files the loader reads."""


class EmptyStream(LoaderInputError):
    """No sub-dataset with a positive weight holds a document of ``min_doc_len`` tokens:
    the stream would yield no batch."""


class MixingShortfall(LoaderInputError):
    """Weights an endless stream cannot meet: the readers that own a small sub-dataset's
    documents are too few to serve its share (see ``loaders.mixing.reader_targets``)."""


class ReadersWithoutDocuments(LoaderInputError):
    """A reader of an endless stream (a rank's worker) would own no document of the
    sub-datasets with a positive weight: its stream would end at once."""
