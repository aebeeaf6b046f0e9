"""Atomic directory writes: build in a temp dir beside the target, fsync, then swap it in.

A crash or exception before the swap leaves the previous target untouched (and at most a stray
``.NAME.tmp-*`` directory, removed on exceptions). On Linux the swap is one ``renameat2(RENAME_EXCHANGE)``,
so the target name never points at a half-written or missing directory; elsewhere it is two renames.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def umask() -> int:
    """The process umask (read from /proc where it can be, so it is not changed even for a moment)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def normal_mode(path: str | os.PathLike, directory: bool = False) -> None:
    """Give ``path`` the mode a plain ``open`` / ``mkdir`` would (0666 / 0777 less the umask): temp files and
    directories are created 0600 / 0700, and a checkpoint written through them must be readable like any other."""
    os.chmod(path, (0o777 if directory else 0o666) & ~umask())


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under root, then every directory (children before parents)."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for f in filenames:
            fsync_file(Path(dirpath) / f)
        fsync_file(Path(dirpath))


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike) -> Iterator[Path]:
    """``with atomic_directory(dir) as tmp:`` write files into tmp; on success they replace ``dir`` atomically."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        normal_mode(tmp, directory=True)
        fsync_tree(tmp)
        if not target.exists():
            os.rename(tmp, target)
        elif _exchange(tmp, target):
            shutil.rmtree(tmp)  # tmp now holds the previous contents
        else:
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.rename(target, old / "prev")
            os.rename(tmp, target)
            shutil.rmtree(old)
        fsync_file(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def atomic_file(target: str | os.PathLike) -> Iterator[Path]:
    """``with atomic_file(path) as tmp:`` write tmp (a unique name beside path); on success it replaces ``path``
    (fsync + rename), so readers see the old file or the whole new one, never a partial write."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        normal_mode(tmp)
        fsync_file(tmp)
        os.replace(tmp, target)
        fsync_file(target.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(target: str | os.PathLike, text: str) -> None:
    """Replace a text file atomically (temp file + fsync + rename)."""
    with atomic_file(target) as tmp:
        tmp.write_text(text, encoding="utf-8")
