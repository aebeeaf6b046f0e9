"""The engine core in its own process (k3.infer.engine_process.EngineProcess) against the in-thread AsyncEngine.

One tiny random checkpoint; the process builds its engine with ``k3 serve``'s own factory. Its outputs equal the
thread's for the same requests (greedy and seeded, run concurrently); a refused request is a ValueError and the
others go on; an abort frees the sequence in the child; a build error surfaces from start(); a shutdown ends what
is left with EngineClosed; a killed child fails the requests in flight with EngineError and stops accepting.
"""

import argparse
import asyncio
import importlib.util
import os
import signal
import threading
import time

import pytest
import torch

from k3.config import get_preset
from k3.checkpoint.format import save_pretrained
from k3.data.tokenizer import train_bpe
from k3.infer.async_engine import AsyncEngine, EngineClosed, EngineError
from k3.infer.engine import Engine
from k3.infer.engine_process import EngineProcess, _Outbox, coalesce
from k3.infer.grammar import grammar_for
from k3.infer.load import load_for_inference
from k3.infer.sampling import SamplingParams
from k3.model.decoder import K3ForCausalLM

CONTEXT = 128
# a structured-output request: its grammar crosses the pipe as a string, its matcher is built in the child
JSON = grammar_for({"type": "json_object"}) if importlib.util.find_spec("llguidance") else None


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    tok = train_bpe(["the quick brown fox jumps over the lazy dog " * 20, "hello world, hello k3"], vocab_size=300)
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset("tiny").replace(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id))
    path = tmp_path_factory.mktemp("ckpt")
    save_pretrained(model, path)
    tok.save(path)
    return path


def serve_args(path, **over) -> argparse.Namespace:
    from k3.cli.main import build_parser

    args = build_parser().parse_args(
        [
            "serve",
            "--ckpt",
            str(path),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--max-batch",
            "4",
            "--max-context",
            str(CONTEXT),
        ]
    )
    return argparse.Namespace(**{**vars(args), **over})


def requests():
    return [
        ([5, 6, 7, 8], SamplingParams(max_tokens=12, temperature=0)),
        ([9, 10], SamplingParams(max_tokens=9, temperature=0.9, top_p=0.9, seed=7)),
        ([11, 12, 13], SamplingParams(max_tokens=10, temperature=1.0, top_k=20, seed=3, logprobs=2)),
    ] + ([([14, 15], SamplingParams(max_tokens=16, temperature=1.0, seed=1, grammar=JSON))] if JSON else [])


async def run_all(ae) -> list[tuple[list[int], str, str]]:
    async def one(prompt, params):
        outs = [o async for o in ae.generate(prompt, params)]
        lps = [(e.token_id, round(e.logprob, 4)) for o in outs for e in (o.logprobs or [])]
        return [t for o in outs for t in o.token_ids], "".join(o.text for o in outs), outs[-1].finish_reason, lps

    return await asyncio.gather(*(one(p, s) for p, s in requests()))


@pytest.fixture(scope="module")
def proc_engine(ckpt):
    from k3.cli.serve import engine_core

    ep = EngineProcess(engine_core, (serve_args(ckpt),)).start()
    yield ep
    ep.shutdown(5)


def test_outputs_equal_the_thread_engine(ckpt, proc_engine):
    model, tok, _ = load_for_inference(ckpt, "cpu", "float32")
    thread = AsyncEngine(Engine(model, tok, max_batch=4, max_context=CONTEXT)).start()
    try:
        want = asyncio.run(run_all(thread))
    finally:
        thread.shutdown()
    got = asyncio.run(run_all(proc_engine))
    assert got == want
    assert all(len(t) > 0 for t, *_ in got)
    assert JSON is None or got[3][1].startswith("{")
    assert proc_engine.engine.max_context == CONTEXT and proc_engine.engine.vision is None
    stats = proc_engine.stats()
    assert stats["steps"] > 0 and stats["accepting"] and proc_engine.running


def test_refused_request_and_abort(proc_engine):
    async def scenario():
        with pytest.raises(ValueError, match="context|long|exceed"):
            await proc_engine.submit(list(range(3, 3 + CONTEXT + 5)), SamplingParams(max_tokens=4))
        stream = await proc_engine.submit([5, 6], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
        got = 0
        async for out in stream:
            got += len(out.token_ids)
            if got >= 3:
                break  # abandoning the iteration aborts the request
        ok = [o.text async for o in proc_engine.generate([7, 8], SamplingParams(max_tokens=3, temperature=0))]
        return got, ok

    got, ok = asyncio.run(scenario())
    assert got >= 3 and ok
    deadline = time.monotonic() + 10
    while proc_engine.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc_engine.stats()["running"] == 0  # the aborted sequence left the child's engine


def test_start_failure_is_raised(tmp_path):
    from k3.cli.serve import engine_core

    with pytest.raises(FileNotFoundError):
        EngineProcess(engine_core, (serve_args(tmp_path / "missing"),)).start()


def test_shutdown_ends_what_is_left_and_a_killed_child_fails_its_requests(ckpt):
    from k3.cli.serve import engine_core

    long = SamplingParams(max_tokens=CONTEXT - 8, temperature=0, ignore_eos=True)

    async def first_tokens(ae):
        stream = await ae.submit([5, 6, 7], long)
        it = stream.__aiter__()
        await it.__anext__()
        return it

    async def rest(it):
        return [o async for o in it]

    ep = EngineProcess(engine_core, (serve_args(ckpt),)).start()

    async def drain():
        it = await first_tokens(ep)
        await asyncio.to_thread(ep.shutdown, 0)
        with pytest.raises(EngineClosed):
            await rest(it)
        with pytest.raises(EngineClosed):
            await ep.submit([5], long)

    asyncio.run(drain())
    assert not ep.running and ep._proc.exitcode == 0

    ep = EngineProcess(engine_core, (serve_args(ckpt),)).start()

    async def killed():
        it = await first_tokens(ep)
        os.kill(ep._proc.pid, signal.SIGKILL)
        with pytest.raises(EngineError, match="exited"):
            await rest(it)
        with pytest.raises(EngineClosed):
            await ep.submit([5], long)

    try:
        asyncio.run(killed())
        assert not ep.running
    finally:
        ep.shutdown(0)


def test_serve_takes_a_checkpoint_or_random_weights(ckpt):
    from k3.cli.serve import check_args, engine_core

    for over in ({"ckpt": None}, {"random": "tiny"}):  # neither, both
        with pytest.raises(ValueError, match="--ckpt DIR or --random PRESET"):
            check_args(serve_args(ckpt, **over))
    with pytest.raises(ValueError, match="unknown preset"):
        check_args(serve_args(ckpt, ckpt=None, random="nope"))
    with pytest.raises(ValueError, match="--default-max-tokens=0 must be >= 1"):
        check_args(serve_args(ckpt, default_max_tokens=0))
    ep = EngineProcess(engine_core, (serve_args(ckpt, ckpt=None, random="tiny", dtype="auto"),)).start()
    try:

        async def one():
            return [o async for o in ep.generate([5, 6, 7], SamplingParams(max_tokens=4, temperature=0))]

        outs = asyncio.run(one())
        assert sum(len(o.token_ids) for o in outs) == 4 and outs[-1].finished
    finally:
        ep.shutdown(5)


def test_outbox_merges_the_steps_a_slow_reader_missed_in_order():
    """Step outputs queued behind a send go out as one message; other messages keep their place between them."""
    a = ("out", ["a1"], [], None)
    b = ("out", ["b1", "b2"], ["x"], {"steps": 2})
    acc = ("accepted", 7, None, None)
    c = ("out", ["c1"], [], None)
    assert coalesce([a, b, acc, c, ("stopped", {})]) == [
        ("out", ["a1", "b1", "b2"], ["x"], {"steps": 2}),
        acc,
        c,
        ("stopped", {}),
    ]

    class SlowPipe:
        def __init__(self):
            self.sent, self.sending = [], threading.Event()

        def send(self, msg):
            if not self.sending.is_set():  # the reader is busy: what is queued meanwhile waits for this send
                self.sending.set()
                time.sleep(0.3)
            self.sent.append(msg)

    pipe = SlowPipe()
    box = _Outbox(pipe)
    box.put(("out", [0], [], None))
    assert pipe.sending.wait(5)
    t0 = time.perf_counter()
    for i in range(1, 5):
        box.put(("out", [i], [], None))
    assert time.perf_counter() - t0 < 0.2  # the step loop did not wait for the reader
    box.close()
    assert pipe.sent == [("out", [0], [], None), ("out", [1, 2, 3, 4], [], None)]
