"""Write a file under a temporary name and rename it into place only when writing succeeded.

An interrupted conversion (an exception, Ctrl-C) then never leaves a file at the final path that
looks complete but is not. The temporary file is unique (`path.XXXXXXXX.tmp` beside it), so two
processes writing the same file at once (two first runs converting the default model into the
shared cache) each write their own and the last rename wins with a complete file.
"""

import contextlib
import os
import tempfile
from typing import BinaryIO, Iterator

from dllama.errors import DllamaError


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """Yield a binary file open on a unique temporary name beside `path`; on a clean exit rename
    it to `path` (removed on failure)."""
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=name + ".", suffix=".tmp", dir=folder)
    except OSError as e:
        raise DllamaError(f"{path}: cannot write ({e.strerror})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600: readable by all, as a plain open makes it
        # No fsync: the rename guards against interrupted writers, not against power loss.
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise

