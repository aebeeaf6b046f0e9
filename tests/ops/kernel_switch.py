"""The switch every Triton kernel of a fast path shares (k3.ops.backend.triton_or_torch), checked through one
chooser."""

from __future__ import annotations

from typing import Callable

import pytest

from k3.ops.moe import grouped


def check_kernel_switch(monkeypatch, var: str, choose: Callable[[], str]) -> None:
    """``choose()`` (a chooser call reading ``var``, on inputs the kernel takes): unset, the kernel where Triton is
    usable and torch where it is not; ``torch`` is torch even where it is usable; another value, or triton where
    Triton is not usable, is one clear error. Leaves ``var`` unset and Triton reported usable, for the chooser's own
    cases."""
    monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(grouped, "_have_triton", lambda: False)
    assert choose() == "torch"
    monkeypatch.setattr(grouped, "_have_triton", lambda: True)
    assert choose() == "triton"
    monkeypatch.setenv(var, "torch")
    assert choose() == "torch"
    monkeypatch.setenv(var, "triton")
    assert choose() == "triton"
    monkeypatch.setenv(var, "fast")
    with pytest.raises(ValueError, match=f"{var}='fast' must be one of torch, triton"):
        choose()
    monkeypatch.setenv(var, "triton")
    monkeypatch.setattr(grouped, "_have_triton", lambda: False)
    with pytest.raises(ValueError, match=f"{var}=triton needs Triton"):
        choose()
    monkeypatch.setattr(grouped, "_have_triton", lambda: True)
    monkeypatch.delenv(var)
