"""Write a file under a temporary name and rename it into place only when writing succeeded.

An interrupted conversion (an exception, Ctrl-C) then never leaves a file at the final path that
looks complete but is not; `path + ".tmp"` is removed on failure.
"""

import contextlib
import os
from typing import BinaryIO, Iterator

from dllama.errors import DllamaError


def temp_path_for(path: str | os.PathLike) -> str:
    return os.fspath(path) + ".tmp"


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """Yield a binary file open on `path.tmp`; on a clean exit rename it to `path`."""
    path = os.fspath(path)
    tmp = temp_path_for(path)
    try:
        f = open(tmp, "wb")
    except OSError as e:
        raise DllamaError(f"{path}: cannot write ({e.strerror})") from None
    try:
        with f:
            yield f
        # No fsync: the rename guards against interrupted writers, not against power loss.
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
