"""torch's CPU thread count for the commands that take ``--threads``."""

from __future__ import annotations

import os

# the variables torch reads its default thread count from: one that is set is the user's choice
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def set_threads(n: int | None) -> None:
    """``torch.set_num_threads(n)`` when n is given (CLI ``--threads``)."""
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"--threads={n!r} must be a positive integer")
    import torch

    torch.set_num_threads(n)


def single_stream_threads(n: int | None, device) -> int:
    """Threads for decoding one sequence on ``device`` (``k3 generate``, ``k3 chat``): ``n`` when given; else, on
    a CPU, 1 unless THREAD_ENV names a count. One stream's matmuls are small (a few rows), so threads spend more
    waiting for each other than they save, and far more when other processes share the cores: on 2 busy cores
    the tiny preset decodes ~10x faster on one thread (docs/commands.md#k3-generate). Returns the count in use."""
    import torch

    if n is None and device.type == "cpu" and not any(os.environ.get(v) for v in THREAD_ENV):
        n = 1
    set_threads(n)
    return torch.get_num_threads()
