"""An asyncio front for :class:`k3.infer.engine.Engine`: one background thread owns the engine.

The thread is the only code that touches the engine or the model. Callers on any event loop submit requests
and aborts through a lock-protected inbox and get each request's :class:`StepOutput` deltas through its own
``asyncio.Queue``, fed with ``loop.call_soon_threadsafe``. The thread sleeps on a condition variable while
there is nothing to do.

    ae = AsyncEngine(engine).start()
    async for out in ae.generate(prompt_ids, SamplingParams(max_tokens=32)):
        print(out.text, end="")
    ae.shutdown()

``engine.add`` errors (bad parameters, a prompt too long) reach the caller as ``ValueError``; a request the engine
ended with an error of its own (``StepOutput.error``) ends with :class:`EngineError` alone; an exception in
``engine.step`` fails the requests in flight with :class:`EngineError` and the thread keeps serving.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from k3.infer.engine import StepOutput
from k3.infer.sampling import SamplingParams

log = logging.getLogger("k3.infer")


class EngineError(RuntimeError):
    """The engine failed while running a request (an internal error, not the request's fault)."""


class EngineClosed(RuntimeError):
    """The engine is shutting down or stopped: no new requests; requests still running when it stops end so."""


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    accepted: asyncio.Future
    images: list | None = None  # image bytes / paths for the prompt's media placeholders
    media: object = None  # or the images already prepared (Engine.prepare), the prompt expanded


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
        try:
            while not self.finished:
                item = await self._req.queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
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
        self._inbox: list[_Request] = []
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
        loop = asyncio.get_running_loop()
        req = _Request(
            request_id or f"areq-{next(self._ids)}",
            list(prompt_ids),
            params,
            loop,
            asyncio.Queue(),
            loop.create_future(),
            images,
            media,
        )
        with self._cv:
            if not self._accepting or self._thread is None or not self._thread.is_alive():
                raise EngineClosed("the engine is not running (shutting down or not started)")
            self._inbox.append(req)
            self._cv.notify()
        try:
            await req.accepted
        except asyncio.CancelledError:
            self.abort(req.request_id)  # queued after the add, so the thread drops it if it was added
            raise
        return RequestStream(self, req)

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

    def _take_inbox(self) -> tuple[list[_Request], list[str], bool]:
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
            for req in self._inbox:  # submitted while stopping (cannot happen after _accepting=False, but be safe)
                req.loop.call_soon_threadsafe(_resolve, req.accepted, EngineClosed("the engine shut down"))
            self._inbox = []

    def _iteration(self) -> bool:
        """Admit submissions, apply aborts, run one step; True when the thread should end."""
        inbox, aborts, stopping = self._take_inbox()
        for req in inbox:
            try:
                self.engine.add(req.prompt, req.params, req.request_id, images=req.images, media=req.media)
            except ValueError as e:
                req.loop.call_soon_threadsafe(_resolve, req.accepted, ValueError(str(e)))
                continue
            except Exception as e:  # noqa: BLE001 - an engine bug: report it to the caller, keep serving
                log.exception("engine.add failed")
                req.loop.call_soon_threadsafe(_resolve, req.accepted, EngineError(f"{type(e).__name__}: {e}"))
                continue
            self._live[req.request_id] = req
            req.loop.call_soon_threadsafe(_resolve, req.accepted, None)
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
            log.exception("engine.step failed")
            with self._cv:
                self.errors += 1
            self._fail_all(EngineError(f"internal engine error: {type(e).__name__}: {e}"))
            return
        self.steps += 1
        for out in outputs:
            req = self._live.get(out.request_id)
            if req is None:
                continue
            if out.finished:
                del self._live[out.request_id]
            if out.error is not None:  # this request alone failed
                self._deliver(req, EngineError(f"the request failed: {out.error}"))
                continue
            if not self._deliver(req, out) and not out.finished:
                del self._live[out.request_id]
                self.engine.abort(out.request_id)

    def _fail_all(self, error: BaseException) -> None:
        for rid, req in list(self._live.items()):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001
                log.exception("engine.abort(%s) failed", rid)
            self._deliver(req, type(error)(*error.args))  # one instance per request
        self._live.clear()
