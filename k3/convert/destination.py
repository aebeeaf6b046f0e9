"""Where ``k3 convert --to DIR`` may write, checked before anything is loaded.

The output is written atomically (k3.convert.atomic.atomic_directory: built beside DIR, swapped in, the previous
DIR removed), so these checks decide what a conversion may delete:

- refused outright: ``/``, the home directory, the current directory and any directory above one of them; a DIR
  that is, is inside or holds ``--from`` (symbolic links resolved); a symbolic link; an existing file, or a path
  under one;
- an empty or missing DIR is written;
- a non-empty DIR is replaced only with ``--force``, and only when it is a k3 checkpoint (config.json, weights,
  ``k3_checksums.json``) holding nothing but checkpoint files (the tokenizer's and the transformers code too);
  anything else in it is refused even with ``--force``, so nothing but the old checkpoint is ever removed.
  :func:`check_replaceable` runs again just before the swap.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from k3.convert import hf_code
from k3.convert.checkpoint import (
    CHECKSUMS,
    INDEX,
    SINGLE,
    TOKENIZER_FILES,
    TRAINER_STATE,
    read_checksums,
    read_config_json,
)

_FILES = {"config.json", SINGLE, INDEX, CHECKSUMS, TRAINER_STATE, *TOKENIZER_FILES, *hf_code.FILES}
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def _foreign(directory: Path) -> list[str]:
    """The entries of ``directory`` that a k3 checkpoint does not hold (sorted; directories end in ``/``)."""
    out = []
    for p in directory.iterdir():
        if p.is_symlink() or not p.is_file():
            out.append(p.name + ("/" if p.is_dir() and not p.is_symlink() else ""))
        elif p.name not in _FILES and not _SHARD.match(p.name):
            out.append(p.name)
    return sorted(out)


def _not_checkpoint(directory: Path) -> str | None:
    """Why ``directory`` is not a k3 checkpoint that may be replaced whole, or None when it is one."""
    foreign = _foreign(directory)
    if foreign:
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        return f"it holds {', '.join(foreign[:5])}{more}, which no checkpoint holds"
    try:
        read_config_json(directory)
        if read_checksums(directory) is None:
            raise ValueError(f"no {CHECKSUMS}")
    except (ValueError, FileNotFoundError) as e:
        return f"it is not a k3 checkpoint ({e})"
    if not (directory / SINGLE).is_file() and not (directory / INDEX).is_file():
        return f"it is not a k3 checkpoint (neither {SINGLE} nor {INDEX})"
    return None


def check_replaceable(directory: Path) -> None:
    """Refuse to replace a non-empty ``directory`` that is not a k3 checkpoint of checkpoint files only."""
    if directory.is_dir() and any(directory.iterdir()):
        why = _not_checkpoint(directory)
        if why is not None:
            raise ValueError(
                f"--to {directory} is not empty and {why}: refused, even with --force (give a new or empty directory)"
            )


def _protected() -> list[tuple[str, Path]]:
    out = [("the root directory", Path("/"))]
    for what, where in (("the home directory", Path.home), ("the current directory", Path.cwd)):
        try:
            out.append((what, where().resolve()))
        except (OSError, RuntimeError):  # no home known, or the current directory was removed
            pass
    return out


def check_destination(source: str | os.PathLike, target: str | os.PathLike, force: bool) -> None:
    """One ValueError when converting ``source`` into ``target`` could delete anything but an old checkpoint
    (the rules in the module docstring)."""
    given = Path(target)
    if given.is_symlink():
        raise ValueError(f"--to {target} is a symbolic link; give the directory it points to")
    if given.exists() and not given.is_dir():
        raise ValueError(f"--to {target} is an existing file, not a directory")
    dst, src = given.resolve(), Path(source).resolve()
    blocker = next((p for p in dst.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ValueError(f"--to {target}: {blocker} is a file, not a directory")
    for what, path in _protected():
        if path.is_relative_to(dst):
            raise ValueError(f"--to {target} is {dst}, which is or holds {what}: refused (give a directory of its own)")
    if dst == src:
        raise ValueError(f"--to {target} is the --from directory itself; write the conversion to another directory")
    if dst.is_relative_to(src):
        raise ValueError(f"--to {target} is inside --from {source}; write the conversion outside it")
    if src.is_relative_to(dst):
        raise ValueError(f"--to {target} holds --from {source}; replacing it would delete the source")
    if dst.is_dir() and any(dst.iterdir()):
        check_replaceable(dst)
        if not force:
            raise ValueError(f"--to {target} already holds a checkpoint; pass --force to replace it")
