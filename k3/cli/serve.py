"""``k3 serve --ckpt DIR``: an OpenAI-compatible HTTP server (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/health``) over the continuous-batching engine. SIGINT/SIGTERM shut it down gracefully:
uvicorn stops accepting connections and the engine starts draining at once (new requests answer 503), requests in
flight finish (up to ``--drain-timeout`` seconds); those still running then end with an OpenAI-shaped error (an
SSE error event and ``[DONE]``, or a 503) before the connections close and the engine thread stops."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import threading
from typing import TYPE_CHECKING

from k3.cli.generate import add_model_args

if TYPE_CHECKING:
    from k3.infer.async_engine import AsyncEngine
    from k3.infer.engine import Engine

log = logging.getLogger("k3.serve")
GIB = 2**30
# k3.infer.serving.DEFAULT_CHAT_MAX_TOKENS, copied so that building the parser imports no torch
# (tests/cli/test_help.py keeps the two equal)
DEFAULT_CHAT_MAX_TOKENS = 1024


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p, ckpt_required=False)
    p.add_argument(
        "--random",
        metavar="PRESET",
        default=None,
        help="instead of --ckpt: random weights of a preset, built on the device (bfloat16 unless --dtype), with a "
        "400-token BPE tokenizer: for load tests of models too large to write to disk",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default="k3", help="the model id clients pass (default k3)")
    p.add_argument("--max-batch", type=int, default=16, help="sequences decoded together")
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="prompt + output tokens per request (default min(max_position_embeddings, 8192))",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens one engine step feeds: decode tokens first, prefill chunks in the rest (default 16384 on a "
        "GPU, 512 on a CPU)",
    )
    p.add_argument(
        "--prefill-wait-steps",
        type=int,
        default=None,
        help="decode steps a new prompt may wait to be prefilled together with others (default 8 on a GPU, 0 on "
        "a CPU; 0: prefill at once)",
    )
    p.add_argument(
        "--no-overlap",
        action="store_true",
        help="read each step's tokens before launching the next (default on a GPU: overlapped)",
    )
    p.add_argument(
        "--engine",
        choices=("process", "thread"),
        default=None,
        help="run the engine core in a process of its own, apart from the HTTP server's interpreter, or in a thread "
        "of it (default: process on a GPU, thread on a CPU, where the model's compute already runs outside the "
        "interpreter lock)",
    )
    p.add_argument(
        "--max-request-tokens",
        type=int,
        default=None,
        help="most tokens one request may ask for: prompt + max_tokens summed over its prompts and choices "
        "(larger answers 400; default 262144)",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=DEFAULT_CHAT_MAX_TOKENS,
        help="max_tokens of a chat request that gives none, within the context (default %(default)s; a "
        "completions request's default is OpenAI's 16)",
    )
    p.add_argument("--memory-budget-gb", type=float, default=None, help="cache memory for running requests")
    p.add_argument("--prefix-cache-gb", type=float, default=0.0, help="memory for cached prompt prefixes (0: off)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly on a GPU")
    p.add_argument(
        "--compile-decode",
        action="store_true",
        help="torch.compile the decode step before its CUDA-graph capture (GPU; compiles once per "
        "batch size, and reserves the MLA cache for --max-context up front)",
    )
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds requests in flight get at shutdown")
    p.add_argument(
        "--max-request-mb",
        type=float,
        default=16.0,
        help="largest request body in MiB (larger answers 413; default 16, room for a ~10 MiB image)",
    )
    p.add_argument("--timeout-keep-alive", type=float, default=5.0, help="seconds an idle connection stays open")
    p.add_argument(
        "--timeout-request-read",
        type=float,
        default=30.0,
        help="seconds a request's head may take to arrive, then its body (slower ones are cut off; default 30)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=512,
        help="open connections served at once; requests beyond answer 503 (default 512, capped below ulimit -n)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on all but /health (default $K3_API_KEY, which keeps it out of ps)",
    )
    p.add_argument("--docs", action="store_true", help="serve /docs, /redoc and /openapi.json")
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel ranks (under torchrun --nproc-per-node EP): each rank holds 1/EP of every MoE "
        "layer's routed experts, the rest is replicated; rank 0 serves HTTP (default 1)",
    )
    p.add_argument(
        "--ep-timeout",
        type=float,
        default=60.0,
        help="with --ep: seconds a rank waits on the others before the server ends with an error (default 60)",
    )
    p.add_argument(
        "--placement",
        metavar="FILE",
        default=None,
        help="with --ep: which rank holds which routed experts of each MoE layer (a JSON written by k3 plan "
        "--placement; default: contiguous blocks, rank r the r-th 1/EP of every layer)",
    )


def check_args(args: argparse.Namespace) -> None:
    """One ValueError for an engine argument out of range (before anything loads)."""
    if (args.ckpt is None) == (args.random is None):
        raise ValueError("give --ckpt DIR or --random PRESET (one of them)")
    if args.random is not None:
        from k3.config import get_preset

        get_preset(args.random)  # one ValueError naming the presets
    for name in ("memory_budget_gb", "prefix_cache_gb"):
        value = getattr(args, name)
        if value is not None and not value >= 0:
            raise ValueError(f"--{name.replace('_', '-')}={value} must be >= 0")
    if args.max_request_tokens is not None and args.max_request_tokens < 1:
        raise ValueError(f"--max-request-tokens={args.max_request_tokens} must be >= 1")
    if args.default_max_tokens < 1:
        raise ValueError(f"--default-max-tokens={args.default_max_tokens} must be >= 1")
    if args.max_context is not None and args.max_context < 2:
        raise ValueError(f"--max-context={args.max_context} must be >= 2")
    if args.ep < 1:
        raise ValueError(f"--ep={args.ep} must be >= 1")
    if not 0 < args.ep_timeout < float("inf"):
        raise ValueError(f"--ep-timeout={args.ep_timeout} must be a positive number of seconds")
    if args.ep > 1 and args.engine == "process":
        raise ValueError("--ep runs the engine in a thread of rank 0's server: --engine process is not supported")
    if args.ep > 1 and args.compile_decode:
        raise ValueError("--ep runs decode steps eagerly (no CUDA graphs): --compile-decode is not supported")
    if args.placement is not None and args.ep < 2:
        raise ValueError("--placement places experts on the ranks of --ep N (N >= 2, under torchrun)")


def build_engine(args: argparse.Namespace, prepare_model=None, load_options: dict | None = None):
    """Load the checkpoint and build the engine from the serve arguments; returns (engine, tokenizer, path).
    ``load_options`` go to load_for_inference (expert parallelism: this rank's experts) and ``prepare_model(model)``
    (k3.distributed.serve) runs on the loaded model first."""
    from k3.infer.engine import Engine
    from k3.infer.load import load_for_inference

    check_args(args)
    if args.random is not None:
        model, tokenizer, path = random_for_serving(args)
    else:
        model, tokenizer, path = load_for_inference(
            args.ckpt, args.device, args.dtype, packed=args.packed, **(load_options or {})
        )
    if prepare_model is not None:
        model = prepare_model(model)
    budget = None if args.memory_budget_gb is None else int(args.memory_budget_gb * GIB)
    engine = Engine(
        model,
        tokenizer,
        max_batch=args.max_batch,
        max_context=args.max_context,
        cuda_graphs=False if args.no_cuda_graphs or args.ep > 1 else None,
        compile_decode=args.compile_decode,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_wait_steps=args.prefill_wait_steps,
        overlap=False if args.no_overlap else None,
        memory_budget=budget,
        prefix_cache_bytes=int(args.prefix_cache_gb * GIB),
    )
    return engine, tokenizer, path


def random_for_serving(args: argparse.Namespace):
    """(random model of ``--random`` on the device, its tokenizer, a name for it) (k3.bench.live_server)."""
    from k3.bench.live_server import bench_tokenizer, random_config, random_model
    from k3.infer.load import resolve_device, resolve_dtype

    tokenizer = bench_tokenizer()
    device = resolve_device(args.device)
    model = random_model(random_config(args.random, tokenizer), device, resolve_dtype(args.dtype))
    log.info("random %s: %.1fM parameters on %s", args.random, sum(p.numel() for p in model.parameters()) / 1e6, device)
    return model, tokenizer, f"random {args.random}"


def engine_core(args: argparse.Namespace) -> Engine:
    """The engine process's engine (k3.infer.engine_process): built there, with its kernel plan printed."""
    from k3.ops.kernel_plan import plan_report

    engine = build_engine(args)[0]
    print(plan_report(engine.device, args.verbose), flush=True)
    return engine


def start_engine(args: argparse.Namespace):
    """(started AsyncEngine or EngineProcess, tokenizer, checkpoint path) for ``--engine``."""
    from k3.infer.async_engine import AsyncEngine
    from k3.infer.engine_process import EngineProcess
    from k3.infer.load import load_tokenizer, resolve_device

    mode = args.engine or ("process" if resolve_device(args.device).type == "cuda" else "thread")
    if mode == "thread":
        from k3.ops.kernel_plan import plan_report

        engine, tokenizer, path = build_engine(args)
        print(plan_report(engine.device, args.verbose), flush=True)
        return AsyncEngine(engine).start(), tokenizer, path
    check_args(args)
    if args.random is not None:
        from k3.bench.live_server import bench_tokenizer

        tokenizer, path = bench_tokenizer(), f"random {args.random}"
    else:
        tokenizer, path = load_tokenizer(args.ckpt)
    log.info("engine core: starting its process")
    return EngineProcess(engine_core, (args,)).start(), tokenizer, path


def _server(config, async_engine: AsyncEngine | None = None, drain_timeout: float = 30.0):
    """A uvicorn server whose graceful shutdown on SIGINT/SIGTERM ends ``k3 serve`` with status 0 (uvicorn's own
    re-raises the signal after shutting down); a second SIGINT forces the exit. Its shutdown starts draining
    ``async_engine`` first, so requests still running at the drain deadline get their error before uvicorn's own
    (longer) timeout would cancel them mid-response."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            drain = (
                None
                if async_engine is None
                else asyncio.ensure_future(asyncio.to_thread(async_engine.shutdown, drain_timeout))
            )
            await super().shutdown(sockets)
            if drain is not None:
                await drain

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server(config)


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port={args.port} must be in [0, 65535]")
    if not args.drain_timeout >= 0:
        raise ValueError(f"--drain-timeout={args.drain_timeout} must be >= 0")
    if not 0 < args.max_request_mb <= 4096:
        raise ValueError(f"--max-request-mb={args.max_request_mb} must be in (0, 4096]")
    for name in ("timeout_keep_alive", "timeout_request_read"):
        if not 0 < getattr(args, name) < float("inf"):
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be a positive number of seconds")
    if args.max_connections < 1:
        raise ValueError(f"--max-connections={args.max_connections} must be >= 1")
    api_key = os.environ.get("K3_API_KEY") if args.api_key is None else args.api_key
    if api_key is not None:  # (a header cannot carry other characters, nor keep spaces at either end)
        api_key = api_key.strip()
        if not api_key or not (api_key.isascii() and api_key.isprintable()):
            raise ValueError("the API key (--api-key or K3_API_KEY) must be non-empty printable ASCII")
    if args.ep > 1:
        from k3.distributed.serve import serve_expert_parallel

        check_args(args)
        return serve_expert_parallel(args, lambda *a: serve_http(args, api_key, *a), build_engine)
    return serve_http(args, api_key, *start_engine(args))


def serve_http(args: argparse.Namespace, api_key: str | None, async_engine, tokenizer, path) -> int:
    """Serve the started engine over HTTP until a graceful shutdown (then stop it); returns 0."""
    import uvicorn

    from k3.infer.engine_process import EngineProcess
    from k3.infer.server import connection_limit, create_app, http_options, limit_log_rate

    engine = async_engine.engine
    app = create_app(
        async_engine,
        tokenizer,
        args.model_name,
        engine.max_context,
        args.drain_timeout,
        max_request_bytes=int(args.max_request_mb * 2**20),
        read_timeout=args.timeout_request_read,
        api_key=api_key,
        docs=args.docs,
        max_request_tokens=args.max_request_tokens,
        default_max_tokens=args.default_max_tokens,
    )
    log.info(
        "serving %s as %r on http://%s:%d (context %d, batch %d, device %s, engine in a %s)",
        path,
        args.model_name,
        args.host,
        args.port,
        engine.max_context,
        engine.max_batch,
        engine.device,
        "process" if isinstance(async_engine, EngineProcess) else "thread",
    )
    # uvicorn cancels what is left after its timeout: give the engine's drain and the error responses it ends
    # with a few seconds more
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="info",
        timeout_graceful_shutdown=args.drain_timeout + 5,
        **http_options(args.timeout_keep_alive, args.timeout_request_read, connection_limit(args.max_connections)),
    )
    limit_log_rate()  # after uvicorn.Config, which installs uvicorn's log handlers
    try:
        _server(config, async_engine, args.drain_timeout).run()  # returns after a graceful shutdown
    finally:
        async_engine.shutdown(0)  # a no-op after the graceful drain; stops the engine if uvicorn failed to start
    log.info("k3 serve: stopped")
    return 0
