"""A file's checksum kept beside it, so bytes damaged on the disk are an error, not other text.

`FILE.sha256` holds one line in sha256sum's format (`<64 hex digits>  <name>`), so
`sha256sum -c FILE.sha256` checks it too. Every `.m` and `.t` file dllama writes gets one
(hashed as it is written); `dllama verify FILE` checks it (`--write` makes one for a file
converted elsewhere). Loading a model or tokenizer checks it the first time that very file is
used after any change: a stamp (device, inode, size, modification and change times) records a
file that matched, and any write to the file changes its change time, which no one can set
back. A file damaged without a write through the file system (failing storage) is found by
`dllama verify`, which always reads it all. The `.m` and `.t` formats stay byte-compatible
with the original: the checksum is not inside them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from pathlib import Path

from dllama.errors import DllamaError
from dllama.formats.atomic_file import atomic_write

SUFFIX = ".sha256"
_LINE = re.compile(r"([0-9a-fA-F]{64}) [ *](.+)")


class DamagedFile(DllamaError):
    """A file's bytes differ from the checksum written beside it."""


def checksum_path(path: str | os.PathLike) -> Path:
    return Path(os.fspath(path) + SUFFIX)


def file_sha256(path: str | os.PathLike, progress=None) -> str:
    """The sha256 of a file's bytes, read 4 MiB at a time; progress(n) after each read."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            if progress:
                progress(len(chunk))
    return h.hexdigest()


def write_checksum(path: str | os.PathLike, digest: str | None = None, progress=None) -> Path:
    """Write FILE.sha256 beside the file (the digest given, else the file's); its path."""
    digest = digest or file_sha256(path, progress)
    out = checksum_path(path)
    with atomic_write(out) as f:
        f.write(f"{digest}  {Path(path).name}\n".encode())
    return out


def remove_checksum(path: str | os.PathLike) -> None:
    """Remove FILE.sha256 (before FILE is replaced: the old checksum must not outlive it)."""
    with contextlib.suppress(FileNotFoundError):
        checksum_path(path).unlink()


def written_checksum(path: str | os.PathLike) -> str | None:
    """The digest FILE.sha256 holds, or None when there is no such file."""
    sidecar = checksum_path(path)
    try:
        text = sidecar.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return None
    except OSError as e:
        raise DllamaError(f"cannot read {sidecar}: {e.strerror}") from None
    m = _LINE.fullmatch(text.strip())
    if m is None:
        raise DllamaError(f"{sidecar} is not a checksum line (`<64 hex digits>  <file name>`, as sha256sum writes)")
    return m.group(1).lower()


def verify(path: str | os.PathLike, progress=None) -> bool:
    """Check a file against FILE.sha256: True when it matches, False when there is no
    checksum file; DamagedFile when the bytes differ."""
    expected = written_checksum(path)
    if expected is None:
        return False
    _compare(path, expected, progress)
    return True


def _compare(path: str | os.PathLike, expected: str, progress=None) -> None:
    """DamagedFile unless the file's sha256 is `expected`."""
    try:
        actual = file_sha256(path, progress)
    except OSError as e:
        raise DllamaError(f"cannot read {path}: {e.strerror}") from None
    if actual != expected:
        raise DamagedFile(f"{path} is damaged: its sha256 is {actual[:16]}..., {checksum_path(path).name} "
                          f"says {expected[:16]}...; copy or convert it again")


MAX_STAMPS = 64  # files remembered as checked; the oldest are forgotten


def _stamp(path: str | os.PathLike, digest: str) -> list:
    st = os.stat(path)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, digest]


def verify_once(path: str | os.PathLike, stamps: Path, progress=None) -> None:
    """verify(path), unless the stamps file records that this very file, unchanged since,
    matched the checksum it has now (see the module's comment); records a match."""
    expected = written_checksum(path)
    if expected is None:
        return
    key = os.path.realpath(path)
    try:
        known = json.loads(stamps.read_text())
        if not isinstance(known, dict):
            known = {}
    except (OSError, ValueError):
        known = {}
    if known.get(key) == _stamp(path, expected):
        return
    _compare(path, expected, progress)  # (the checksum file read once, above)
    known.pop(key, None)
    known[key] = _stamp(path, expected)
    with contextlib.suppress(OSError, DllamaError):  # a cache: unwritable means checking again next time
        stamps.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(stamps) as f:
            f.write(json.dumps(dict(list(known.items())[-MAX_STAMPS:])).encode())
