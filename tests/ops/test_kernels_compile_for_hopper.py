"""Our Triton kernels compile for Hopper (sm_90a) on this CPU: each op runs on CPU tensors with its kernel launch
captured instead of made (the arguments exactly as the op passes them), then Triton's NVIDIA backend lowers the
kernel with those argument types and constants to PTX and ptxas (shipped with Triton) assembles it, at decode
shapes. Triton's CPU interpreter, which the other kernel tests use, runs the Python of a kernel, never the GPU
compiler's lowering passes or ptxas: what those reject would first show on a GPU. Skipped without Triton's NVIDIA
backend (CI has no Triton)."""

import glob
import os
import subprocess
from types import SimpleNamespace
from unittest.mock import patch

import pytest
import torch

triton = pytest.importorskip("triton")
compiler = pytest.importorskip("triton.compiler")
targets = pytest.importorskip("triton.backends.compiler")
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from k3.ops import pdl  # noqa: E402

PTXAS = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))
pytestmark = pytest.mark.skipif(not PTXAS, reason="Triton's NVIDIA backend (ptxas) is not installed")
_TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
}
_OPTIONS = ("num_warps", "num_stages", "launch_pdl")


def launches(monkeypatch, op) -> list[tuple]:
    """Run ``op()`` with every Triton launch captured, not made -> [(kernel, {argument: value}, options)]. An
    autotuned kernel is captured with its first configuration."""
    seen = []

    def run(self, *args, grid, warmup, **kwargs):
        bound = dict(zip(self.arg_names, args)) | {k: v for k, v in kwargs.items() if k in self.arg_names}
        seen.append((self, bound, {k: v for k, v in kwargs.items() if k in _OPTIONS}))

    def tuned(self, *args, **kwargs):
        config = self.configs[0]
        return run(self.fn, *args, **kwargs, **config.all_kwargs())

    monkeypatch.setattr(JITFunction, "run", run)
    monkeypatch.setattr(Autotuner, "run", tuned)
    op()
    return seen


def assemble(kernel, values: dict, options: dict, tmp_path) -> str:
    """Compile ``kernel`` for sm_90a with the argument types of ``values`` (tensors: pointers to their dtype;
    ints: i32 or i64; floats: fp32) and its constexprs' values, assemble it with ptxas -> ptxas's report."""
    sig, constants = {}, {}
    for p in kernel.params:
        v = values.get(p.name, p.default)
        if p.is_constexpr:
            sig[p.name], constants[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + _TYPES[v.dtype]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if -(2**31) <= v < 2**31 else "i64"
        else:
            sig[p.name] = "fp32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(kernel.params) if sig[p.name].startswith("*")}
    src = compiler.ASTSource(kernel, sig, constants, attrs)
    compiled = triton.compile(src, target=targets.GPUTarget("cuda", 90, 32), options=options)
    ptx = tmp_path / f"{kernel.__name__}.ptx"
    ptx.write_text(compiled.asm["ptx"])
    done = subprocess.run(
        [PTXAS[0], "-v", "--gpu-name", "sm_90a", str(ptx), "-o", str(tmp_path / "k.cubin")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stderr + done.stdout


def _maps(rows, router=False):
    from k3.ops.linear.triton_multi import multi_linear

    ws = [torch.randn(n, 1024).bfloat16() for n in (3072, 576)] + [torch.randn(64, 1024)] * router  # fp32 slot
    return lambda: multi_linear(torch.randn(rows, 1024).bfloat16(), ws, int(router))


def _conv_steps(rows):
    from k3.ops.conv.triton_step import conv_steps

    xs = [torch.randn(rows, n).bfloat16() for n in (1024, 1024, 1024)]
    return lambda: conv_steps(
        *xs,
        *(torch.randn(1024, 4) for _ in range(3)),
        *(torch.randn(rows + 1, 1024, 3) for _ in range(3)),
        torch.arange(rows),
        True,
    )


def _router_topk(n, e, k):
    from k3.ops.router.triton_topk import router_topk

    return lambda: router_topk(torch.randn(n, e), torch.randn(e), k, True, 2.5)


def _moe_route(n, k, e, align=8):
    from k3.ops.moe.triton_route import moe_route

    return lambda: moe_route(torch.randint(0, e, (n, k)), e, align)


def _packed_experts(n, e, k, d, i):
    from k3.model.activation import make_glu
    from k3.ops.moe import mxfp4
    from k3.ops.moe.triton_mxfp4 import moe_mxfp4
    from k3.quant.packed import PackedExperts

    bank = mxfp4._bank(PackedExperts(e, d, i).bfloat16())
    idx = torch.rand(n, e).topk(k).indices
    return lambda: moe_mxfp4(torch.randn(n, d).bfloat16(), idx, torch.rand(n, k), bank, make_glu("situ"))


def _small_groups(n, e, k, d, i):
    from k3.ops.moe import grouped
    from k3.ops.moe.small_groups import small_groups_glu, small_groups_mm

    route = grouped._route(torch.rand(n, e).topk(k).indices, e)
    w1, w3, w2 = torch.randn(e, i, d).bfloat16(), torch.randn(e, i, d).bfloat16(), torch.randn(e, d, i).bfloat16()

    def both():
        h = small_groups_glu(torch.randn(n, d).bfloat16(), route.src_pair, k, w1, w3, route.offs, "situ", 1.0, 0.5)
        small_groups_mm(h, w2, route.offs)

    return both


def _kda_core(n, h, dk, dv, rg, bound, warps=None):
    from k3.ops.kda.triton_decode import kda_decode_core

    bf = torch.bfloat16
    args = (
        torch.randn(n, h * dk).to(bf),
        torch.randn(n, h * dk).to(bf),
        torch.randn(n, h * dv).to(bf),
        torch.randn(n, dk).to(bf),
        torch.randn(h * dk, dk).to(bf),
        torch.randn(n, h).to(bf),
        torch.randn(n, rg or h * dv).to(bf),
        torch.randn(h * dv, rg).to(bf) if rg else None,
        torch.rand(h),
        torch.randn(h * dk),
        torch.rand(dv),
        torch.randn(n + 1, h, dk, dv),
        torch.arange(n),
        bound,
        1e-6,
        1e-5,
        bf,
    )
    if warps is None:
        return lambda: kda_decode_core(*args)

    def run():
        with patch("k3.ops.kda.triton_decode._warps", lambda *a: warps):  # what a GPU with <= 256 SMs picks
            kda_decode_core(*args)

    return run


def _mla(b, h, length):
    from k3.ops.mla import triton_decode

    kv = torch.randn(b, length + 8, 576).bfloat16()
    h200 = SimpleNamespace(multi_processor_count=132)  # the split count reads the GPU's SM count

    def run():
        with patch("torch.cuda.get_device_properties", lambda device: h200):
            triton_decode.mla_decode(
                torch.randn(b, h, 576).bfloat16(),
                kv,
                torch.arange(b).int(),
                torch.full((b,), length).int(),
                0.1,
                512,
                max_length=length,
            )

    return run


CASES = {
    "multi_linear": _maps(64),
    "multi_linear with a router": _maps(64, router=True),
    "conv_steps": _conv_steps(64),
    "router_topk": _router_topk(64, 896, 16),
    "moe_route": _moe_route(64, 8, 64),
    "moe_route unpadded": _moe_route(64, 16, 896, align=1),
    "packed experts": _packed_experts(64, 64, 8, 1024, 512),
    "small_groups": _small_groups(64, 64, 8, 1024, 512),
    "kda_decode_core low-rank gate": _kda_core(64, 16, 64, 64, 64, None),
    "kda_decode_core full gate, bounded": _kda_core(16, 8, 128, 128, 0, -5.0),
    "kda_decode_core one warp": _kda_core(64, 16, 64, 64, 64, None, warps=1),
    "mla_decode": _mla(4, 16, 4096),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_compiles_for_hopper(case, monkeypatch, tmp_path):
    seen = launches(monkeypatch, CASES[case])
    assert seen, "no Triton launch captured"
    for kernel, values, options in seen:
        assert "Used" in assemble(kernel, values, options, tmp_path), kernel.__name__


# kernels that read, before their wait, data the kernel before them does not write (k3.ops.pdl's docstring)
READ_BEFORE_WAIT = {"_kda_decode_kernel", "_conv_steps_kernel"}


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_waits_for_its_predecessor_with_pdl(case, monkeypatch, tmp_path):
    """With programmatic dependent launch on (k3.ops.pdl), each kernel is launched with it and waits for the kernel
    before it (griddepcontrol.wait) before its first global load or store, then releases the next one; the kernels
    of READ_BEFORE_WAIT load before the wait (they do), but store nothing."""
    monkeypatch.setattr(pdl, "enabled", lambda device: True)
    seen = launches(monkeypatch, CASES[case])
    assert seen, "no Triton launch captured"
    for kernel, values, options in seen:
        assert options.get("launch_pdl") is True and values["PDL"] is True, kernel.__name__
        assemble(kernel, values, options, tmp_path)
        ptx = (tmp_path / f"{kernel.__name__}.ptx").read_text()
        body = ptx[ptx.index(".entry") :]
        wait = body.find("griddepcontrol.wait")
        assert wait >= 0, kernel.__name__
        writes = [i for i in (body.find(op) for op in ("st.global", "atom.global", "red.global")) if i >= 0]
        reads = [i for i in (body.find(op) for op in ("ld.global", "cp.async")) if i >= 0]
        assert wait < min(writes), kernel.__name__
        assert (min(reads) < wait) == (kernel.__name__ in READ_BEFORE_WAIT), kernel.__name__
        assert wait < body.find("griddepcontrol.launch_dependents"), kernel.__name__
