"""The switch every opt-in Triton kernel shares (k3.ops.backend.opt_in_kernel), checked through one chooser."""

from __future__ import annotations

from typing import Callable

import pytest

from k3.ops.moe import grouped


def check_opt_in_switch(monkeypatch, var: str, choose: Callable[[], str]) -> None:
    """``choose()`` (a chooser call reading ``var``): unset is torch; a value other than torch / triton, or triton
    where Triton is not usable, is one clear error. Leaves ``var=triton`` set and Triton reported usable, for the
    chooser's own cases."""
    monkeypatch.delenv(var, raising=False)
    assert choose() == "torch"
    monkeypatch.setenv(var, "fast")
    with pytest.raises(ValueError, match=f"{var}='fast' must be one of torch, triton"):
        choose()
    monkeypatch.setenv(var, "triton")
    monkeypatch.setattr(grouped, "_have_triton", lambda: False)
    with pytest.raises(ValueError, match=f"{var}=triton needs Triton"):
        choose()
    monkeypatch.setattr(grouped, "_have_triton", lambda: True)
