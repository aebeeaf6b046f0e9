"""Every k3 module imports on a CPU-only machine (those that need a GPU-only package, and the CLI entry point,
compile) and every script under benchmarks/ compiles: a syntax error in code the CPU suite never runs would
otherwise reach a GPU run first."""

import importlib
import importlib.util
import pkgutil
import py_compile
from pathlib import Path

import pytest

import k3

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(m.name for m in pkgutil.walk_packages(k3.__path__, "k3."))


COMPILE_ONLY = {"k3.__main__"}  # runs the CLI when imported
NEEDS = {
    "k3.ops.mla.triton_decode": "triton",  # imported lazily by their fast paths, on GPUs only
    "k3.ops.moe.small_groups": "triton",
    "k3.ops.router.triton_topk": "triton",
    "k3.ops.linear.triton_multi": "triton",
    "k3.ops.moe.triton_route": "triton",
    "k3.ops.conv.triton_step": "triton",
    "k3.ops.kda.triton_decode": "triton",
    "k3.ops.moe.triton_mxfp4": "triton",
}


@pytest.mark.parametrize("name", MODULES)
def test_module_imports(name, tmp_path):
    if name in COMPILE_ONLY or (name in NEEDS and importlib.util.find_spec(NEEDS[name]) is None):
        spec = importlib.util.find_spec(name)
        py_compile.compile(spec.origin, cfile=str(tmp_path / "x.pyc"), doraise=True)
    else:
        importlib.import_module(name)


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").glob("*.py")))
def test_benchmark_script_compiles(path, tmp_path):
    py_compile.compile(str(ROOT / path), cfile=str(tmp_path / "x.pyc"), doraise=True)
