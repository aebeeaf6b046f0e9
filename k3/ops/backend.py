"""Backend selection for ops: ``reference`` (pure PyTorch, any device) or ``fast`` (the faster path, where one
is registered: GPU kernels, or pure-PyTorch forms that run everywhere, like the short conv's and the AttnRes
mix's).

``auto`` picks ``fast`` where a fast path is registered and supports the device, else ``reference``.
``fast`` insists: an op whose fast path cannot run on the device raises (ops with no fast path at all run their
reference). Nothing falls back silently: each op logs the backend it runs the first time it runs it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

log = logging.getLogger("k3.ops")
BACKENDS = ("auto", "reference", "fast")


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


def register(op: str, backend: str, fn: Callable, supports: Callable[[torch.device], bool] = lambda d: True,
             label: str | None = None) -> None:
    """Register an implementation of ``op`` under ``backend`` ('reference' or 'fast'); ``label`` (e.g. what
    runs it) is added to the log line that names the backend."""
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
        log.info("op %s runs backend %s%s on %s", op, name, label, device.type)
    return name, entry.impls[name]


def dispatch(op: str, device: torch.device, *args, **kwargs):
    return resolve(op, device)[1](*args, **kwargs)


def kernel_switch(var: str, triton_usable: Callable[[], bool]) -> str:
    """The reason against a fast path's own Triton kernel that the environment variable ``var`` gives, or "" for
    none. Unset or ``triton``: none where Triton is usable (``triton_usable()``); unset elsewhere: that it is not;
    ``triton`` elsewhere, or any value other than torch / triton: one clear error. ``torch``: "<var>=torch"."""
    choice = os.environ.get(var)
    if choice not in (None, "torch", "triton"):
        raise ValueError(f"{var}={choice!r} must be one of torch, triton")
    if choice == "torch":
        return f"{var}=torch"
    if triton_usable():
        return ""
    if choice == "triton":
        raise ValueError(f"{var}=triton needs Triton, which is not installed or has no GPU it supports")
    return "Triton is not usable here (not installed, or no GPU it supports)"


def triton_or_torch(var: str, what: str, why_not: Callable[[], str], labels: tuple[str, str],
                    triton_usable: Callable[[], bool], logged: set[str]) -> str:
    """'triton' or 'torch': what a fast path runs that has its own Triton kernel: the kernel unless
    :func:`kernel_switch` or ``why_not()`` gives a reason against it (a gradient is needed, a shape the kernel does
    not take). Each (choice, reason) is logged once through ``logged``: "<what> <label>[: <reason>]", labels = (the
    kernel's, torch's)."""
    why = kernel_switch(var, triton_usable) or why_not()
    name = "torch" if why else "triton"
    if name + why not in logged:
        logged.add(name + why)
        log.info("%s %s%s", what, labels[0] if name == "triton" else labels[1], f": {why}" if why else "")
    return name
