"""Run a function on N local processes with gloo (forked, so closures and test-module functions work). The ranks
meet through a FileStore in a fresh temporary folder, not a TCP port: a port picked free and bound later by rank 0
can be taken in between (a suspect for one unexplained failure of a DCP test in a combined run)."""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from queue import Empty

import torch.multiprocessing as mp


def _worker(rank, world, store, fn, args, queue):
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), K3_DIST_DEVICE="cpu")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        # init returns on one rank while another may still be finishing its gloo handshake; a rank that then
        # failed fast and exited would make the other's init fail ("Connection closed by peer"), and that
        # collateral error could reach the parent first. After this barrier every rank is fully connected.
        dist.barrier()
        payload = pickle.dumps(fn(rank, world, *args))  # here, not in the queue's feeder thread: errors reported
        queue.put((rank, "ok", payload))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(world: int, fn, *args, timeout: float = 300.0, killed: tuple[int, ...] = ()) -> list:
    """fn(rank, world, *args) on ``world`` processes; returns the per-rank results (must be picklable) in rank
    order, or raises with the first failing rank's traceback; a rank that dies without reporting, or ranks that
    report nothing for ``timeout`` seconds (a hung collective), fail the call instead of hanging the suite. The
    ranks in ``killed`` may instead die of SIGKILL (the test kills them): their result is then None."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    folder = tempfile.mkdtemp(prefix="k3-dist-")
    store = os.path.join(folder, "store")
    procs = [ctx.Process(target=_worker, args=(r, world, store, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        while len(results) < world:
            waited, status = 0.0, None
            while True:
                try:
                    rank, status, value = queue.get(timeout=1.0)
                    break
                except Empty:
                    waited += 1.0
                    for r in killed:
                        if r not in results and procs[r].exitcode == -signal.SIGKILL:
                            results[r] = None
                    if len(results) == world:
                        break
                    dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
                    if dead:
                        raise RuntimeError(
                            f"rank {dead[0]} died (exit code {procs[dead[0]].exitcode}) without reporting"
                        ) from None
                    if waited >= timeout:
                        raise TimeoutError(f"no rank reported for {timeout:.0f} s (ranks done: {sorted(results)})")
            if status == "error":
                raise RuntimeError(_failures({rank: value}, queue, world, len(results)))
            if status == "ok":
                results[rank] = pickle.loads(value)
    finally:
        if len(results) < world:
            for p in procs:
                p.kill()
        for p in procs:
            p.join(timeout)
        shutil.rmtree(folder, ignore_errors=True)
    return [results[r] for r in range(world)]


def _failures(errors: dict, queue, world: int, done: int, grace: float = 10.0) -> str:
    """Every failing rank's traceback: after the first error, the other ranks' reports for up to ``grace`` seconds.
    A rank that fails can make another's collective fail ("Connection reset by peer"), and the collateral report
    can arrive first; the cause is then among the others."""
    deadline = time.monotonic() + grace
    while len(errors) + done < world and time.monotonic() < deadline:
        try:
            rank, status, value = queue.get(timeout=max(0.0, deadline - time.monotonic()))
        except Empty:
            break
        if status == "error":
            errors[rank] = value
        else:
            done += 1
    return "\n".join(f"rank {r} failed:\n{tb}" for r, tb in errors.items())
