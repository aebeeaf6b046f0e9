"""Programmatic dependent launch (k3.ops.pdl): when our Triton kernels launch with it, and what a launch passes.
That each kernel waits for its predecessor before writing memory, and reads before the wait only where allowed:
tests/ops/test_kernels_compile_for_hopper.py (the PTX of every kernel with PDL on); that decode steps give the same
results with it: the GPU tests."""

import logging

import pytest
import torch

from k3.ops import backend, pdl
from tests.ops.kernel_switch import keep_kernel_plan


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device 0 of a chosen compute capability, answered without a GPU; -> a setter."""
    monkeypatch.setattr(pdl, "_supported", {})
    capability = {"major": 9}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (capability["major"], 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return lambda major: capability.update(major=major)


def test_off_on_cpu_and_where_the_kernel_plan_turns_it_off(monkeypatch, fake_gpu):
    keep_kernel_plan(monkeypatch)
    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.launch(torch.device("cpu")) == {"PDL": False}  # no launch_pdl option: the interpreter's launches
    backend.set_kernels("pdl=off", triton=True)
    assert not pdl.enabled(torch.device("cuda"))
    assert pdl.inductor_options(torch.device("cuda")) == {}
    with pytest.raises(ValueError, match="K3_KERNELS: pdl='yes' must be on or off"):
        backend.set_kernels("pdl=yes")


def test_on_where_the_gpu_supports_it_logged_once(monkeypatch, fake_gpu, caplog):
    """Default on: capability >= 9 launches with PDL (and inductor's kernels too where torch has the option);
    capability 8 without; each device's answer is asked and logged once."""
    pytest.importorskip("triton")
    keep_kernel_plan(monkeypatch)
    backend.set_kernels(None, triton=True)
    with caplog.at_level(logging.INFO, logger="k3.ops"):
        assert pdl.enabled(torch.device("cuda"))
        assert pdl.launch(torch.device("cuda:0")) == {"PDL": True, "launch_pdl": True}
    assert caplog.text.count("launch with programmatic dependent launch") == 1
    from torch._inductor import config

    want = {"triton.enable_pdl": True} if hasattr(config.triton, "enable_pdl") else {}
    assert pdl.inductor_options(torch.device("cuda")) == want
    monkeypatch.setattr(pdl, "_supported", {})
    fake_gpu(8)
    with caplog.at_level(logging.INFO, logger="k3.ops"):
        assert not pdl.enabled(torch.device("cuda"))
    assert "without programmatic dependent launch (needs compute capability >= 9)" in caplog.text
