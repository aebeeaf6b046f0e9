"""K3's true-width layers on one GPU: ``k3-slice`` (the dense first layer, 3 KDA-MoE + 1 MLA-MoE layers at K3's exact
widths, 896 experts top-16) with its routed experts kept packed in MXFP4 (k3.quant.packed), built on the GPU.

The model (k3.bench.slice_model) is built on the meta device, its experts replaced by :class:`PackedExperts`, then
given GPU storage and random values there: E2M1 codes uniform over all 16 codes, E8M0 scales 2^-8..2^-6 (the scale
of a block of N(0, 0.02) weights), the rest bf16 as ``init_weights`` draws it, a random router bias so the routing
spreads. In bf16 the experts alone would be ~236 GB; packed they are ~63 GB, the rest of the slice ~11 GB.

Phases (each guarded: a failure is recorded in its row and the next phase still runs):

- decode: ms per step at B = 1, 8, 64 and 4K / 32K / 128K, the step replayed from a CUDA graph
  (k3.bench.decode.ours), against the bytes a step must read: dense weights once, the packed bytes of the distinct
  experts the batch selects (counted in one eager step; E (1 - (1 - k/E)^B) expected), KDA states read and written,
  conv states, every cached MLA latent. The same step with the routed experts replaced by zeros, then also the
  KDA-MoE layers skipped, then every MoE layer skipped, gives the per-layer parts (:func:`layer_times`).
- kernels: one eager decode step's device time by kernel (torch.profiler) at B=64 / 32K and B=1 / 4K, the most
  expensive first: what the decode parts do not split (KDA, MLA, the MoE layer's other maps). With programmatic
  dependent launch (k3.ops.pdl) a kernel starts before its predecessor ends and its time includes that wait; run
  with ``K3_KERNELS=pdl=off`` for each kernel's own time.
- prefill: one 32K sequence in chunks of PREFILL_CHUNK tokens through the cache; the packed-experts kernel reads
  codes and scales at any number of rows (no expert is dequantised to memory).
- bf16: one KDA-MoE layer's experts in bf16 (59 GB) in place of its packed bank (freed): that MoE layer alone at
  B = 1 / 8 / 64 both ways, and the decode step at B=64 / 32K (~118 GB held).
- experts: the packed-experts op on one layer's bank at a local batch (B tokens over all experts) and at an
  expert-parallel share (B k rows over the E / 64 experts one of 64 GPUs holds).
- extrapolation to K3's 93 layers on 64 GPUs (expert parallel, attention data parallel): per GPU and step, the
  measured rest (embedding, dense layer, lm_head) + 68 KDA-MoE and 24 MLA-MoE layers without routed experts + 92
  times the packed-experts op on one GPU's expert-parallel share; the two all-to-alls per MoE layer are not included
  (``k3 plan --preset k3 --gpus 64`` estimates them with its fabric model). An estimate, not a measurement.

``smoke=True`` runs the same code on the CPU with the tiny preset in the slice's layout (eager steps instead of
CUDA graphs), for tests. About 7 minutes on an H200 (estimate).
"""

from __future__ import annotations

import math
import time
import types

import torch
from torch import nn

from k3.bench.common import (
    busy_seconds,
    copy_bandwidth,
    device_activity,
    environment,
    graph_seconds,
    read_bandwidth,
    write_results,
)
from k3.bench.decode import fill_cache, ours
from k3.bench.slice_model import (
    bf16_experts,
    build_packed,
    expected_hit,
    expert_accounting,
    model_bytes,
    slice_step_bytes,
    smoke_config,
)
from k3.config import K3Config, get_preset
from k3.model.cache import cache_bytes_per_sequence
from k3.model.decoder import K3ForCausalLM
from k3.model.moe import MoE
from k3.ops import backend
from k3.ops.moe.mxfp4 import moe_experts_packed

GB, GIB = 1e9, 2**30
BATCHES, CONTEXTS, PREFILL, PREFILL_CHUNK = (1, 8, 64), (4096, 32768, 131072), 32768, 4096
EP_GPUS = 64
MARGIN = 8 * GIB  # free memory a decode case keeps beyond its cache (graph pool, workspace)
COLUMNS = [
    "phase",
    "case",
    "batch",
    "context",
    "ms",
    "tokens_per_s",
    "step_GB",
    "limit_ms",
    "fraction_of_limit",
    "fraction_of_read_limit",
    "experts_hit",
    "expected_hit",
    "peak_GiB",
    "error",
]


# ------------------------------------------------------------------ timing
def _cuda(model: nn.Module) -> bool:
    return model.lm_head.weight.is_cuda


def _peak() -> float | None:
    return torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else None


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def host_cache(model: K3ForCausalLM, batch: int, context: int, steps: int):
    """A cache of ``batch`` sequences at ``context`` with random latents and states on a CPU model (what
    k3.bench.decode.fill_cache does on the GPU)."""
    cache = model.new_cache(batch, dtype=torch.bfloat16, capacity=context + steps + 8)
    for layer in cache.layers:
        if hasattr(layer, "kv"):
            layer.kv[:, :context].normal_()
            layer.lengths = [context] * batch
        else:
            layer.recurrent.normal_().mul_(0.05)
            for c in layer.conv:
                c.normal_()
    cache.seq_lens = [context] * batch
    return cache


def new_filled_cache(model: K3ForCausalLM, batch: int, context: int, steps: int):
    return fill_cache(model, batch, context, steps) if _cuda(model) else host_cache(model, batch, context, steps)


def wall_time(fn, warmup: int = 1, iters: int = 2) -> float:
    """Mean seconds per call of ``fn`` on the host clock (CPU runs)."""
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


@torch.no_grad()
def decode_seconds(model: K3ForCausalLM, batch: int, context: int, steps: int) -> float:
    """Seconds per decode step: replayed from a CUDA graph (k3.bench.decode.ours) on a GPU, eager on the CPU."""
    if _cuda(model):
        return ours(model, batch, context, steps=steps, mode="graph")
    cache = host_cache(model, batch, context, steps + 4)
    ids = torch.randint(0, model.config.vocab_size, (batch,))
    seq = list(range(batch))
    return wall_time(lambda: model.decode(ids, cache, seq), warmup=1, iters=steps)


@torch.no_grad()
def experts_hit(model: K3ForCausalLM, batch: int, context: int) -> list[int]:
    """Distinct experts each MoE layer selects in one eager decode step of ``batch`` sequences at ``context``."""
    counts: list[int] = []

    def hook(_m, _inputs, out):
        counts.append(int(torch.unique(out[1].topk_idx).numel()))

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, MoE)]
    try:
        cache = new_filled_cache(model, batch, context, 4)
        ids = torch.randint(0, model.config.vocab_size, (batch,), device=model.lm_head.weight.device)
        model.decode(ids, cache, list(range(batch)))
    finally:
        for h in handles:
            h.remove()
    return counts


def skip_layers(model: K3ForCausalLM, layers: list[int]) -> None:
    """Make decoder layers ``layers`` no-ops (undone by :func:`unskip`)."""
    for i in layers:
        model.model.layers[i].forward = types.MethodType(lambda self, *a, **k: None, model.model.layers[i])


def skip_routed_experts(model: K3ForCausalLM) -> None:
    """Replace every MoE layer's routed experts by zeros (one memset; router, latent projections, norm and shared
    experts still run), through the layer's ``expert_dispatch`` hook (undone by :func:`unskip`)."""
    for m in model.modules():
        if isinstance(m, MoE):
            m.expert_dispatch = lambda _moe, z, _idx, _w: torch.zeros_like(z)


def unskip(model: K3ForCausalLM) -> None:
    for layer in model.model.layers:
        layer.__dict__.pop("forward", None)
    for m in model.modules():
        if isinstance(m, MoE):
            m.expert_dispatch = None


def _graph_or_wall(device: torch.device, fn, iters: int) -> float:
    return graph_seconds(fn, iters) if device.type == "cuda" else wall_time(fn, 1, max(1, iters // 10))


@torch.no_grad()
def experts_seconds(moe: MoE, rows: int, k: int, experts: int, iters: int = 20) -> float:
    """Seconds of the packed-experts op on ``rows`` latent rows, each with ``k`` distinct experts among the first
    ``experts`` of ``moe``'s bank (a view: an expert-parallel rank's share when ``experts`` < E)."""
    bank = moe.experts
    device = bank.w1_packed.device
    view = types.SimpleNamespace(
        **{f"{w}_{p}": getattr(bank, f"{w}_{p}")[:experts] for w in ("w1", "w2", "w3") for p in ("packed", "scale")},
        dtype=torch.bfloat16,
    )
    width = 2 * bank.w1_packed.shape[2]
    x = torch.randn(rows, width, device=device, dtype=torch.bfloat16)
    idx = torch.rand(rows, experts, device=device).topk(k, dim=-1).indices
    weight = torch.rand(rows, k, device=device)
    return _graph_or_wall(device, lambda: moe_experts_packed(x, idx, weight, view, moe.glu), iters)


@torch.no_grad()
def moe_seconds(moe: MoE, tokens: int, iters: int = 20) -> float:
    """Seconds of one whole MoE layer (router, latent projections, routed and shared experts) on ``tokens`` rows."""
    device = moe.gate.weight.device
    x = torch.randn(tokens, moe.gate.weight.shape[1], device=device, dtype=torch.bfloat16)
    return _graph_or_wall(device, lambda: moe(x), iters)


@torch.no_grad()
def prefill_seconds(model: K3ForCausalLM, length: int, chunk: int) -> float:
    """Seconds to prefill one sequence of ``length`` tokens in chunks of ``chunk`` through the cache (after a
    two-chunk warm-up on a separate cache)."""
    device = model.lm_head.weight.device
    ids = torch.randint(0, model.config.vocab_size, (1, length), device=device)

    def prefill(n: int) -> None:
        cache = model.new_cache(1, dtype=torch.bfloat16, capacity=n + 8)
        for s in range(0, n, chunk):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                model(ids[:, s : s + chunk], cache=cache, last_only=True)

    prefill(min(length, 2 * chunk))
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    prefill(length)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


# ------------------------------------------------------------------ phases
def _guard(rows: list, row: dict, fn) -> dict:
    """Run ``fn(row)`` filling ``row``; an exception is recorded in the row, never raised."""
    try:
        fn(row)
    except Exception as e:  # recorded in the table, never hidden
        row["error"] = f"{type(e).__name__}: {e}"[:160]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    rows.append(row)
    print({k: v for k, v in row.items()}, flush=True)
    return row


def _fits(model: K3ForCausalLM, batch: int, context: int) -> tuple[bool, str]:
    """Whether a decode case's cache fits in the free GPU memory (with :data:`MARGIN`); always on the CPU."""
    need = batch * cache_bytes_per_sequence(model.config, context + 1100)["total_bytes"]
    if not _cuda(model):
        return True, ""
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    ok = need + MARGIN <= free
    return ok, "" if ok else f"skipped: cache {need / GIB:.1f} GiB + {MARGIN / GIB:.0f} GiB > {free / GIB:.1f} free"


def decode_row(model, batch: int, context: int, steps: int, bw: float, read_bw: float, hits=None) -> dict:
    """One decode case's table fields: time per step, the step's bytes (``hits``: distinct experts per MoE layer,
    else the expected count) and their fraction of the copy / read bandwidth limits, the GPU peak."""
    t = decode_seconds(model, batch, context, steps)
    nbytes = slice_step_bytes(model, batch, context, hits)
    return {
        "ms": t * 1e3,
        "tokens_per_s": batch / t,
        "step_GB": nbytes / GB,
        "limit_ms": nbytes / bw * 1e3,
        "fraction_of_limit": nbytes / bw / t,
        "fraction_of_read_limit": nbytes / read_bw / t,
        "expected_hit": expected_hit(model.config, batch),
        "peak_GiB": _peak(),
    }


def decode_phase(model, rows, batches, contexts, steps, bw, read_bw, per_layer: dict) -> None:
    """Decode rows, and the same step with parts skipped into ``per_layer[(B, context)]`` (seconds): ``full``,
    ``no_experts`` (routed experts replaced by zeros), ``mla_only`` (that, and the KDA-MoE layers skipped) and
    ``rest`` (every MoE layer skipped). Differences of steps without routed experts are small against the expert
    times, so per-layer attention and MoE-overhead times come out of them without subtracting two large numbers."""
    cfg = model.config
    moe_layers = list(cfg.moe_layers)
    kda_moe = [i for i in moe_layers if cfg.mixer(i) == "kda"]
    hits: dict[int, list[int]] = {}
    for context in contexts:
        for batch in batches:
            base = {"phase": "decode", "case": "k3-slice packed MXFP4, CUDA graph", "batch": batch, "context": context}
            if not _cuda(model):
                base["case"] = f"{cfg.name} packed MXFP4, eager (CPU)"
            ok, why = _fits(model, batch, context)
            if not ok:
                rows.append(base | {"error": why})
                print(rows[-1], flush=True)
                continue

            def case(row, batch=batch, context=context):
                _reset_peak()
                if batch not in hits:
                    hits[batch] = experts_hit(model, batch, min(context, 4096))
                h = hits[batch]
                row |= decode_row(model, batch, context, steps, bw, read_bw, h) | {"experts_hit": sum(h) / len(h)}

            row = _guard(rows, base, case)
            if "ms" not in row:
                continue
            parts = per_layer.setdefault((batch, context), {"full": row["ms"] / 1e3})
            for key, label, experts_off, layers in (
                ("no_experts", "routed experts skipped", True, []),
                ("mla_only", "routed experts and the KDA-MoE layers skipped", True, kda_moe),
                ("rest", "all MoE layers skipped (embedding, dense layer, head)", False, moe_layers),
            ):

                def without(r, key=key, experts_off=experts_off, layers=layers, batch=batch, context=context):
                    if experts_off:
                        skip_routed_experts(model)
                    skip_layers(model, layers)
                    try:
                        t = decode_seconds(model, batch, context, steps)
                    finally:
                        unskip(model)
                    r |= {"ms": t * 1e3, "tokens_per_s": batch / t}
                    parts[key] = t

                _guard(rows, {"phase": "decode parts", "case": label, "batch": batch, "context": context}, without)


@torch.no_grad()
def kernel_times(model: K3ForCausalLM, batch: int, context: int, steps: int = 2) -> tuple[float, list]:
    """Device time of ``steps`` eager decode steps under torch.profiler: (busy seconds per step, [(kernel name,
    seconds per step, launches per step)] most expensive first). The graph replays the same kernels back to back."""
    from torch.profiler import ProfilerActivity, profile

    cache = new_filled_cache(model, batch, context, steps + 2)
    ids = torch.randint(0, model.config.vocab_size, (batch,), device=next(model.parameters()).device)
    seq = list(range(batch))
    model.decode(ids, cache, seq)  # compiles, autotunes
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            model.decode(ids, cache, seq)
        torch.cuda.synchronize()
    events = device_activity(prof.events())
    by_name: dict[str, list] = {}
    for e in events:
        entry = by_name.setdefault(e.name, [0.0, 0])
        entry[0] += (e.time_range.end - e.time_range.start) / 1e6 / steps
        entry[1] += 1
    kernels = sorted(((n, t, c / steps) for n, (t, c) in by_name.items()), key=lambda x: -x[1])
    return busy_seconds(events) / steps, kernels


def kernels_phase(model, rows, cases, top: int = 12) -> None:
    """Where an eager decode step's device time goes, per kernel (the ``top`` most expensive), at each (B, context)
    of ``cases``: the rows the decode parts cannot split (KDA, MLA, the MoE layer's other maps)."""
    for batch, context in cases:
        listed: list[dict] = []

        def case(row, batch=batch, context=context, listed=listed):
            busy, kernels = kernel_times(model, batch, context)
            row |= {"ms": busy * 1e3}
            for name, t, count in kernels[:top]:
                listed.append(
                    {"phase": "kernels", "case": f"{name[:70]} (x{count:g})", "batch": batch, "context": context}
                    | {"ms": t * 1e3}
                )

        _guard(rows, {"phase": "kernels", "case": "device busy, eager step", "batch": batch, "context": context}, case)
        rows.extend(listed)


def experts_phase(model, rows, batches, ep_experts: int, per_layer_experts: dict) -> None:
    """The packed-experts op of one MoE layer: a local batch over all experts, and an expert-parallel share."""
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    e, k = model.config.moe.num_experts, model.config.moe.num_experts_per_token
    for batch in batches:
        for label, rows_, kk, ex in (
            ("local", batch, k, e),
            (f"expert-parallel share: {batch * k} rows over {ep_experts} experts", batch * k, 1, ep_experts),
        ):

            def case(row, rows_=rows_, kk=kk, ex=ex, label=label, batch=batch):
                t = experts_seconds(moe, rows_, kk, ex)
                row["ms"] = t * 1e3
                per_layer_experts[(batch, "ep" if ex != e else "local")] = t

            _guard(rows, {"phase": "experts op", "case": f"packed experts, {label}", "batch": batch}, case)


def prefill_phase(model, rows, length: int, chunk: int) -> None:
    def case(row):
        _reset_peak()
        t = prefill_seconds(model, length, chunk)
        row |= {"ms": t * 1e3, "tokens_per_s": length / t, "peak_GiB": _peak()}

    _guard(
        rows,
        {"phase": "prefill", "case": f"one sequence in chunks of {chunk} tokens", "batch": 1, "context": length},
        case,
    )


def bf16_phase(model, rows, batches, context: int, steps: int, bw, read_bw) -> None:
    """The first KDA-MoE layer: its MoE alone with packed vs bf16 experts, then the decode step with it in bf16."""
    cfg = model.config
    layer = next(i for i in cfg.moe_layers if cfg.mixer(i) == "kda")
    moe = model.model.layers[layer].block_sparse_moe
    device = moe.gate.weight.device
    for batch in batches:
        _guard(
            rows,
            {"phase": "bf16 vs packed", "case": f"MoE layer {layer} alone, packed MXFP4 experts", "batch": batch},
            lambda r, b=batch: r.update(ms=moe_seconds(moe, b) * 1e3),
        )

    try:  # the packed bank was measured above: freed, a bf16 bank takes its place
        shape = (moe.experts.w1_packed.shape[0], 2 * moe.experts.w1_packed.shape[2], moe.experts.w1_packed.shape[1])
        moe.experts = nn.Identity()
        _reset_peak()
        moe.experts = bf16_experts(*shape, device)  # E, D, I
    except Exception as e:  # recorded in the table, never hidden
        rows.append({"phase": "bf16 vs packed", "case": f"layer {layer}'s bf16 experts", "error": repr(e)[:160]})
        return
    for batch in batches:
        _guard(
            rows,
            {"phase": "bf16 vs packed", "case": f"MoE layer {layer} alone, bf16 experts", "batch": batch},
            lambda r, b=batch: r.update(ms=moe_seconds(moe, b) * 1e3),
        )
    batch = batches[-1]

    def step(row):
        _reset_peak()
        row |= decode_row(model, batch, context, steps, bw, read_bw)

    _guard(
        rows,
        {
            "phase": "bf16 vs packed",
            "case": f"decode step, layer {layer}'s experts bf16, the other MoE layers packed",
            "batch": batch,
            "context": context,
        },
        step,
    )


def layer_times(config: K3Config, parts: dict) -> dict | None:
    """Per-layer seconds from one case's step times (see :func:`decode_phase`): ``kda`` and ``mla`` (a MoE layer
    without its routed experts), ``experts`` (a layer's routed experts in the model, averaged), ``rest``."""
    if not {"full", "no_experts", "mla_only", "rest"} <= parts.keys():
        return None
    moe = list(config.moe_layers)
    n_kda = sum(config.mixer(i) == "kda" for i in moe)
    n_mla = len(moe) - n_kda
    return {
        "kda": (parts["no_experts"] - parts["mla_only"]) / n_kda,
        "mla": (parts["mla_only"] - parts["rest"]) / n_mla,
        "experts": (parts["full"] - parts["no_experts"]) / len(moe),
        "rest": parts["rest"],
    }


def extrapolate(config: K3Config, per_layer: dict, experts: dict, gpus: int = EP_GPUS) -> tuple[list[dict], list[str]]:
    """Per-GPU decode step of K3 (93 layers) on ``gpus`` GPUs, expert parallel, attention data parallel, from the
    slice's measured parts: rest + 68 KDA-MoE and 24 MLA-MoE layers without routed experts + 92 x the packed-experts
    op on one GPU's expert-parallel share (``experts[(B, "ep")]``). All-to-alls are not included (``k3 plan``).
    Returns rows for the JSON and one findings line per case."""
    k3 = get_preset("k3")
    moe_layers = list(k3.moe_layers)
    n_kda = sum(k3.mixer(i) == "kda" for i in moe_layers)
    n_mla = len(moe_layers) - n_kda
    out, lines = [], []
    for (batch, context), parts in sorted(per_layer.items()):
        t, ep = layer_times(config, parts), experts.get((batch, "ep"))
        if t is None or ep is None:
            continue
        step = t["rest"] + n_kda * t["kda"] + n_mla * t["mla"] + len(moe_layers) * ep
        row = {
            "batch_per_gpu": batch,
            "context": context,
            "gpus": gpus,
            "rest_ms": t["rest"] * 1e3,
            "kda_moe_layer_without_experts_ms": t["kda"] * 1e3,
            "mla_moe_layer_without_experts_ms": t["mla"] * 1e3,
            "experts_per_layer_local_ms": t["experts"] * 1e3,
            "experts_per_layer_ep_share_ms": ep * 1e3,
            "step_ms": step * 1e3,
            "tokens_per_s_per_gpu": batch / step,
            "tokens_per_s_cluster": gpus * batch / step,
        }
        out.append(row)
        lines.append(
            f"- extrapolation (not measured), K3 on {gpus} H200s expert parallel, B={batch} per GPU at {context}: "
            f"{step * 1e3:.1f} ms per step = rest {t['rest'] * 1e3:.2f} + {n_kda} x {t['kda'] * 1e3:.3f} (KDA-MoE "
            f"layer without routed experts) + {n_mla} x {t['mla'] * 1e3:.3f} (MLA-MoE) + {len(moe_layers)} x "
            f"{ep * 1e3:.3f} (packed experts on {batch * k3.moe.num_experts_per_token} rows over "
            f"{math.ceil(k3.moe.num_experts / gpus)} experts; {t['experts'] * 1e3:.3f} ms a layer at the local batch "
            f"over all experts); all-to-alls not included (k3 plan); {batch / step:,.0f} tokens/s per GPU, "
            f"{gpus * batch / step:,.0f} in all"
        )
    return out, lines


def run(out_dir: str | None = None, quick: bool = False, smoke: bool = False) -> None:
    """Measure k3-slice (or, ``smoke``, the tiny layout on the CPU) and write ``slice.{md,json}``."""
    started = time.perf_counter()
    if smoke and out_dir is None:  # never over the GPU result in benchmarks/results
        import tempfile

        out_dir = tempfile.mkdtemp(prefix="k3-slice-smoke-")
    rows: list[dict] = []
    meta: dict = environment()
    notes: list[str] = []
    cuda = not smoke
    if cuda:
        backend.set_backend("fast")
        config, device = get_preset("k3-slice"), torch.device("cuda")
        batches, contexts = BATCHES, (CONTEXTS[:2] if quick else CONTEXTS)
        steps, prefill_len = 16, PREFILL
        from k3.ops.kernel_plan import plan

        meta["kernel_plan"] = [" | ".join(r) for r in plan(device)]
    else:
        config, device = smoke_config(), torch.device("cpu")
        batches, contexts, steps, prefill_len = (1, 4), (32, 96), 2, 64
    chunk = PREFILL_CHUNK if cuda else 16
    save = lambda: write_results("slice", rows, COLUMNS, meta, "\n".join(notes), out_dir=out_dir)  # noqa: E731
    try:
        bw, read_bw = (copy_bandwidth(), read_bandwidth()) if cuda else (50e9, 50e9)
    except Exception as e:
        bw = read_bw = 4.2e12
        notes.append(f"- bandwidth not measured ({type(e).__name__}: {e}); 4.2 TB/s assumed")
    meta |= {"config": config.name, "copy_bandwidth_TBps": bw / 1e12, "read_bandwidth_TBps": read_bw / 1e12}
    model = None

    def build(row):
        nonlocal model
        _reset_peak()
        t0 = time.perf_counter()
        model = build_packed(config, device)
        acc, held = expert_accounting(model), model_bytes(model)
        row |= {"ms": (time.perf_counter() - t0) * 1e3, "peak_GiB": _peak()}
        meta["routed_expert_GB"] = acc["bytes"] / GB
        meta["routed_expert_bytes_per_weight"] = acc["bytes_per_weight"]
        meta["rest_GB"] = (sum(held.values()) - held.get("routed_experts", 0)) / GB
        meta["held_GB_by_path"] = {k: v / GB for k, v in held.items()}

    _guard(rows, {"phase": "build", "case": f"{config.name} on {device.type}, packed experts"}, build)
    save()
    if model is None:
        return
    per_layer: dict = {}
    experts: dict = {}
    decode_phase(model, rows, batches, contexts, steps, bw, read_bw, per_layer)
    save()
    if cuda:  # torch.profiler's CUDA activity
        kernels_phase(model, rows, [(64, 32768), (1, 4096)])
        save()
    ep_experts = max(1, math.ceil(config.moe.num_experts / EP_GPUS))
    experts_phase(model, rows, batches, ep_experts, experts)
    save()
    prefill_phase(model, rows, prefill_len, chunk)
    save()
    bf16_phase(model, rows, batches, contexts[min(1, len(contexts) - 1)], steps, bw, read_bw)
    save()
    try:
        meta["extrapolation"], lines = extrapolate(config, per_layer, experts)
        notes += lines
    except Exception as e:
        notes.append(f"- extrapolation failed: {type(e).__name__}: {e}")
    meta["wall_s"] = time.perf_counter() - started
    notes.insert(
        0,
        f"- {config.name}: routed experts {meta.get('routed_expert_GB', float('nan')):.1f} GB packed "
        f"({meta.get('routed_expert_bytes_per_weight', float('nan')):.4f} bytes a weight), the rest "
        f"{meta.get('rest_GB', float('nan')):.1f} GB bf16; limit = step bytes / copy bandwidth, experts counted "
        "as the distinct experts one eager step selected.",
    )
    save()


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--smoke", action="store_true", help="the tiny layout on the CPU (tests)")
    a = p.parse_args()
    run(out_dir=a.out, quick=a.quick, smoke=a.smoke)
