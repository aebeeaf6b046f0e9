"""The kernel plan's switch that every Triton kernel of a fast path shares (k3.ops.backend.triton_or_torch), checked
through one chooser."""

from __future__ import annotations

from typing import Callable

import pytest

from k3.ops import backend


def keep_kernel_plan(monkeypatch) -> None:
    """Restore the kernel plan's state (user's spec, Triton's usability, resolved choices) when the test ends."""
    monkeypatch.delenv("K3_KERNELS", raising=False)
    for name in ("_kernel_spec", "_triton_usable", "_kernels"):
        monkeypatch.setattr(backend, name, getattr(backend, name))


def check_kernel_switch(monkeypatch, kernel: str, choose: Callable[[], str]) -> None:
    """``choose()`` (a chooser call on inputs the kernel takes): by default the kernel where Triton is usable and
    its other form where it is not; ``K3_KERNELS=<kernel>=<off>`` is the other form even where Triton is usable;
    a bad value, or the kernel where Triton is not usable, is one clear error when the plan is resolved. Leaves
    the plan resolved with Triton reported usable and no override, for the chooser's own cases."""
    k = backend.KERNELS[kernel]
    keep_kernel_plan(monkeypatch)
    backend.set_kernels(None, triton=False)
    assert choose() == k.off
    backend.set_kernels(None, triton=True)
    assert choose() == k.on
    monkeypatch.setenv("K3_KERNELS", f"{kernel}={k.off}")
    backend.set_kernels(None)
    assert choose() == k.off
    monkeypatch.delenv("K3_KERNELS")
    backend.set_kernels({kernel: k.on})
    assert choose() == k.on
    with pytest.raises(ValueError, match=f"K3_KERNELS: {kernel}='fast' must be {k.on} or {k.off}"):
        backend.set_kernels(f"{kernel}=fast")
    with pytest.raises(ValueError, match=f"K3_KERNELS: {kernel}={k.on} needs Triton"):
        backend.set_kernels({kernel: k.on}, triton=False)
    backend.set_kernels(None, triton=True)
