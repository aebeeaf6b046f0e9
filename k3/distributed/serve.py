"""Expert-parallel serving: ``torchrun --nproc_per_node N -m k3 serve --ckpt DIR --ep N [--placement FILE]``.

Design (the simplest correct one): every rank holds the whole model but the routed experts, and its part of those.
Attention, the router, the shared experts, the latent projections, embeddings and the LM head are replicated; which
routed experts of each MoE layer a rank holds is an :class:`k3.distributed.placement.ExpertPlacement` (``k3 plan
--placement FILE`` writes one from the expected expert loads, hot experts on several ranks; default contiguous
blocks). Each rank loads only its own experts straight from the checkpoint (k3.checkpoint.load.from_pretrained with
``experts=``; packed MXFP4 banks too): host memory while loading stays near the rank's own share, and the
checkpoint's SHA-256 checks are shared out (rank r checks every N-th shard from the r-th), every rank's outcome
agreed before serving starts (a bad shard, or any load error on any rank, is one error naming the rank).
Every rank runs the same engine step on the same tokens; in each MoE layer a rank computes its local experts'
weighted contribution for all the step's tokens ([T, D] in fp32, zero for tokens that chose none of its experts;
a replicated expert's tokens split between its replicas by token index) and one all-reduce per MoE layer sums them
(:class:`AllReduceExperts`). At decode batch sizes T is small, so one all-reduce of [T, D] costs less than the two
all-to-alls (counts, then rows, each way) that training's dispatch needs, and every rank already has every token;
whether that holds at large prefills is to be measured on GPUs (only CPU with gloo is tested).

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
    engine = Engine(shard_experts(model, meshes, placement), tokenizer, ...)  # the same arguments everywhere
    if dist.get_rank() == 0:
        lockstep = LockstepEngine(engine, control)                     # use as the Engine (or in an AsyncEngine)
        outputs = lockstep.generate(prompts, params)
        lockstep.close()
    else:
        follow(engine, control)

``model`` may hold every expert (it is cut here) or, loaded with ``experts=rank_experts(placement, config, rank)``,
only this rank's.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import logging
import os
import threading
import time

import torch
import torch.distributed as dist
from torch import Tensor

from k3.distributed.expert_parallel import CommStats, local_experts
from k3.distributed.mesh import Meshes, ParallelDims, build_mesh
from k3.distributed.placement import ExpertPlacement, contiguous, read_placement
from k3.infer.async_engine import EngineStopped
from k3.infer.engine import Engine
from k3.infer.sequence import Request
from k3.model.moe import MoE, keep_experts, moe_layers
from k3.ops.dtypes import upcast

log = logging.getLogger("k3.serve")
DEFAULT_TIMEOUT_S = 60.0
LOAD_TIMEOUT_S = 1800.0  # how long a rank that has loaded waits for the slowest (loading takes minutes at scale)


class AllReduceExperts:
    """``MoE.expert_dispatch`` for serving: every rank sees all the step's tokens, computes its local experts'
    part of ``sum_j p_tj E_j(z_t)`` (fp32) and one all-reduce over the EP group sums the parts. ``slot``,
    ``replica``, ``replicas`` [E] (:meth:`ExpertPlacement.tables`) say which (token, expert) pairs are this rank's:
    its experts' slots in its bank, and for an expert on n ranks the tokens t with t mod n == its replica index.
    The local experts run as in training's dispatch (:func:`local_experts`: plain or packed MXFP4 banks)."""

    def __init__(self, group, rank: int, slot: Tensor, replica: Tensor, replicas: Tensor, stats: CommStats):
        self.group, self.ep_rank, self.stats = group, rank, stats
        self.slot, self.replica, self.replicas = slot, replica, replicas
        self.num_experts, self.num_local = slot.numel(), int((slot >= 0).sum())
        self.last_send_counts = None

    def __call__(self, moe: MoE, z: Tensor, topk_idx: Tensor, topk_weight: Tensor) -> Tensor:
        n, k = topk_idx.shape
        flat = topk_idx.reshape(-1)
        token = torch.arange(n * k, device=z.device) // k
        slot = self.slot[flat]
        keep = (slot >= 0) & (token % self.replicas[flat] == self.replica[flat])
        pos = keep.nonzero().squeeze(1)  # (token, slot) pairs computed here
        token = token.index_select(0, pos)
        out = local_experts(moe, z.index_select(0, token), slot.index_select(0, pos))
        weight = upcast(topk_weight.reshape(-1).index_select(0, pos)).unsqueeze(-1)
        y = torch.zeros(n, z.shape[-1], dtype=torch.promote_types(z.dtype, torch.float32), device=z.device)
        y = y.index_add(0, token, upcast(out) * weight)
        with self.stats.timed(z.device):
            dist.all_reduce(y, group=self.group)
        self.stats.rows_received += pos.numel()
        return y.to(z.dtype)


def shard_experts(model, meshes: Meshes, placement: ExpertPlacement | None = None):
    """Hold this rank's routed experts of every MoE layer (``placement``, default contiguous blocks) and sum the
    layers' outputs with one all-reduce (:class:`AllReduceExperts`). A layer holding every expert is cut here; one
    loaded with part of them (``expert_ids``, k3.model.moe.keep_experts) must hold exactly this rank's. In place,
    on the built (loaded) model; returns it."""
    layers = moe_layers(model)
    if not layers:
        raise ValueError("expert parallelism needs a model with MoE layers; this one has none")
    mesh = meshes.ep
    group, rank, ep = mesh.get_group(), mesh.get_local_rank(), mesh.size()
    e = layers[0].gate.weight.shape[0]
    placement = placement or contiguous(len(layers), e, ep)
    placement.check(len(layers), e, ep)
    stats = CommStats()
    for i, moe in enumerate(layers):
        if moe.expert_dispatch is not None:
            raise ValueError(f"MoE layer {moe.layer_idx} already has an expert dispatch (EP applied twice?)")
        ids = placement.layers[i][rank]
        held = getattr(moe.experts, "expert_ids", None)
        if held is None:
            keep_experts(moe, ids)
        elif tuple(held) != tuple(ids):
            raise ValueError(
                f"MoE layer {moe.layer_idx} holds experts {list(held)[:8]}, but the placement gives rank {rank} "
                f"{list(ids)[:8]}"
            )
        tables = placement.tables(i, rank, moe.gate.weight.device)
        moe.expert_dispatch = AllReduceExperts(group, rank, *tables, stats)
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
                raise EngineStopped(self.failed) from e

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
            raise RuntimeError(f"rank {rank} lost rank 0 or another rank: {type(e).__name__}: {e}") from None
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


def rank_experts(placement: ExpertPlacement, config, rank: int) -> dict[int, list[int]]:
    """``{decoder layer index: the experts rank ``rank`` holds}`` of ``config``'s MoE layers under ``placement``
    (what k3.checkpoint.load.from_pretrained's ``experts=`` takes)."""
    return {idx: list(placement.layers[i][rank]) for i, idx in enumerate(config.moe_layers)}


def _build_rank(args, meshes: Meshes, build_engine) -> tuple:
    """This rank's (engine, tokenizer, path): a checkpoint's experts under ``--placement`` (default contiguous)
    loaded straight from it, its SHA-256 checks shared with the other ranks; a ``--random`` model's cut after
    building."""
    rank = dist.get_rank()
    placement = read_placement(args.placement) if args.placement else None
    options = {}
    if args.ckpt is not None:
        from k3.checkpoint.format import read_config, resolve_checkpoint

        path = resolve_checkpoint(args.ckpt)
        config = read_config(path)
        moe = len(config.moe_layers)
        if not moe or config.moe is None:
            raise ValueError("expert parallelism needs a model with MoE layers; this one has none")
        placement = placement or contiguous(moe, config.moe.num_experts, args.ep, config.name)
        placement.check(moe, config.moe.num_experts, args.ep)
        options = {"experts": rank_experts(placement, config, rank), "checksum_part": (rank, args.ep)}
        args = copy.copy(args)
        args.ckpt = str(path)  # the checkpoint a run directory names now; the ranks' are compared after loading
    return build_engine(args, prepare_model=lambda m: shard_experts(m, meshes, placement), load_options=options)


def load_rank(args, meshes: Meshes, build_engine, group) -> tuple | None:
    """:func:`_build_rank`, its outcome agreed with every rank on ``group``: the built tuple when every rank loaded
    the same checkpoint; else one ValueError on rank 0 naming the first rank that failed and why, None on the
    others (which then end quietly). A rank lost while loading: RuntimeError."""
    built, error = None, None
    try:
        built = _build_rank(args, meshes, build_engine)
    except Exception as e:  # noqa: BLE001 - told to every rank below, reported once by rank 0
        error = str(e) if isinstance(e, (ValueError, FileNotFoundError)) else f"{type(e).__name__}: {e}"
    outcomes = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(outcomes, (error, None if built is None else str(built[2])), group=group)
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(f"rank {dist.get_rank()} lost another rank while loading: {type(e).__name__}: {e}") from None
    failed = [(r, err) for r, (err, _) in enumerate(outcomes) if err is not None]
    paths = sorted({p for _, p in outcomes if p is not None})
    if not failed and len(paths) > 1:
        failed = [(0, f"the ranks loaded different checkpoints ({', '.join(paths)}): one was written meanwhile")]
    if not failed:
        return built
    if dist.get_rank() == 0:
        (r, err), more = failed[0], [str(r) for r, _ in failed[1:]]
        also = f" (rank{'s' if len(more) > 1 else ''} {', '.join(more)} failed too)" if more else ""
        raise ValueError(f"rank {r}: {err}{also}")
    return None


def serve_expert_parallel(args, serve_http, build_engine) -> int:
    """``k3 serve --ep N`` on this rank (under torchrun): the group, this rank's model (its experts only) and
    engine, then on rank 0 ``serve_http(async_engine, tokenizer, path)`` over a :class:`LockstepEngine` in an
    AsyncEngine thread, and :func:`follow` on the others. ``build_engine(args, prepare_model, load_options)`` is
    k3.cli.serve's. Returns the exit status; a failed group is one error line on stderr and status 1; a rank that
    fails to load is one error on rank 0 (raised) and status 1 on the others."""
    import signal
    import sys

    from k3.infer.async_engine import AsyncEngine
    from k3.infer.load import resolve_device

    device = resolve_device(args.device).type
    meshes, control = init_serving(args.ep, args.ep_timeout, device)
    rank = dist.get_rank()
    timeout = datetime.timedelta(seconds=max(args.ep_timeout, LOAD_TIMEOUT_S))
    loading = dist.new_group(backend="gloo", timeout=timeout)
    try:
        built = load_rank(args, meshes, build_engine, loading)
    except RuntimeError as e:
        print(f"k3 serve: error: {e}", file=sys.stderr)
        return 1
    if built is None:
        return 1
    engine, tokenizer, path = built
    held = [len(m.experts.expert_ids) for m in moe_layers(engine.model)]
    log.info("rank %d of %d: %d to %d routed experts of each MoE layer", rank, args.ep, min(held), max(held))
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
