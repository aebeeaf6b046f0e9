"""The kernel plan (k3.ops.backend, k3.ops.kernel_plan): resolved from the device, Triton's usability and the user's
choice, without a GPU."""

import logging

import pytest
import torch

from k3.ops import backend
from k3.ops.moe import cuda_mxfp4
from k3.ops.kernel_plan import plan, plan_report, plan_summary, plan_table
from tests.ops.kernel_switch import keep_kernel_plan

CPU = torch.device("cpu")


@pytest.fixture
def fresh(monkeypatch):
    """A plan resolved anew for the test, every choice restored afterwards."""
    keep_kernel_plan(monkeypatch)
    monkeypatch.setattr(backend, "_choice", backend.get_backend())
    for entry in backend.registered().values():
        monkeypatch.setattr(entry, "fast_ok", {})


def test_every_op_and_kernel_has_one_row(fresh):
    rows = plan(CPU)
    names = [r[0] for r in rows]
    assert len(names) == len(set(names))
    assert set(backend.registered()) <= set(names)  # every op package registered by k3.ops.kernel_plan's imports
    assert {f"kernel {k}" for k in backend.KERNELS} <= set(names)
    ops = dict((r[0], r[1:]) for r in rows)
    assert ops["chunk_kda"] == ("reference", "its fast path does not run on cpu")
    assert ops["causal_conv1d"][0].startswith("fast")  # the flat form runs everywhere


def test_backend_choice(fresh):
    backend.set_backend("reference")
    assert all(runs.startswith("reference") for name, runs, _ in plan(CPU) if not name.startswith("kernel "))
    backend.set_backend("fast")
    rows = dict((r[0], r[1:]) for r in plan(CPU))
    assert rows["chunk_kda"][0] == "error" and "fast path cannot run on cpu" in rows["chunk_kda"][1]
    with pytest.raises(ValueError, match="backend='gpu' must be one of auto, reference, fast"):
        backend.set_backend("gpu")


def test_kernels_default_to_triton_where_usable_and_follow_k3_kernels(fresh, monkeypatch):
    backend.set_kernels(None, triton=False)
    assert backend.kernel_choices()["router_topk"] == ("torch", "Triton is not usable here")
    backend.set_kernels(None, triton=True)
    choices = backend.kernel_choices()
    default_on = [k for k, v in backend.KERNELS.items() if not v.why_not]
    assert all(choices[k][0] == backend.KERNELS[k].on for k in default_on)
    # a kernel that needs more than Triton (NVRTC's kernel: a CUDA GPU, compute capability 8) says why it is off
    why = cuda_mxfp4.why_not(torch.device("cuda"))
    assert choices["moe_mxfp4_rows"] == (("triton", why) if why else ("cuda", "default"))
    if why:
        with pytest.raises(ValueError, match=f"K3_KERNELS: moe_mxfp4_rows=cuda cannot run here: {why}"):
            backend.set_kernels("moe_mxfp4_rows=cuda")
    monkeypatch.setenv("K3_KERNELS", "moe_small_groups=grouped_mm, pdl=off")
    backend.set_kernels(None)
    choices = backend.kernel_choices()
    assert choices["moe_small_groups"] == ("grouped_mm", "K3_KERNELS") and choices["pdl"] == ("off", "K3_KERNELS")
    assert choices["router_topk"] == ("triton", "default")
    table = plan_table(CPU)
    assert table.splitlines()[0] == (
        "kernel plan on cpu (K3_BACKEND=auto, K3_KERNELS=moe_small_groups=grouped_mm, pdl=off)"
    )
    assert "kernel moe_small_groups  grouped_mm" in table


@pytest.mark.parametrize(
    "spec,message",
    [
        ("router=torch", "'router=torch' must be name=value with a name among multi_linear, "),
        ("router_topk", "'router_topk' must be name=value"),
        ("conv_step=off", "conv_step='off' must be triton or torch"),
    ],
)
def test_bad_kernel_choices_are_one_clear_error(fresh, spec, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        backend.set_kernels(spec)


def test_resolved_once(fresh, monkeypatch):
    """The choices are kept: changing K3_KERNELS later does nothing until set_kernels resolves again."""
    backend.set_kernels(None, triton=True)
    monkeypatch.setenv("K3_KERNELS", "multi_linear=torch")
    assert backend.kernel_choice("multi_linear") == "triton"
    backend.set_kernels(None)
    assert backend.kernel_choice("multi_linear") == "torch"


def test_without_triton_no_kernel_row_claims_triton_code(fresh):
    """Where Triton is not usable, a kernel whose off form is Triton code too (moe_mxfp4_rows: kernel moe_mxfp4)
    shows what runs instead."""
    backend.set_kernels(None, triton=False)
    kernels = {name.removeprefix("kernel "): runs for name, runs, _ in plan(CPU) if name.startswith("kernel ")}
    assert kernels["moe_mxfp4_rows"] == "torch"
    assert not {"triton", "fla", "cuda", "on"} & set(kernels.values()), kernels
    backend.set_kernels(None, triton=True)  # where Triton runs, the off forms stand
    kernels = {name.removeprefix("kernel "): runs for name, runs, _ in plan(CPU) if name.startswith("kernel ")}
    assert kernels["moe_mxfp4_rows"] in ("cuda", "triton")


def test_a_plan_where_nothing_of_ours_runs_is_one_line(fresh):
    backend.set_kernels(None, triton=False)
    line = plan_report(CPU)
    assert line == plan_summary(CPU) and "\n" not in line
    fast = line.removeprefix("kernel plan on cpu: PyTorch reference ops (").split(":")[0].split(", ")
    assert line.startswith("kernel plan on cpu: PyTorch reference ops (") and "causal_conv1d" in fast
    assert all(name == "causal_conv1d" or name.endswith("_test_op") for name in fast)  # ops other tests register
    assert "none of our kernels (Triton is not usable here)" in line and "k3 info --kernels or -v" in line
    assert plan_report(CPU, verbose=True) == plan_table(CPU)
    backend.set_backend("reference")
    assert plan_summary(CPU).startswith("kernel plan on cpu: PyTorch reference ops (K3_BACKEND=reference), none")
    backend.set_backend("fast")  # an op that cannot run: the table says which
    assert plan_summary(CPU) is None and plan_report(CPU) == plan_table(CPU)
    backend.set_backend("auto")
    backend.set_kernels(None, triton=True)  # a kernel on: the table
    assert plan_summary(CPU) is None


def test_each_op_backend_is_logged_at_debug(fresh, monkeypatch, caplog):
    entry = backend.registered()["rms_norm"]
    monkeypatch.setattr(entry, "logged", set())
    with caplog.at_level(logging.INFO, logger="k3.ops"):
        backend.resolve("rms_norm", CPU)
    assert not [r for r in caplog.records if "runs backend" in r.getMessage()]
    monkeypatch.setattr(entry, "logged", set())
    with caplog.at_level(logging.DEBUG, logger="k3.ops"):
        backend.resolve("rms_norm", CPU)
    assert [r.levelno for r in caplog.records if "op rms_norm runs backend reference" in r.getMessage()] == [
        logging.DEBUG
    ]
