"""Shared test fixtures."""

import subprocess
import sys

import pytest
import torch


def _perturb(model, query_std: float = 0.5, bias_std: float = 0.1):
    """Random non-zero AttnRes pseudo-queries and router biases (both start at zero), so every branch does
    real work: depth mixes are not uniform and expert selection differs from the raw scores."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight") and query_std:
                p.normal_(0, query_std)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias") and bias_std:
                b.normal_(0, bias_std)
    return model


def pack_model_experts(model):
    """The model with every MoE layer's routed experts packed in MXFP4 (k3.quant.packed) from its current float
    weights, expert by expert: what loading a packed checkpoint of it gives."""
    from k3.quant.packed import PackedExperts, pack_weight, use_packed_experts

    state = model.state_dict()
    use_packed_experts(model)
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, PackedExperts):
                for w in ("w1", "w2", "w3"):
                    codes, scales = zip(*(pack_weight(t) for t in state[f"{name}.{w}"]))
                    getattr(m, f"{w}_packed").copy_(torch.stack(codes))
                    getattr(m, f"{w}_scale").copy_(torch.stack(scales))
    return model


@pytest.fixture(scope="session")
def perturb():
    return _perturb


@pytest.fixture(scope="session")
def triton_interpreter():
    """run(script): run a Python script in Triton's CPU interpreter, in a subprocess (TRITON_INTERPRET is read when a
    kernel is defined), and assert that it prints "ok" and nothing else. Skips the test where Triton is missing."""
    pytest.importorskip("triton")

    def run(script: str) -> None:
        env = {"TRITON_INTERPRET": "1", "PATH": "", "PYTHONPATH": ":".join(sys.path)}
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]

    return run
