"""Atomic writes, for every package that writes what a reader must never see half-written (checkpoints, run
directories, results, tokenizers). It sits at the bottom of the layers, beside k3.config, so that writing a file
imports no checkpoint code.

Directories (:func:`atomic_directory`): built in a temp dir beside the target, fsynced, then swapped in. A crash or
exception before the swap leaves the previous target untouched (and at most a stray ``.NAME.tmp-*`` directory,
removed on exceptions). On Linux the swap is one ``renameat2(RENAME_EXCHANGE)``, so the target name never points
at a half-written or missing directory; elsewhere it is two renames. A target that is a file or a symbolic link is
refused rather than swapped, and ``check_old`` may refuse the directory about to be replaced (it is called just
before the swap). Files (:func:`atomic_file`, :func:`atomic_write_text`): a temp file beside the target, fsynced,
renamed over it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
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


def make_directory(path: str | os.PathLike) -> Path:
    """``mkdir -p path``; one ValueError naming the file when ``path`` or a directory above it is an existing
    file (instead of ``FileExistsError`` / ``NotADirectoryError`` from deep inside a write)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), path)
        raise ValueError(f"{path}: {blocker} is a file, not a directory") from None
    return path


def _check_target(target: Path) -> None:
    """Refuse to replace a file or a symbolic link: only a real directory is swapped (and its old copy removed)."""
    if target.is_symlink():
        raise ValueError(f"{target} is a symbolic link; give the directory it points to")
    if target.exists() and not target.is_dir():
        raise ValueError(f"{target} is an existing file, not a directory")


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike, check_old: Callable[[Path], None] | None = None) -> Iterator[Path]:
    """``with atomic_directory(dir) as tmp:`` write files into tmp; on success they replace ``dir`` atomically.
    ``check_old(dir)``, when given and ``dir`` exists, runs just before the swap and may raise to keep it."""
    target = Path(target)
    _check_target(target)
    make_directory(target.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        normal_mode(tmp, directory=True)
        fsync_tree(tmp)
        _check_target(target)
        if target.exists() and check_old is not None:
            check_old(target)
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
    make_directory(target.parent)
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
