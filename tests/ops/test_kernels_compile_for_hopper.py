"""The Triton kernels written without a GPU compile for Hopper (sm_90a) on this CPU: Triton's NVIDIA backend lowers
each to PTX and ptxas (shipped with Triton) assembles it, at the decode shapes they are meant for. Triton's CPU
interpreter, which the other kernel tests use, runs the Python of a kernel, never the GPU compiler's lowering passes
or ptxas: what those reject would first show on a GPU. Skipped without Triton's NVIDIA backend."""

import glob
import os
import subprocess

import pytest

triton = pytest.importorskip("triton")
compiler = pytest.importorskip("triton.compiler")
targets = pytest.importorskip("triton.backends.compiler")
PTXAS = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))
pytestmark = pytest.mark.skipif(not PTXAS, reason="Triton's NVIDIA backend (ptxas) is not installed")


def assemble(kernel, types: dict, constants: dict, options: dict, tmp_path) -> str:
    """Compile ``kernel`` (arguments typed by ``types``, the rest constexprs from ``constants``) for sm_90a and
    assemble it with ptxas (``options``: num_warps, num_stages); -> ptxas's resource report."""
    sig = {a: types.get(a, "constexpr") for a in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(kernel.arg_names) if sig[a].startswith("*")}
    src = compiler.ASTSource(kernel, sig, {a: v for a, v in constants.items() if sig.get(a) == "constexpr"}, attrs)
    compiled = triton.compile(src, target=targets.GPUTarget("cuda", 90, 32), options=options)
    ptx = tmp_path / "kernel.ptx"
    ptx.write_text(compiled.asm["ptx"])
    done = subprocess.run([PTXAS[0], "-v", "--gpu-name", "sm_90a", str(ptx), "-o", str(tmp_path / "kernel.cubin")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stderr + done.stdout


@pytest.mark.parametrize("n,e,d,k,wdt", [(64, 64, 1024, 8, "fp32"), (1, 64, 1024, 8, "fp32"),
                                         (8, 896, 2048, 16, "bf16"), (200, 32, 64, 4, "fp32")])
def test_one_launch_router_compiles(n, e, d, k, wdt, tmp_path):
    from k3.ops.router import triton_gemm_topk as tg

    shape = tg.launch_shape(n, e, d)
    shape.pop("programs")
    types = dict(X="*bf16", W=f"*{wdt}", BIAS="*fp32", PART="*fp32", COUNTER="*i32", SCORES="*fp32", IDX="*i64",
                 WEIGHT="*fp32", N="i32", E="i32", D="i32", stride_x="i32", scaling="fp32")
    constants = dict(K=k, RENORMALIZE=True, BLOCK_E=tg.BLOCK_E, BLOCK_D=tg.BLOCK_D,
                     BLOCK_K=triton.next_power_of_2(k), **shape)
    assert "Used" in assemble(tg._router_gemm_topk_kernel, types, constants, {"num_warps": 8}, tmp_path)


@pytest.mark.parametrize("rows,width,state,conv", [(64, 4, "fp32", True), (16, 3, "bf16", True),
                                                   (64, 4, "fp32", False)])
def test_maps_with_convs_compile(rows, width, state, conv, tmp_path):
    from k3.ops.linear import triton_multi as tm

    types = {a: "*bf16" for a in ("X", *(f"W{i}" for i in range(8)), *(f"Y{i}" for i in range(8)))}
    types |= {a: "i32" for a in (*(f"N{i}" for i in range(8)), "M", "stride_xm")}
    types |= {a: ("*fp32" if conv else "*bf16") for a in ("CW0", "CW1", "CW2")}
    types |= {a: (f"*{state}" if conv else "*bf16") for a in ("S0", "S1", "S2")}
    types["SLOTS"] = "*i64" if conv else "*bf16"
    launch = tm.launch_config([1024, 1024, 1024, 64, 16, 64])
    constants = dict(G=6, K=1024, BLOCK_M=tm.block_m(rows), CONV=conv, WIDTH=width, SILU=True,
                     BLOCK_N=launch["BLOCK_N"], BLOCK_K=launch["BLOCK_K"])
    options = {"num_warps": launch["num_warps"], "num_stages": launch["num_stages"]}
    assert "Used" in assemble(tm._multi_linear_kernel, types, constants, options, tmp_path)
