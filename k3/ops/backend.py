"""The kernel plan: which implementation runs each op, resolved once from the device, the installed libraries and
the user's choice, and printed as one table (docs/kernels.md#the-kernel-plan).

Two kinds of entries:

- **ops**, registered by each ``k3.ops`` package: a ``reference`` (pure PyTorch, any device) and, where one exists,
  a ``fast`` path (fla's or our own GPU kernels, or pure-PyTorch forms that run everywhere, like the short conv's).
  ``K3_BACKEND`` (or :func:`set_backend`) chooses for every op: ``auto`` (default) runs the fast path where it
  supports the device, else the reference; ``reference`` runs the references; ``fast`` insists (an op whose fast
  path cannot run on the device raises when called; ops with no fast path run their reference).
- **kernels** (:data:`KERNELS`): our own Triton kernels inside some fast paths. Each is on where Triton is usable;
  ``K3_KERNELS`` (or :func:`set_kernels`) turns single ones off or on, e.g. ``K3_KERNELS=router_topk=torch,pdl=off``;
  a bad name or value, or asking for a kernel Triton cannot run, is one clear error.

Both are resolved once: an op's backend per device on first use, the kernels' choices on first use; the answers
are kept (a compiled step reads them as constants) and :func:`set_backend` / :func:`set_kernels` resolve again.
Within a chosen kernel, a call that needs what the kernel lacks (a gradient, a shape it does not take) runs the
torch form; that fork lives in the op (:func:`triton_or_torch`) and is logged once with its reason. Nothing falls
back silently: each op logs the backend it runs the first time (at DEBUG: ``k3 -v``), and k3.ops.kernel_plan shows
the whole plan.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

log = logging.getLogger("k3.ops")
BACKENDS = ("auto", "reference", "fast")


@dataclass(frozen=True)
class Kernel:
    """One of our kernels: ``on`` is its name when chosen, ``off`` what runs instead; ``what`` it fuses;
    ``why_not`` says what else it needs beyond Triton ("" where it can run; None: nothing else); ``no_triton``
    (non-empty), for a kernel whose ``off`` is Triton code too, names what runs where Triton is not usable (what the
    kernel plan shows there)."""

    on: str
    off: str
    what: str
    why_not: Callable[[], str] | None = None
    no_triton: str = ""


def _nvrtc_kernel_why_not() -> str:
    from k3.ops.moe.cuda_mxfp4 import why_not

    return why_not(torch.device("cuda"))


KERNELS: dict[str, Kernel] = {
    "multi_linear": Kernel("triton", "torch", "a layer's linear maps of one input (decode), one launch"),
    "conv_step": Kernel("triton", "torch", "a KDA layer's three short-conv decode steps, one launch"),
    "kda_decode_core": Kernel("triton", "torch", "a KDA layer's decode gates, recurrence and gated norm, one launch"),
    "router_topk": Kernel("triton", "torch", "the router's sigmoid, biased top-k, renormalise and scale (decode)"),
    "moe_route": Kernel("triton", "torch", "ordering a decode batch's token-expert pairs by expert, one program"),
    "moe_small_groups": Kernel("triton", "grouped_mm", "the expert matmuls of decode batches"),
    "moe_up_glu": Kernel("triton", "torch", "the experts' row gather, w1, w3 and GLU in one launch (decode)"),
    "moe_mxfp4": Kernel("triton", "torch", "packed MXFP4 experts' matmuls by tl.dot_scaled, decode and prefill"),
    "moe_mxfp4_rows": Kernel(
        "cuda",
        "triton",
        "packed MXFP4 experts' decode matmuls: the weights decoded into mma.sync's register operand (NVRTC)",
        _nvrtc_kernel_why_not,
        no_triton="torch",  # off is kernel moe_mxfp4, whose own off is torch
    ),
    "mla_decode": Kernel("triton", "torch", "MLA's absorbed decode attention over the latent cache, split-K"),
    "pdl": Kernel("on", "off", "programmatic dependent launch of the kernels above (compute capability >= 9)"),
}


@dataclass
class _Op:
    name: str
    impls: dict[str, Callable] = field(default_factory=dict)
    supports: dict[str, Callable[[torch.device], bool]] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    logged: set = field(default_factory=set)
    fast_ok: dict[tuple, bool] = field(default_factory=dict)  # (device type, index) -> the fast path runs there


_OPS: dict[str, _Op] = {}
_choice: str = os.environ.get("K3_BACKEND", "auto")
_kernel_spec: str | None = None  # set_kernels' spec; None: the K3_KERNELS environment variable
_triton_usable: bool | None = None  # Triton importable with a GPU it supports, asked once
_kernels: dict[str, tuple[str, str]] | None = None  # kernel -> (what runs, why), once resolved


def register(
    op: str,
    backend: str,
    fn: Callable,
    supports: Callable[[torch.device], bool] = lambda d: True,
    label: str | None = None,
) -> None:
    """Register an implementation of ``op`` under ``backend`` ('reference' or 'fast'); ``label`` says what runs
    it (in the log line and the plan table)."""
    if backend not in ("reference", "fast"):
        raise ValueError(f"backend {backend!r} must be 'reference' or 'fast'")
    entry = _OPS.setdefault(op, _Op(op))
    entry.impls[backend] = fn
    entry.supports[backend] = supports
    entry.fast_ok.clear()
    if label:
        entry.labels[backend] = label


def set_backend(choice: str) -> None:
    """Choose 'auto', 'reference' or 'fast' for every op (also from the K3_BACKEND environment variable)."""
    global _choice
    if choice not in BACKENDS:
        raise ValueError(f"backend={choice!r} must be one of {', '.join(BACKENDS)}")
    _choice = choice


def get_backend() -> str:
    return _choice


def triton_usable() -> bool:
    """Triton installed, importable and with a GPU it supports (torch's own check), asked once and kept in a
    global that a traced decode step reads as a constant."""
    global _triton_usable
    if _triton_usable is None:
        from torch.utils._triton import has_triton

        _triton_usable = has_triton()
    return _triton_usable


def set_kernels(spec: str | dict[str, str] | None = None, *, triton: bool | None = None) -> None:
    """Choose kernels (``"name=value,..."`` or a dict; None: K3_KERNELS again) and resolve them anew; ``triton``
    overrides whether Triton counts as usable (Triton's CPU interpreter, tests). Validated at once."""
    global _kernel_spec, _triton_usable, _kernels
    if isinstance(spec, dict):
        spec = ",".join(f"{k}={v}" for k, v in spec.items())
    _kernel_spec = spec
    if triton is not None:
        _triton_usable = triton
    _kernels = None
    kernel_choices()


def _parse(spec: str) -> dict[str, str]:
    wanted = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in KERNELS:
            raise ValueError(f"K3_KERNELS: {item!r} must be name=value with a name among {', '.join(KERNELS)}")
        k = KERNELS[name]
        if value not in (k.on, k.off):
            raise ValueError(f"K3_KERNELS: {name}={value!r} must be {k.on} or {k.off}")
        wanted[name] = value
    return wanted


def kernel_choices() -> dict[str, tuple[str, str]]:
    """Every kernel's (what runs, why), resolved once: the user's value, else on where Triton (and what else the
    kernel needs) is usable."""
    global _kernels
    if _kernels is None:
        wanted, usable = _parse(kernel_spec()), triton_usable()
        out = {}
        for name, k in KERNELS.items():
            value = wanted.get(name)
            if value == k.on and not usable:
                raise ValueError(
                    f"K3_KERNELS: {name}={k.on} needs Triton, which is not installed or has no GPU it supports"
                )
            why = "Triton is not usable here" if not usable else k.why_not() if k.why_not else ""
            if value == k.on and why:
                raise ValueError(f"K3_KERNELS: {name}={k.on} cannot run here: {why}")
            if value is not None:
                out[name] = (value, "K3_KERNELS")
            else:
                out[name] = (k.off, why) if why else (k.on, "default")
        _kernels = out
    return _kernels


def registered() -> dict[str, _Op]:
    """Every registered op by name (what :mod:`k3.ops.kernel_plan` tabulates)."""
    return dict(_OPS)


def kernel_spec() -> str:
    """The user's kernel choices as given: set_kernels' spec, else K3_KERNELS ("" for none)."""
    return _kernel_spec if _kernel_spec is not None else os.environ.get("K3_KERNELS", "")


def kernel_choice(name: str) -> str:
    """What runs for kernel ``name``: KERNELS[name].on or .off (see :func:`kernel_choices`)."""
    return kernel_choices()[name][0]


def resolve(op: str, device: torch.device) -> tuple[str, Callable]:
    """The (backend name, function) that runs ``op`` on ``device`` under the current choice. Whether the fast path
    supports a device is asked once per device and op (registering the op again asks again): later changes to
    what the answer read (e.g. ``torch._dynamo.config.disable`` for the compiled pointwise ops) are not seen."""
    entry = _OPS[op]
    has_fast = "fast" in entry.impls
    index = torch.cuda.current_device() if device.type == "cuda" and device.index is None else device.index
    fast_ok = entry.fast_ok.get((device.type, index))
    if fast_ok is None:  # asked once per device: traced into a compiled step, a capability query cut its graph
        fast_ok = entry.fast_ok[(device.type, index)] = has_fast and entry.supports["fast"](device)
    if _choice == "fast" and has_fast and not fast_ok:
        raise RuntimeError(f"backend 'fast' was requested but op {op!r}'s fast path cannot run on {device}")
    name = "fast" if (_choice in ("fast", "auto") and fast_ok) else "reference"
    if (name, device.type) not in entry.logged:
        entry.logged.add((name, device.type))
        label = f" ({entry.labels[name]})" if name in entry.labels else ""
        log.debug("op %s runs backend %s%s on %s", op, name, label, device.type)
    return name, entry.impls[name]


def dispatch(op: str, device: torch.device, *args, **kwargs):
    return resolve(op, device)[1](*args, **kwargs)


def triton_or_torch(
    kernel: str, what: str, why_not: Callable[[], str], labels: tuple[str, str], logged: set[str]
) -> str:
    """KERNELS[kernel].on or .off for one call of a fast path that has this kernel: the kernel where the plan chose
    it and ``why_not()`` gives no reason against it for this call (a gradient is needed, a shape the kernel does not
    take). Each (choice, reason) is logged once through ``logged``: "<what> <label>[: <reason>]", labels = (the
    kernel's, the other form's)."""
    k = KERNELS[kernel]
    choice, source = kernel_choices()[kernel]
    why = (f"K3_KERNELS {kernel}={k.off}" if source == "K3_KERNELS" else source) if choice == k.off else why_not()
    name = k.off if why else k.on
    if name + why not in logged:
        logged.add(name + why)
        log.info("%s %s%s", what, labels[0] if name == k.on else labels[1], f": {why}" if why else "")
    return name
