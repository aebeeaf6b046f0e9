"""Expert-parallel serving: ``torchrun --nproc_per_node N -m k3 serve --ckpt DIR --ep N``.

Design (the simplest correct one): every rank holds the whole model but the routed experts, and 1/N of those.
Attention, the router, the shared experts, the latent projections, embeddings and the LM head are replicated;
rank ``r`` keeps experts [r * E/N, (r + 1) * E/N) of every MoE layer (the training path's sharding,
:func:`k3.distributed.expert_parallel.apply_expert_parallel`, applied to the built model; the model files are
unchanged). Every rank runs the same engine step on the same tokens; in each MoE layer a rank computes its local
experts' weighted contribution for all the step's tokens ([T, D] in fp32, zero for tokens that chose none of its
experts) and one all-reduce per MoE layer sums them (:class:`AllReduceExperts`). At decode batch sizes T is small,
so one all-reduce of [T, D] costs less than the two all-to-alls (counts, then rows, each way) that training's
dispatch needs, and every rank already has every token; whether that holds at large prefills is to be measured on
GPUs (only CPU with gloo is tested).

Lockstep: the engine's steps must be identical on every rank. Rank 0 owns the scheduler's inputs: it wraps its
:class:`k3.infer.engine.Engine` in :class:`LockstepEngine`, which records every request added (its full
``SamplingParams``, with an explicit seed drawn on rank 0 where the request gave none, so sampling is identical
everywhere; images already expanded into prepared media) and every abort, and before each step broadcasts them
on a gloo control group. Followers (:func:`follow`) apply them to their own engine, in order, and call
``step()``; only rank 0's outputs go to clients. While idle, rank 0 sends a heartbeat every ``timeout / 3``
seconds, so an idle follower's wait never reaches the process group's timeout. Shutdown: rank 0 drains as one
process does, then broadcasts "stop". Failure: any exception in a step or a collective on any rank is fatal (the
ranks' states can no longer be trusted to agree): a follower exits with an error, rank 0 fails the requests in
flight, refuses new ones and ends the server; a rank that vanishes is noticed by the others' next collective
(at once where the connection drops, else after the timeout).

With ``--ep`` the engine runs in a thread of rank 0's server process (``--engine process`` is refused), and decode
steps run eagerly (no CUDA graphs: the local-expert selection reads its row count on the host).

From Python, on every rank (under torchrun)::

    meshes, control = init_serving(n)
    engine = Engine(shard_experts(model, meshes), tokenizer, ...)    # the same model and arguments everywhere
    if dist.get_rank() == 0:
        lockstep = LockstepEngine(engine, control)                     # use as the Engine (or in an AsyncEngine)
        outputs = lockstep.generate(prompts, params)
        lockstep.close()
    else:
        follow(engine, control)

Memory: each rank loads the whole checkpoint, then keeps its shard (the rest of every expert stack is freed right
after loading): the peak is the whole model on every rank, the steady state its shard plus the replicated weights.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import threading
import time

import torch
import torch.distributed as dist
from torch import Tensor

from k3.distributed.expert_parallel import LatentAllToAll, apply_expert_parallel
from k3.distributed.mesh import Meshes, ParallelDims, build_mesh
from k3.infer.engine import Engine
from k3.infer.sequence import Request
from k3.model.moe import MoE, moe_layers
from k3.ops.dtypes import upcast

log = logging.getLogger("k3.serve")
DEFAULT_TIMEOUT_S = 60.0


class AllReduceExperts(LatentAllToAll):
    """``MoE.expert_dispatch`` for serving: every rank sees all the step's tokens, computes its local experts'
    part of ``sum_j p_tj E_j(z_t)`` (fp32) and one all-reduce over the EP group sums the parts. The local experts
    run as in training's dispatch (:meth:`LatentAllToAll._local_experts`: plain, QAT or packed MXFP4 banks)."""

    def __call__(self, moe: MoE, z: Tensor, topk_idx: Tensor, topk_weight: Tensor) -> Tensor:
        n, k = topk_idx.shape
        lo = self.ep_rank * self.num_local
        flat = topk_idx.reshape(-1)
        pos = ((flat >= lo) & (flat < lo + self.num_local)).nonzero().squeeze(1)  # (token, slot) pairs kept here
        token = pos // k
        out = self._local_experts(moe, z.index_select(0, token), flat.index_select(0, pos) - lo)
        weight = upcast(topk_weight.reshape(-1).index_select(0, pos)).unsqueeze(-1)
        y = torch.zeros(n, z.shape[-1], dtype=torch.promote_types(z.dtype, torch.float32), device=z.device)
        y = y.index_add(0, token, upcast(out) * weight)
        with self.stats.timed(z.device):
            dist.all_reduce(y, group=self.group)
        self.stats.rows_received += pos.numel()
        self.last_send_counts = None
        return y.to(z.dtype)


def shard_experts(model, meshes: Meshes):
    """Keep this rank's E/ep routed experts of every MoE layer and sum the layers' outputs with one all-reduce
    (:class:`AllReduceExperts`). In place, on the built (loaded) model, identical on every rank; returns it."""
    if not moe_layers(model):
        raise ValueError("expert parallelism needs a model with MoE layers; this one has none")
    apply_expert_parallel(model, meshes)
    for moe in moe_layers(model):
        d = moe.expert_dispatch
        if d is not None:
            moe.expert_dispatch = AllReduceExperts(d.group, d.ep_size, d.ep_rank, d.num_experts, d.stats)
    return model


def init_serving(ep: int, timeout_s: float = DEFAULT_TIMEOUT_S, device: str = "cpu") -> tuple[Meshes, object]:
    """(meshes, control group) for ``ep`` ranks: the default process group (nccl on CUDA, gloo on a CPU) with a
    ``timeout_s`` timeout, unless one exists, the mesh (dp = ep = world) and a gloo group for the lockstep
    messages (host objects, sent from any thread). Call on every rank (under torchrun, or with the group made)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ValueError(f"--ep={ep} runs under torchrun --nproc-per-node {ep} (RANK / WORLD_SIZE are not set)")
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=timeout)
    world = dist.get_world_size()
    if ep != world:
        raise ValueError(f"--ep={ep} must equal the number of processes ({world}; torchrun --nproc-per-node)")
    meshes = build_mesh(ParallelDims(dp=ep, ep=ep), device)
    return meshes, dist.new_group(backend="gloo", timeout=timeout)


def _broadcast(message, group):
    """Rank 0's ``message`` on every rank of ``group`` (a picklable host object; others pass None)."""
    box = [message]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


class LockstepEngine:
    """Rank 0's engine under expert parallelism: an :class:`Engine` whose adds and aborts are recorded and sent
    to the other ranks before each step (see the module docstring). Other attributes are the engine's.

    ``on_failure(message)`` is called once when the group fails (a collective or a step raised); the engine then
    refuses requests and reports no work. ``close()`` tells the followers to stop (call once, after draining)."""

    add = Engine.add
    generate = Engine.generate

    def __init__(self, engine: Engine, group, timeout_s: float = DEFAULT_TIMEOUT_S, on_failure=None):
        self.engine, self.group = engine, group
        self.failed: str | None = None
        self.on_failure = on_failure
        self._changes: list[tuple] = []
        self._lock = threading.Lock()  # one control message at a time: a step's, or a heartbeat
        self._last_sent = time.monotonic()
        self._closed = threading.Event()
        self._heartbeat = threading.Thread(
            target=self._beat, args=(max(0.05, timeout_s / 3),), name="k3-ep-heartbeat", daemon=True
        )
        self._heartbeat.start()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def _check(self) -> None:
        if self.failed is not None:
            raise RuntimeError(f"expert-parallel serving stopped: {self.failed}")
        if self._closed.is_set():
            raise RuntimeError("expert-parallel serving is closed")

    def add_many(self, requests: list[Request], group: str | None = None) -> list[str]:
        """Engine.add_many, recorded for the followers: each request with an explicit seed and its images
        expanded to prepared media (the followers get the same prompt, params and pixels)."""
        self._check()
        ready = []
        for i, r in enumerate(requests):
            params = r.params
            if params.seed is None:
                params = dataclasses.replace(params, seed=params.draw_seed())
            prompt, media = r.prompt, r.media
            if r.images and media is None:
                try:
                    prompt, media = self.engine.prepare(prompt, r.images)
                except ValueError as e:
                    raise ValueError(f"choice {i}: {e}" if len(requests) > 1 else str(e)) from None
            ready.append(Request(list(prompt), params, r.request_id, None, media))
        ids = self.engine.add_many(ready, group)
        sent = [dataclasses.replace(r, request_id=rid) for r, rid in zip(ready, ids)]
        self._changes.append(("add", sent, group or ids[0]))
        return ids

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._changes.append(("abort", request_id))

    def has_work(self) -> bool:
        return self.failed is None and self.engine.has_work()

    def step(self):
        self._check()
        with self._lock:
            changes, self._changes = self._changes, []
            try:
                _broadcast(("step", changes), self.group)
                self._last_sent = time.monotonic()
                return self.engine.step()
            except Exception as e:
                self._fail(f"a step failed on rank 0 or lost another rank: {type(e).__name__}: {e}")
                raise

    def _fail(self, message: str) -> None:
        if self.failed is None:
            self.failed = message
            log.error("k3 serve --ep: %s", message)
            if self.on_failure is not None:
                self.on_failure(message)

    def _beat(self, interval: float) -> None:
        while not self._closed.wait(interval / 4):
            with self._lock:
                if self._closed.is_set() or self.failed is not None:
                    return
                if time.monotonic() - self._last_sent < interval:
                    continue
                try:
                    _broadcast(("idle",), self.group)
                except Exception as e:  # noqa: BLE001 - a lost rank ends the server
                    self._fail(f"lost another rank while idle: {type(e).__name__}: {e}")
                    return
                self._last_sent = time.monotonic()

    def close(self) -> None:
        """Stop the heartbeat and tell the followers to stop (nothing is sent after a failure). Idempotent."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            if self.failed is None:
                try:
                    _broadcast(("stop",), self.group)
                except Exception as e:  # noqa: BLE001
                    self._fail(f"could not stop the other ranks: {type(e).__name__}: {e}")
        self._heartbeat.join()


def follow(engine: Engine, group, on_outputs=None) -> int:
    """A follower rank's loop: receive rank 0's changes, apply them to ``engine`` in order, step; until "stop".
    ``on_outputs(outputs)`` sees each step's outputs (they go nowhere else). Returns the steps run; raises
    RuntimeError (naming this rank) when rank 0 is lost or a step fails."""
    rank, steps = dist.get_rank(), 0
    while True:
        try:
            message = _broadcast(None, group)
        except Exception as e:
            raise RuntimeError(f"rank {rank} lost rank 0: {type(e).__name__}: {e}") from None
        kind = message[0]
        if kind == "stop":
            return steps
        if kind == "idle":
            continue
        try:
            for change in message[1]:
                if change[0] == "add":
                    engine.add_many(change[1], change[2])
                else:
                    engine.abort(change[1])
            outputs = engine.step()
        except Exception as e:
            raise RuntimeError(f"rank {rank}: step {steps} failed: {type(e).__name__}: {e}") from None
        steps += 1
        if on_outputs is not None:
            on_outputs(outputs)


def serve_expert_parallel(args, serve_http, build_engine) -> int:
    """``k3 serve --ep N`` on this rank (under torchrun): the group, the sharded model and engine (identical on
    every rank), then on rank 0 ``serve_http(async_engine, tokenizer, path)`` over a :class:`LockstepEngine` in an
    AsyncEngine thread, and :func:`follow` on the others. Returns the exit status; a failed group is one error line
    on stderr and status 1."""
    import signal
    import sys

    from k3.infer.async_engine import AsyncEngine
    from k3.infer.load import resolve_device

    device = resolve_device(args.device).type
    meshes, control = init_serving(args.ep, args.ep_timeout, device)
    rank = dist.get_rank()
    engine, tokenizer, path = build_engine(args, prepare_model=lambda model: shard_experts(model, meshes))
    log.info("rank %d of %d: routed experts %d..%d of every MoE layer", rank, args.ep, *_local_range(engine.model))
    if rank != 0:
        # torchrun passes SIGINT / SIGTERM to every rank: a follower keeps stepping while rank 0 drains, and
        # stops when rank 0 says so (or is lost)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: log.info("rank %d: stopping when rank 0 has drained", rank))
        try:
            follow(engine, control)
        except RuntimeError as e:
            print(f"k3 serve: error: {e}", file=sys.stderr)
            return 1
        dist.destroy_process_group()
        return 0
    from k3.ops.kernel_plan import plan_report

    print(plan_report(engine.device, args.verbose), flush=True)
    lock = LockstepEngine(
        engine, control, args.ep_timeout, on_failure=lambda _: os.kill(os.getpid(), signal.SIGTERM)
    )  # SIGTERM: uvicorn's graceful shutdown, then the error below
    async_engine = AsyncEngine(lock).start()
    try:
        serve_http(async_engine, tokenizer, path)
    finally:
        async_engine.shutdown(0)
        lock.close()
    if lock.failed is not None:
        print(f"k3 serve: error: expert-parallel group failed: {lock.failed}", file=sys.stderr)
        return 1
    dist.destroy_process_group()
    return 0


def _local_range(model) -> tuple[int, int]:
    """[lo, hi) of the routed experts this rank holds (those of the first MoE layer; every layer has as many)."""
    d = next(m.expert_dispatch for m in moe_layers(model) if m.expert_dispatch is not None)
    return d.ep_rank * d.num_local, (d.ep_rank + 1) * d.num_local
