"""The multi-process harness itself: results in rank order, every failing rank's traceback, and a hung or dead
rank fails the call quickly instead of hanging the suite."""

from __future__ import annotations

import os
import time

import pytest

from tests.distributed.spawn import run


def _rank_times_ten(rank, world):
    return rank * 10


def _rank_one_hangs(rank, world):
    if rank == 1:
        time.sleep(60)
    return rank


def _rank_one_dies(rank, world):
    if rank == 1:
        os._exit(3)
    time.sleep(30)
    return rank


def _both_fail_rank_zero_later(rank, world):
    time.sleep(1.0 if rank == 0 else 0.0)  # rank 1's (collateral) report comes first
    raise ValueError(f"cause on rank {rank}")


def test_every_failing_rank_is_reported():
    """The first report to arrive need not hold the cause: the other ranks' tracebacks are collected too."""
    with pytest.raises(
        RuntimeError, match="rank 1 failed(.|\n)*cause on rank 1(.|\n)*rank 0 failed(.|\n)*cause on rank 0"
    ):
        run(2, _both_fail_rank_zero_later, timeout=25)


def test_results_in_rank_order():
    assert run(2, _rank_times_ten) == [0, 10]


def test_a_hung_rank_times_out():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="no rank reported for 3 s"):
        run(2, _rank_one_hangs, timeout=3)
    assert time.monotonic() - start < 15


def test_a_dead_rank_is_reported():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 died"):
        run(2, _rank_one_dies, timeout=25)
    assert time.monotonic() - start < 15


def test_an_unpicklable_result_is_reported_at_once():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank [01] failed(.|\n)*Can't pickle"):
        run(2, lambda rank, world: lambda: rank, timeout=25)
    assert time.monotonic() - start < 15
