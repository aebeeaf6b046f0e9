"""AttnRes at depth on a GPU (benchmarks/attn_res_depth.py's measurement): bf16 autocast, peak memory per mode."""

import pytest
import torch

from k3.audit.measure import attn_res_depth
from k3.config import get_preset

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_attn_res_depth_on_cuda():
    d = attn_res_depth(get_preset("small"), tokens=256, repeats=1, hidden=128, modes=("none", "full"), device="cuda")
    assert d["dtype"] == "bf16 autocast" and d["device"] != "CPU"
    none, full = d["rows"]
    assert 0 < none["peak_bytes"] < full["peak_bytes"] and full["peak_vs_none"] > 1
    assert none["saved_bytes"] < full["saved_bytes"] and all(r["ms"] > 0 for r in d["rows"])
