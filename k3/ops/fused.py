"""Pointwise chains (norms, gated activations, KDA's gate and L2 norm) fused by ``torch.compile`` on CUDA.

Written eagerly, each of these functions is a chain of small kernels that upcast to fp32, and autograd keeps
every fp32 intermediate for the backward pass: on a GPU they were most of a training step's elementwise time
and memory (docs/decisions.md). ``@fused`` registers the eager function as the op's
``reference`` backend and ``torch.compile(fn)`` (TorchInductor: one Triton kernel forward, one backward, inputs
saved instead of intermediates) as its ``fast`` backend on CUDA devices where Triton is installed; the decorated
name dispatches like every other op (k3.ops.backend: chosen by ``auto|reference|fast`` and logged once per
device). The reference is ``fn.reference``. Shapes start static and become dynamic on the first change
(torch.compile's automatic dynamic shapes), so packed batches of new lengths do not recompile every step.
Compilation happens on the first call of each (dtype, grad mode, widths) combination: CUDA-graph capture
(k3.infer.graphs) warms up before it records, so it never compiles under capture. One model already needs more
than dynamo's default 8 versions of ``rms_norm`` (four widths, training and inference, a decode batch of 1), and
with ``fullgraph=True`` hitting the limit is an error, not a slow path: the first compilation raises dynamo's
``recompile_limit`` to at least RECOMPILE_LIMIT for the process (logged).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from k3.ops import backend

RECOMPILE_LIMIT = 64


def compilable(device: torch.device) -> bool:
    """A CUDA device, Triton installed and torch.compile not disabled (TORCH_COMPILE_DISABLE=1 then runs, and logs,
    the reference instead of an eager "compiled" function)."""
    if device.type != "cuda":
        return False
    from torch.utils._triton import has_triton

    if not has_triton():
        return False
    import torch._dynamo

    return not torch._dynamo.config.disable


def raise_recompile_limit(limit: int = RECOMPILE_LIMIT, who: str = "k3.ops.fused") -> None:
    """Let dynamo compile a function at least ``limit`` times (per-function limit, and 4x that in all) before it
    runs new shapes uncompiled; logged when raised."""
    import torch._dynamo

    config = torch._dynamo.config
    if config.recompile_limit < limit:
        backend.log.info("torch._dynamo recompile_limit %d -> %d (%s)", config.recompile_limit, limit, who)
        config.recompile_limit = limit
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * limit)


def fused(fn: Callable) -> Callable:
    """Register ``fn`` (first argument a tensor) as op ``fn.__name__`` with a compiled fast path on CUDA; return the
    dispatcher, which carries the eager function as ``.reference``.

    If compiling fails (a dynamo / inductor error, e.g. under another torch version), the call is answered by the
    reference and, when that succeeds (the inputs were fine), the op logs the error once and runs its reference
    from then on; with ``K3_BACKEND=fast`` the error is raised instead."""
    name = fn.__name__
    compiled = None
    compile_error: tuple[type[Exception], ...] = (Exception,)  # dynamo's error classes, once imported
    failed = False  # a flag, not the exception: its traceback would keep the failing call's tensors alive

    def fast(*args, **kwargs):
        nonlocal compiled, compile_error, failed
        if failed:
            return fn(*args, **kwargs)
        if compiled is None:  # compile lazily: importing k3 must not import dynamo
            import torch._dynamo.exc as exc

            raise_recompile_limit()
            # FailOnRecompileLimitHit (too many input shapes for fullgraph) derives from Exception alone
            errors = tuple(
                getattr(exc, n) for n in ("TorchDynamoException", "FailOnRecompileLimitHit") if hasattr(exc, n)
            )
            compiled, compile_error = torch.compile(fn, fullgraph=True), errors
        try:
            return compiled(*args, **kwargs)
        except compile_error as e:
            if backend.get_backend() == "fast":
                raise
            out = fn(*args, **kwargs)  # raises the plain error if the inputs are at fault
            failed = True
            first = (str(e).strip().splitlines() or [""])[0][:300]
            backend.log.error(
                "op %s: torch.compile failed (%s: %s); its reference runs from now on (K3_BACKEND=fast raises instead)",
                name,
                type(e).__name__,
                first,
            )
            return out

    backend.register(name, "reference", fn)
    backend.register(name, "fast", fast, compilable, label="torch.compile (inductor)")

    @functools.wraps(fn)
    def run(*args, **kwargs):
        return backend.dispatch(name, args[0].device, *args, **kwargs)

    run.reference = fn
    return run
