"""The engine core in a process of its own: :class:`EngineProcess`, an :class:`AsyncEngine` whose engine runs in a
spawned child.

Why: an engine thread shares one interpreter lock with the HTTP event loop, request tokenisation and response
JSON, so under load the host work of serving slows every decode step (docs/commands.md, ``k3 serve``).
Here the child owns the model and does nothing but schedule, step and detokenise; the parent (the API server)
keeps the event loop, and two threads of its own move messages over one pipe:

- a sender: submissions (all the sequences of one HTTP request in one message), aborts, the stop request;
- a receiver: per step, the step's :class:`StepOutput` list (one message) handed to each event loop in one
  ``call_soon_threadsafe``; acceptances (or the ``ValueError`` of a request the engine refuses); failures.

The child reads its pipe between steps (without blocking while it has work, blocking while idle) and exits when
the pipe closes, so it never outlives the server. It ignores SIGINT and SIGTERM: the parent drains it
(:meth:`shutdown`). If the child dies, every request in flight ends with :class:`EngineError` and
:attr:`running` turns False (``/health`` answers 503).

    ep = EngineProcess(build_engine, (args,)).start()   # build_engine(args) -> Engine, in the child
    async for out in ep.generate(prompt_ids, SamplingParams(max_tokens=32)): ...
    ep.shutdown()
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import queue
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from k3.infer.async_engine import (
    AsyncEngine,
    EngineClosed,
    EngineError,
    _resolve,
    _Submission,
)
from k3.infer.sequence import Request, prepare_media

log = logging.getLogger("k3.infer")
STATS_EVERY_S = 0.1  # the child sends its stats with a step's outputs at most this often


@dataclass
class EngineInfo:
    """What the API side needs of the engine in the child: its limits and its vision config (to expand a prompt's
    images on the host, :meth:`prepare`)."""

    max_context: int
    max_batch: int
    device: str
    vision: Any = None

    def prepare(self, prompt: list[int], images: list):
        return prepare_media(self.vision, prompt, images)


def _error(kind: str, message: str) -> BaseException:
    return {"value": ValueError, "closed": EngineClosed}.get(kind, EngineError)(message)


def coalesce(messages: list[tuple]) -> list[tuple]:
    """``messages`` in order, consecutive ``out`` messages merged into one (their outputs and aborted ids in order,
    the latest stats): a parent that fell behind gets one message for the steps it missed."""
    merged: list[tuple] = []
    for m in messages:
        if merged and m[0] == "out" and merged[-1][0] == "out":
            _, outputs, aborted, stats = merged[-1]
            merged[-1] = ("out", outputs + m[1], aborted + m[2], m[3] if m[3] is not None else stats)
        else:
            merged.append(m)
    return merged


class _Outbox:
    """Sends the child's messages from a thread of its own, in order. A pipe whose reader falls behind blocks its
    writer: sent from the step loop, a busy API process would hold up every decode step. Here the step loop only
    queues; whatever queued while a send was under way goes out as one message (:func:`coalesce`)."""

    def __init__(self, conn):
        self.conn, self.queue = conn, queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="k3-engine-outbox", daemon=True)
        self.thread.start()

    def put(self, msg: tuple) -> None:
        self.queue.put(msg)

    def close(self, timeout: float = 30.0) -> None:
        """Send what is queued, then end the thread."""
        self.queue.put(None)
        self.thread.join(timeout)

    def _run(self) -> None:
        while True:
            batch = [self.queue.get()]
            while True:
                try:
                    batch.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            try:
                for msg in coalesce([m for m in batch if m is not None]):
                    self.conn.send(msg)
            except (EOFError, OSError):  # the parent went away: the step loop reads EOF next
                return
            if batch[-1] is None:
                return


class _Core:
    """The child's loop over one Engine: apply messages, step, queue the step's outputs (:class:`_Outbox`)."""

    def __init__(self, engine, conn):
        self.engine, self.conn = engine, conn
        self.outbox = _Outbox(conn)
        self.live: set[str] = set()
        self.aborted: list[str] = []
        self.stop_at: float | None = None
        self.steps = self.errors = 0
        self.stats_at = 0.0

    def stats(self) -> dict:
        return {**self.engine.stats(), "steps": self.steps, "errors": self.errors}

    def handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":
            _, sub_id, requests, group = msg
            if self.stop_at is not None:
                self.outbox.put(("accepted", sub_id, "closed", "the engine is shutting down"))
                return
            try:
                self.engine.add_many(requests, group)
            except ValueError as e:
                self.outbox.put(("accepted", sub_id, "value", str(e)))
                return
            except Exception as e:  # noqa: BLE001 - an engine bug: report it to the caller, keep serving
                log.exception("engine.add failed")
                self.outbox.put(("accepted", sub_id, "error", f"{type(e).__name__}: {e}"))
                return
            self.live.update(r.request_id for r in requests)
            self.outbox.put(("accepted", sub_id, None, None))
        elif kind == "abort":
            if msg[1] in self.live:
                self.live.discard(msg[1])
                self.engine.abort(msg[1])
                self.aborted.append(msg[1])
        elif kind == "stop":
            self.stop_at = time.monotonic() + max(0.0, msg[1])

    def fail_all(self, kind: str, message: str) -> None:
        for rid in self.live:
            self.engine.abort(rid)
        self.outbox.put(("failed", sorted(self.live), kind, message))
        self.live.clear()

    def run(self) -> None:
        while True:
            if not self.engine.has_work() and self.stop_at is None:
                self.handle(self.conn.recv())  # idle: sleep on the pipe
            while self.conn.poll():
                self.handle(self.conn.recv())
            if self.stop_at is not None and (time.monotonic() >= self.stop_at or not self.engine.has_work()):
                if self.live:
                    self.fail_all("closed", "the engine shut down before the request finished")
                self.outbox.put(("stopped", self.stats()))
                return
            if self.engine.has_work():
                self.step()

    def step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep serving
            log.exception("engine.step failed")
            self.errors += 1
            self.fail_all("error", f"internal engine error: {type(e).__name__}: {e}")
            return
        self.steps += 1
        for out in outputs:
            if out.finished:
                self.live.discard(out.request_id)
        now = time.monotonic()
        stats = None
        if now - self.stats_at >= STATS_EVERY_S or not self.engine.has_work():
            stats, self.stats_at = self.stats(), now
        self.outbox.put(("out", outputs, self.aborted, stats))
        self.aborted = []


def _child_main(conn, factory: Callable, args: tuple, level: int) -> None:
    """The engine process: build the engine, report ready (or the exception that stopped it), serve the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent drains us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        engine = factory(*args)
    except BaseException as e:  # noqa: BLE001 - the parent raises it
        try:
            conn.send(("start_failed", e))
        except Exception:  # noqa: BLE001 - not picklable: its text
            conn.send(("start_failed", RuntimeError(f"{type(e).__name__}: {e}")))
        return
    conn.send(("ready", EngineInfo(engine.max_context, engine.max_batch, str(engine.device), engine.vision)))
    core = _Core(engine, conn)
    try:
        core.run()
    except (EOFError, OSError):  # the parent went away
        pass
    finally:
        core.outbox.close()


class EngineProcess(AsyncEngine):
    """An :class:`AsyncEngine` whose engine, ``factory(*args)``, is built and stepped in a spawned process.
    ``self.engine`` is its :class:`EngineInfo` once :meth:`start` returned (after the model loaded)."""

    def __init__(self, factory: Callable, args: tuple = (), name: str = "k3-engine-core"):
        super().__init__(None, name)
        self._factory, self._args = factory, args
        self._proc = None
        self._conn = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[int, _Submission] = {}
        self._sub_ids = itertools.count()
        self._receiver: threading.Thread | None = None
        self._sender: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> EngineProcess:
        """Spawn the engine process and wait until its engine is built; re-raises the exception that stopped it
        (a bad checkpoint: FileNotFoundError / ValueError, as building it here would)."""
        with self._cv:
            if self._proc is not None:
                raise RuntimeError("EngineProcess already started")
            ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
            self._conn, child = ctx.Pipe()
            level = logging.getLogger().getEffectiveLevel()
            self._proc = ctx.Process(
                target=_child_main, args=(child, self._factory, self._args, level), name=self._name
            )
            self._proc.start()
        child.close()
        try:
            msg = self._conn.recv()
        except EOFError:
            self._proc.join()
            raise RuntimeError(f"the engine process exited (code {self._proc.exitcode}) before it was ready") from None
        if msg[0] == "start_failed":
            self._proc.join()
            raise msg[1]
        self.engine = msg[1]
        with self._cv:
            self._accepting = True
        self._sender = threading.Thread(target=self._send_loop, name=f"{self._name}-send", daemon=True)
        self._receiver = threading.Thread(target=self._receive_loop, name=f"{self._name}-recv", daemon=True)
        self._sender.start()
        self._receiver.start()
        return self

    @property
    def started(self) -> bool:
        return self._proc is not None

    @property
    def running(self) -> bool:
        """True while the engine process is alive and accepting requests."""
        return (
            self._accepting
            and self._proc is not None
            and self._proc.is_alive()
            and self._receiver is not None
            and self._receiver.is_alive()
        )

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting, let requests in flight finish for up to ``timeout`` seconds (those left end with
        :class:`EngineClosed`), then wait for the process to exit. Blocking; idempotent."""
        with self._cv:
            self._accepting = False
            if self._proc is None:
                return
            if self._stop_at is None:
                self._stop_at = time.monotonic() + max(0.0, timeout)
                self._outbox.put(("stop", timeout))
        if self._receiver is not None:
            self._receiver.join(max(0.0, timeout) + 60)
        self._proc.join(10)
        if self._proc.is_alive():
            log.error("the engine process did not stop; terminating it")
            self._proc.terminate()
            self._proc.join(10)
        self._outbox.put(None)

    # ------------------------------------------------------------------ requests
    def _enqueue(self, sub: _Submission) -> None:
        """Send a submission to the engine process (its acceptance comes back on the pipe)."""
        with self._cv:
            if not self.running:
                raise EngineClosed("the engine is not running (shutting down or not started)")
            sub_id = next(self._sub_ids)
            self._pending[sub_id] = sub
            self._outbox.put(
                (
                    "add",
                    sub_id,
                    [Request(r.prompt, r.params, r.request_id, r.images, r.media) for r in sub.requests],
                    sub.group,
                )
            )

    def abort(self, request_id: str) -> None:
        """Drop a request (thread-safe; a no-op for finished or unknown ids)."""
        self._outbox.put(("abort", request_id))

    def _drop(self, request_id: str) -> None:
        self._live.pop(request_id, None)
        self.abort(request_id)

    # ------------------------------------------------------------------ the pipe
    def _send_loop(self) -> None:
        while (msg := self._outbox.get()) is not None:
            try:
                self._conn.send(msg)
            except (OSError, ValueError):  # the process is gone: the receiver fails what was in flight
                if msg[0] == "add":
                    self._refuse(msg[1], EngineError("the engine process is not running"))

    def _refuse(self, sub_id: int, error: BaseException) -> None:
        with self._cv:
            sub = self._pending.pop(sub_id, None)
        if sub is not None:
            sub.accepted.get_loop().call_soon_threadsafe(_resolve, sub.accepted, error)

    def _receive_loop(self) -> None:
        clean = False
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            kind = msg[0]
            if kind == "out":
                _, outputs, aborted, stats = msg
                for rid in aborted:
                    self._live.pop(rid, None)
                self._dispatch(outputs)
                if stats is not None:
                    self._update(stats)
            elif kind == "accepted":
                _, sub_id, error, message = msg
                with self._cv:
                    sub = self._pending.pop(sub_id, None)
                if sub is None:
                    continue
                if error is None:
                    for r in sub.requests:
                        self._live[r.request_id] = r
                sub.accepted.get_loop().call_soon_threadsafe(
                    _resolve, sub.accepted, None if error is None else _error(error, message)
                )
            elif kind == "failed":
                _, rids, error, message = msg
                for rid in rids:
                    req = self._live.pop(rid, None)
                    if req is not None:
                        self._deliver(req, _error(error, message))
            elif kind == "stopped":
                self._update(msg[1])
                clean = True
                break
        with self._cv:
            self._accepting = False
            pending, self._pending = list(self._pending.values()), {}
        code = None if self._proc is None else self._proc.exitcode
        why = "the engine shut down" if clean else f"the engine process exited (code {code})"
        if not clean:
            log.error("%s; failing the requests in flight", why)
        error = EngineClosed(why) if clean else EngineError(why)
        for sub in pending:
            sub.accepted.get_loop().call_soon_threadsafe(_resolve, sub.accepted, type(error)(why))
        for req in list(self._live.values()):
            self._deliver(req, type(error)(why))
        self._live.clear()

    def _update(self, stats: dict) -> None:
        with self._cv:
            self.steps, self.errors = stats.pop("steps"), stats.pop("errors")
            self._stats = stats
