"""Programmatic dependent launch (PDL) of our Triton kernels, on GPUs of compute capability 9 (Hopper) and later.

A kernel launched with PDL may start while the kernel before it on the stream is still finishing: its programs run
up to ``gdc_wait`` (PTX griddepcontrol.wait), which returns once that kernel has completed and its writes are
visible. ``gdc_launch_dependents`` then lets the next PDL kernel start the same way. In a decode step replayed
from a CUDA graph (about 200 short kernels at batch 64) this overlaps each kernel's launch and start-up with the
tail of the one before. Every kernel here calls :func:`wait_then_release` before it writes global memory and before
it reads anything the kernel before it may write, so what each kernel sees and overwrites is as without PDL; a
kernel launched without PDL after one of ours waits for it as usual.

Reads before the wait: a PDL kernel starts only once the kernel before it has passed its own wait (ours and inductor's
release after waiting; any other kernel releases when it ends), so everything launched earlier than that one has
completed; what that one kernel does not write can be read at once. Two kernels do so with their main reads: the KDA
decode core (its slots and recurrent states, which only the core itself writes) and the short-conv step (its slots, conv
state rows and weights; the KDA maps before it write the inputs, read after the wait), so those reads overlap the
previous kernel's tail (docs/decisions.md, "Reads before the PDL wait; expert passes sized for large groups").
tests/ops/test_kernels_compile_for_hopper.py checks that no other kernel reads before its wait and that none writes
before it.

Kernel ``pdl`` of the kernel plan (k3.ops.backend): on where the GPU and Triton support it, ``K3_KERNELS=pdl=off``
turns it off. Inductor's own kernels in
a compiled decode step follow the same switch (:func:`inductor_options`, its ``triton.enable_pdl``, off by default
upstream): inductor places the wait itself, before a kernel reads what the previous kernel wrote (always after one of
our custom ops) or else after its first load.
"""

from __future__ import annotations

import logging
import os

import torch

from k3.ops import backend

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: none of our Triton kernels runs, and PDL is off
    triton = None

log = logging.getLogger("k3.ops")
_supported: dict[int, bool] = {}  # CUDA device index -> capability >= 9 and Triton has gdc_wait

if triton is not None:

    @triton.jit
    def wait_then_release(PDL: tl.constexpr):
        """A PDL kernel's first statement: wait for the kernel before it, then let the next one start (no-op
        when PDL is False, the case of every launch that is not made with PDL)."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: the kernel plan has kernel pdl on, a CUDA GPU of capability >= 9
    and a Triton
    with gdc_wait (asked once per device and logged)."""
    if (
        device.type != "cuda"
        or triton is None
        or os.environ.get("TRITON_INTERPRET") == "1"
        or backend.kernel_choice("pdl") != "on"
    ):
        return False  # (Triton's interpreter cannot run the wait instruction)
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _supported:
        from triton.language.extra import cuda

        ok = torch.cuda.get_device_capability(index)[0] >= 9 and hasattr(cuda, "gdc_wait")
        _supported[index] = ok
        log.info(
            "Triton decode kernels on cuda:%d launch %s",
            index,
            "with programmatic dependent launch (K3_KERNELS=pdl=off turns it off)"
            if ok
            else "without programmatic dependent launch (needs compute capability >= 9)",
        )
    return _supported[index]


def launch(device: torch.device) -> dict:
    """Keyword arguments of a launch of a kernel that starts with :func:`wait_then_release`: its PDL constexpr and,
    where PDL is on, Triton's ``launch_pdl`` option."""
    on = enabled(device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


def inductor_options(device: torch.device) -> dict:
    """Inductor options for a compiled step on ``device``: ``triton.enable_pdl`` where PDL is on and this torch has
    it (its generated kernels then start early too, waiting where inductor places the wait)."""
    from torch._inductor import config

    return {"triton.enable_pdl": True} if enabled(device) and hasattr(config.triton, "enable_pdl") else {}
