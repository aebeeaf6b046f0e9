"""Extra decode cases (H200): AttnRes none / snapshot / full decode-step overhead on small-1b (CUDA graphs, B=16,
4K context), and hybrid vs full-MLA decode at 128K context with larger batches. Writes decode_extra.{json,md}
to $K3_BENCH_OUT or benchmarks/results."""

import torch

from k3.bench.common import copy_bandwidth, cuda_time, environment, write_results
from k3.bench.decode import fill_cache, ours, peer_config, step_bytes
from k3.config import get_preset
from k3.infer.graphs import GraphedDecoder
from k3.model.decoder import K3ForCausalLM
from k3.ops import backend

backend.set_backend("fast")
bw = copy_bandwidth()
rows = []


def save():
    write_results("decode_extra", rows, ["case", "batch", "context", "ms_per_step", "tokens_per_s",
                                         "fraction_of_limit", "overhead_vs_none"],
                  environment() | {"copy_bandwidth_TBps": bw / 1e12})


base = None
for mode in ("none", "snapshot", "full"):
    m = K3ForCausalLM(get_preset("small-1b").replace(**{"attn_res.mode": mode})).cuda().to(torch.bfloat16).eval()
    cache = fill_cache(m, 16, 4096, 16)
    ids = torch.randint(0, 32768, (16,), device="cuda")
    with torch.no_grad():
        g = GraphedDecoder(m, cache)
        t = cuda_time(lambda: g(ids, list(range(16))), 2, 10)
    base = base or t
    rows.append({"case": f"small-1b AttnRes {mode} decode (graph)", "batch": 16, "context": 4096,
                 "ms_per_step": t * 1e3, "tokens_per_s": 16 / t, "overhead_vs_none": t / base - 1})
    save()
    del m, cache, g
    torch.cuda.empty_cache()
for full, batch in ((False, 32), (True, 32), (False, 64)):
    m = K3ForCausalLM(peer_config(full)).cuda().to(torch.bfloat16).eval()
    t = ours(m, batch, 131072, steps=16)
    limit = step_bytes(m, batch, 131072) / bw
    rows.append({"case": "full-MLA twin" if full else "hybrid 3:1", "batch": batch, "context": 131072,
                 "ms_per_step": t * 1e3, "tokens_per_s": batch / t, "fraction_of_limit": limit / t})
    save()
    del m
    torch.cuda.empty_cache()
