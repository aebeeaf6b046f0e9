"""An asyncio front for :class:`k3.infer.engine.Engine`: one background thread owns the engine.

The thread is the only code that touches the engine or the model. Callers on any event loop submit requests
and aborts through a lock-protected inbox and get each request's :class:`StepOutput` deltas through its own
``asyncio.Queue``; a step's outputs reach each event loop in one ``loop.call_soon_threadsafe`` call. All the
sequences of one HTTP request (its prompts and choices) go in one inbox message (:meth:`AsyncEngine.submit_many`)
and are added in one step, all or none. A reader that falls behind gets the deltas waiting for it merged into one
(:func:`merge`), so a slow consumer costs one event per read, not one per token. The thread sleeps on a condition
variable while there is nothing to do.

    ae = AsyncEngine(engine).start()
    async for out in ae.generate(prompt_ids, SamplingParams(max_tokens=32)):
        print(out.text, end="")
    ae.shutdown()

``engine.add`` errors (bad parameters, a prompt too long) reach the caller as ``ValueError``; a request the engine
ended with an error of its own (``StepOutput.error``) ends with :class:`EngineError` alone; an exception in
``engine.step`` fails the requests in flight with :class:`EngineError` and the thread keeps serving (an
:class:`EngineStopped` one is not logged again: the engine reported it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from k3.infer.engine import Request, StepOutput
from k3.infer.sampling import SamplingParams

log = logging.getLogger("k3.infer")


class EngineError(RuntimeError):
    """The engine failed while running a request (an internal error, not the request's fault)."""


class EngineClosed(RuntimeError):
    """The engine is shutting down or stopped: no new requests; requests still running when it stops end so."""


class EngineStopped(RuntimeError):
    """Raised by ``engine.step`` when the engine can no longer run and has reported why where it failed (an
    expert-parallel group that lost a rank, k3.distributed.serve): the requests in flight fail with its message,
    which is not logged again."""


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    images: list | None = None  # image bytes / paths for the prompt's media placeholders
    media: object = None  # or the images already prepared (Engine.prepare), the prompt expanded


@dataclass
class _Submission:
    """One inbox message: the sequences of one request, added together (``accepted`` resolves once)."""

    requests: list[_Request]
    group: str
    accepted: asyncio.Future


def merge(outputs: list[StepOutput]) -> StepOutput:
    """Consecutive deltas of one request as one: texts and tokens joined, log-probabilities concatenated, the
    prompt's from the first that has them, the rest (counts, finish) from the last."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    lps = [o.logprobs for o in outputs if o.logprobs is not None]
    prompt = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None)
    return dataclasses.replace(
        last,
        token_ids=[t for o in outputs for t in o.token_ids],
        text="".join(o.text for o in outputs),
        logprobs=None if not lps else [e for part in lps for e in part],
        prompt_logprobs=prompt,
    )


def _put_all(items: list) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _resolve(fut: asyncio.Future, error: BaseException | None) -> None:
    if not fut.done():
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)


class RequestStream:
    """The outputs of one submitted request: ``async for out in stream``; ``await stream.aclose()`` aborts it
    if it has not finished (also done when the iteration is abandoned)."""

    def __init__(self, owner: AsyncEngine, request: _Request):
        self._owner, self._req, self.finished = owner, request, False
        self.request_id = request.request_id

    def __aiter__(self) -> AsyncIterator[StepOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[StepOutput]:
        queue = self._req.queue
        try:
            while not self.finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                ready = [item]  # and every delta already waiting, up to an error (raised on the next read)
                while not ready[-1].finished and not queue.empty():
                    nxt = queue.get_nowait()
                    if isinstance(nxt, BaseException):
                        queue.put_nowait(nxt)  # nothing else is queued behind an error
                        break
                    ready.append(nxt)
                item = merge(ready)
                self.finished = item.finished
                yield item
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


class AsyncEngine:
    """Runs ``engine.step()`` in one background thread; thread-safe submission from asyncio code."""

    def __init__(self, engine, name: str = "k3-engine"):
        self.engine = engine
        self._name = name
        self._cv = threading.Condition()
        self._inbox: list[_Submission] = []
        self._aborts: list[str] = []
        self._live: dict[str, _Request] = {}  # owned by the engine thread
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._stop_at: float | None = None  # monotonic deadline once shutdown() began
        self._ids = itertools.count()
        self._stats: dict = {"running": 0, "waiting": 0}
        self.steps = 0
        self.errors = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> AsyncEngine:
        with self._cv:
            if self._thread is not None:
                raise RuntimeError("AsyncEngine already started")
            self._accepting = True
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        return self

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def running(self) -> bool:
        """True while the engine thread is alive and accepting requests."""
        return self._accepting and self._thread is not None and self._thread.is_alive()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting, let requests in flight finish for up to ``timeout`` seconds, abort what is left (its
        streams end with :class:`EngineClosed`) and join the thread. Blocking; idempotent."""
        with self._cv:
            self._accepting = False
            if self._thread is None:
                return
            if self._stop_at is None:
                self._stop_at = time.monotonic() + max(0.0, timeout)
            self._cv.notify_all()
        self._thread.join()

    # ------------------------------------------------------------------ requests
    async def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        images: list | None = None,
        media=None,
    ) -> RequestStream:
        """Queue a request (``images``: one per media placeholder, or ``media`` from Engine.prepare; see
        Engine.add); returns once the engine accepted it. ValueError if the engine refuses it, EngineClosed if
        shutting down."""
        return (await self.submit_many([Request(prompt_ids, params, request_id, images, media)]))[0]

    async def submit_many(self, requests: list[Request], group: str | None = None) -> list[RequestStream]:
        """Queue several sequences in one message (Engine.add_many: all or none, one admission group); returns
        their streams once the engine accepted them all. ValueError if it refuses one, EngineClosed if shutting
        down; cancelled while waiting, it aborts whatever was added."""
        loop = asyncio.get_running_loop()
        reqs = [
            _Request(
                r.request_id or f"areq-{next(self._ids)}",
                list(r.prompt),
                r.params,
                loop,
                asyncio.Queue(),
                r.images,
                r.media,
            )
            for r in requests
        ]
        sub = _Submission(reqs, group or reqs[0].request_id, loop.create_future())
        self._enqueue(sub)
        try:
            await sub.accepted
        except asyncio.CancelledError:
            for r in reqs:
                self.abort(r.request_id)  # queued after the add, so the thread drops them if they were added
            raise
        return [RequestStream(self, r) for r in reqs]

    def _enqueue(self, sub: _Submission) -> None:
        """Hand a submission to the engine's thread; EngineClosed if it is not running."""
        with self._cv:
            if not self._accepting or self._thread is None or not self._thread.is_alive():
                raise EngineClosed("the engine is not running (shutting down or not started)")
            self._inbox.append(sub)
            self._cv.notify()

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[StepOutput]:
        """Submit and yield the request's :class:`StepOutput` deltas until the one with ``finished``. Closing
        or cancelling the iteration early aborts the request."""
        stream = await self.submit(prompt_ids, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def abort(self, request_id: str) -> None:
        """Drop a request (thread-safe; a no-op for finished or unknown ids)."""
        with self._cv:
            self._aborts.append(request_id)
            self._cv.notify()

    def stats(self) -> dict:
        """The engine's stats as of its last step, plus the thread's counters."""
        with self._cv:
            return {**self._stats, "steps": self.steps, "errors": self.errors, "accepting": self.running}

    # ------------------------------------------------------------------ the engine thread
    def _deliver(self, req: _Request, item) -> bool:
        try:
            req.loop.call_soon_threadsafe(req.queue.put_nowait, item)
            return True
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            return False

    def _take_inbox(self) -> tuple[list[_Submission], list[str], bool]:
        with self._cv:
            while not (self._inbox or self._aborts or self.engine.has_work() or self._stop_at is not None):
                self._cv.wait()
            inbox, aborts = self._inbox, self._aborts
            self._inbox, self._aborts = [], []
            stopping = self._stop_at is not None and (
                time.monotonic() >= self._stop_at or not (inbox or self.engine.has_work())
            )
            return inbox, aborts, stopping

    def _run(self) -> None:
        while True:
            try:
                if self._iteration():
                    break
            except Exception:  # noqa: BLE001 - a bug outside step(): fail what is in flight, keep the thread
                log.exception("engine thread error")
                self._fail_all(EngineError("internal engine error"))
        with self._cv:
            self._stats = self.engine.stats()
            for sub in self._inbox:  # submitted while stopping (cannot happen after _accepting=False, but be safe)
                sub.accepted.get_loop().call_soon_threadsafe(
                    _resolve, sub.accepted, EngineClosed("the engine shut down")
                )
            self._inbox = []

    def _iteration(self) -> bool:
        """Admit submissions, apply aborts, run one step; True when the thread should end."""
        inbox, aborts, stopping = self._take_inbox()
        for sub in inbox:
            loop = sub.accepted.get_loop()
            try:
                self.engine.add_many(
                    [Request(r.prompt, r.params, r.request_id, r.images, r.media) for r in sub.requests], sub.group
                )
            except ValueError as e:
                loop.call_soon_threadsafe(_resolve, sub.accepted, ValueError(str(e)))
                continue
            except Exception as e:  # noqa: BLE001 - an engine bug: report it to the caller, keep serving
                log.exception("engine.add failed")
                loop.call_soon_threadsafe(_resolve, sub.accepted, EngineError(f"{type(e).__name__}: {e}"))
                continue
            for r in sub.requests:
                self._live[r.request_id] = r
            loop.call_soon_threadsafe(_resolve, sub.accepted, None)
        for rid in aborts:
            if self._live.pop(rid, None) is not None:
                self.engine.abort(rid)
        if stopping:
            self._fail_all(EngineClosed("the engine shut down before the request finished"))
            return True
        if self.engine.has_work():
            self._step()
        with self._cv:
            self._stats = self.engine.stats()
        return False

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep the thread alive
            if not isinstance(e, EngineStopped):
                log.exception("engine.step failed")
            with self._cv:
                self.errors += 1
            self._fail_all(EngineError(f"internal engine error: {type(e).__name__}: {e}"))
            return
        self.steps += 1
        self._dispatch(outputs)

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        """Hand one step's outputs to their requests' queues, one wake-up per event loop (called by the one
        thread that owns ``_live``)."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            req = self._live.get(out.request_id)
            if req is None:
                continue
            if out.finished:
                del self._live[out.request_id]
            item = EngineError(f"the request failed: {out.error}") if out.error is not None else out
            batches.setdefault(req.loop, []).append((req.queue, item))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed: nobody is listening
                for queue, _ in items:
                    rid = next((r for r, q in self._live.items() if q.queue is queue), None)
                    if rid is not None:
                        self._drop(rid)

    def _drop(self, request_id: str) -> None:
        """Forget a request nobody listens to any more and stop it in the engine."""
        self._live.pop(request_id, None)
        self.engine.abort(request_id)

    def _fail_all(self, error: BaseException) -> None:
        for rid, req in list(self._live.items()):
            try:
                self._drop(rid)
            except Exception:  # noqa: BLE001
                log.exception("engine.abort(%s) failed", rid)
            self._deliver(req, type(error)(*error.args))  # one instance per request
        self._live.clear()
