"""Whole-model benchmarks on small-1b: (d) training step tokens/s and MFU vs transformers' KimiLinear with the
peer's shapes (case train_ac: the step with activation checkpointing, its time and peak memory; case train_accum:
an optimizer step of 8 such micro-batches, 262,144 tokens; cases train_fp8 / train_accum_fp8: the same with the
routed experts' matmuls in FP8 (k3.quant.fp8), their speed-up over the bf16 step in x_bf16_experts; MFU from
6 N_active per token at the bf16 peak (for FP8: the bf16-equivalent MFU), and (mfu_6N_attn) from the whole count
of k3.audit.accounting.flops_per_token (attention, KDA state and AttnRes mixes added); case floor: the step's
floor, k3.bench.floor, and the tokens/s, MFU and ratio to the peer it allows); (c) AttnRes
none / snapshot / full overhead in training and decode, peak memory (case attn_res_compiled: the decode step
compiled by torch.compile before its CUDA-graph capture); (f) one-GPU prefill of 128K and 1M tokens,
hybrid vs a full-MLA twin (time, peak memory)."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from k3.bench.common import cuda_time, device_time, environment, matmul_flops, write_results
from k3.bench.decode import fill_cache, hf_peer_config
from k3.bench.floor import floor_parts
from k3.infer.graphs import GraphedDecoder
from k3.config import get_preset
from k3.model.decoder import K3ForCausalLM
from k3.ops import backend
from k3.quant.fp8 import enable_fp8_experts
from k3.train.activation_checkpoint import apply_activation_checkpointing
from k3.train.muon import K3Muon
from k3.train.param_groups import param_groups_for

PEAK = 790e12  # measured bf16 matmul rate on this H200 class (spec)


def train_step_time(model, batch: int, seq: int, steps: int = 3, accum: int = 1) -> float:
    """Seconds per optimizer step of ``accum`` micro-batches of [batch, seq] tokens (forward + backward each)."""
    opt = K3Muon(param_groups_for(model, 1e-4), lr=1e-4, ns_dtype="bfloat16")
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")

    def step():
        for _ in range(accum):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(ids).logits
            F.cross_entropy(logits.float().flatten(0, 1), ids.flatten()).backward()
        opt.step()  # noqa: F821
        opt.zero_grad(set_to_none=True)  # noqa: F821

    t = cuda_time(step, warmup=2, iters=steps)
    del opt
    return t


def train_flops_per_token(model, seq: int) -> dict:
    """Training FLOPs per token of ``model`` at sequence ``seq``: 3x the forward count of
    k3.audit.accounting.flops_per_token (the one count k3 info and the audit print); "matmul" / 6 is the N of
    "6 N" MFU."""
    from k3.audit.accounting import flops_per_token
    from k3.model.accounting import parameter_counts

    return {k: 3 * v for k, v in flops_per_token(model.config, seq, counts=parameter_counts(model)).items()}


def activated_matmul_params(model) -> float:
    """N of "6 N": the activated matmul weights per token (input embedding and norms excluded)."""
    return train_flops_per_token(model, 1)["matmul"] / 6


def hf_peer_train(batch: int, seq: int) -> float | None:
    try:
        from transformers import KimiLinearForCausalLM
    except ImportError:
        return None
    hf = hf_peer_config()
    try:
        hf._experts_implementation = "grouped_mm"
    except Exception:
        pass
    model = KimiLinearForCausalLM(hf).cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 32768, (batch, seq), device="cuda")

    def step():
        model(input_ids=ids, labels=ids).loss.backward()  # noqa: F821
        opt.step()  # noqa: F821
        opt.zero_grad(set_to_none=True)  # noqa: F821

    try:
        t = cuda_time(step, warmup=2, iters=3)
    except Exception as e:
        print(f"transformers peer failed: {e!r}")
        t = None
    del model, opt
    torch.cuda.empty_cache()
    return t


CASES = (
    "train",
    "train_ac",
    "train_accum",
    "train_fp8",
    "train_accum_fp8",
    "peer",
    "floor",
    "attn_res",
    "attn_res_compiled",
    "prefill",
)
ACCUM = 8  # micro-batches of 8 x 4096 per optimizer step in case train_accum: 262,144 tokens, a realistic batch


def run(out_dir: str | None = None, quick: bool = False, cases=CASES) -> None:
    cases = [c.strip() for c in cases]
    unknown = set(cases) - set(CASES)
    if unknown:
        raise ValueError(f"unknown cases {sorted(unknown)}; choose from {', '.join(CASES)}")
    name = "model" if set(cases) == set(CASES) else "model-" + "-".join(c for c in CASES if c in cases)
    backend.set_backend("fast")
    rows = []

    def save():  # a subset writes model-<cases>.{json,md}, leaving the full run's model.{json,md} in place
        columns = [
            "case",
            "ms",
            "alone_ms",
            "tokens_per_s",
            "mfu_6N",
            "mfu_6N_attn",
            "x_transformers",
            "x_bf16_experts",
            "decode_ms",
            "train_overhead",
            "decode_overhead",
            "peak_GiB",
            "error",
        ]
        write_results(name, rows, columns, environment(), out_dir=out_dir)

    batch, seq = (8, 4096)  # the peer's shapes
    t = None
    # (d) training step; with activation checkpointing: the memory it saves; with ACCUM micro-batches a step; with
    # the routed experts' matmuls in FP8 (MFU still counts their FLOPs at the bf16 peak: the bf16-equivalent MFU)
    steps: dict[str, float] = {}
    for case in ("train", "train_ac", "train_accum", "train_fp8", "train_accum_fp8"):
        if case not in cases:
            continue
        model = K3ForCausalLM(get_preset("small-1b")).cuda()
        if case == "train_ac":
            apply_activation_checkpointing(model)
        if case.endswith("_fp8"):
            enable_fp8_experts(model)
        accum = ACCUM if case.startswith("train_accum") else 1
        torch.cuda.reset_peak_memory_stats()
        tc = train_step_time(model, batch, seq, accum=accum)
        n_act = activated_matmul_params(model)
        tps = accum * batch * seq / tc
        label = {
            "train": "",
            "train_ac": " activation checkpointing",
            "train_accum": f" x {accum} a step",
            "train_fp8": " FP8 experts",
            "train_accum_fp8": f" x {accum} a step, FP8 experts",
        }[case]
        steps[case] = tc
        bf16_case = case.removesuffix("_fp8")
        rows.append(
            {
                "case": f"train small-1b B{batch} T{seq}{label}",
                "ms": tc * 1e3,
                "tokens_per_s": tps,
                "mfu_6N": 6 * n_act * tps / PEAK,
                "mfu_6N_attn": train_flops_per_token(model, seq)["total"] * tps / PEAK,
                "peak_GiB": torch.cuda.max_memory_allocated() / 2**30,
                **({"x_bf16_experts": steps[bf16_case] / tc} if case != bf16_case and bf16_case in steps else {}),
            }
        )
        t = tc if case == "train" else t
        save()
        del model
        torch.cuda.empty_cache()
    peer = None if quick or "peer" not in cases else hf_peer_train(batch, seq)
    if peer:
        rows.append(
            {
                "case": f"transformers KimiLinear 1.27B B{batch} T{seq}",
                "ms": peer * 1e3,
                "tokens_per_s": batch * seq / peer,
            }
        )
        if t is not None:
            rows[0]["x_transformers"] = peer / t
    if "floor" in cases:
        floor_rows(rows, batch, seq, peer)
        save()
    if "attn_res" in cases:
        attn_res_rows(rows, save)
    if "attn_res_compiled" in cases:
        attn_res_rows(rows, save, compiled=True)
    if "prefill" in cases:
        prefill_rows(rows, save, quick)
    save()


def floor_rows(rows: list, batch: int, seq: int, peer: float | None) -> None:
    """(d) continued: the parts of small-1b's training-step floor (k3.bench.floor), one row each, then their sum
    with the tokens/s and MFU it allows and its ratio to the peer's step (when measured). A part's ``ms`` is the
    device's own work in it (:func:`device_time`), what a step that keeps the device fed pays; ``alone_ms`` the same
    calls by CUDA events, with the gaps where the device waits for the host when the part runs alone."""
    model = K3ForCausalLM(get_preset("small-1b")).cuda()
    n_act = activated_matmul_params(model)
    rate = matmul_flops()
    parts = floor_parts(model, batch, seq, rate, device_time, n_act)
    walls = floor_parts(model, batch, seq, rate, cuda_time, n_act)  # alone: the host's gaps included
    rows += [{"case": f"floor part: {name}", "ms": s * 1e3, "alone_ms": walls[name] * 1e3} for name, s in parts.items()]
    total = sum(parts.values())
    tps = batch * seq / total
    row = {
        "case": f"floor of a small-1b step B{batch} T{seq}",
        "ms": total * 1e3,
        "tokens_per_s": tps,
        "mfu_6N": 6 * n_act * tps / PEAK,
    }
    if peer:
        row["x_transformers"] = peer / total
    rows.append(row)
    del model
    torch.cuda.empty_cache()


def attn_res_rows(rows: list, save, compiled: bool = False) -> None:
    """(c) AttnRes none / snapshot / full: train step (4 x 2048) and CUDA-graph decode step (B=16, 4K); with
    ``compiled``, the decode step alone, torch.compile'd before its capture (GraphedDecoder(compile=True))."""
    label = " compiled decode" if compiled else ""
    for mode in ("none", "snapshot", "full"):
        m = K3ForCausalLM(get_preset("small-1b").replace(**{"attn_res.mode": mode})).cuda()
        row = {"case": f"AttnRes {mode}{label}"}
        if not compiled:
            torch.cuda.reset_peak_memory_stats()
            row["ms"] = train_step_time(m, 4, 2048) * 1e3
            row["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30
        m = m.to(torch.bfloat16).eval()
        cache = fill_cache(m, 16, 4096, 16)
        ids = torch.randint(0, 32768, (16,), device="cuda")
        with torch.no_grad():
            graphed = GraphedDecoder(m, cache, compile=compiled)
            row["decode_ms"] = cuda_time(lambda: graphed(ids, list(range(16))), 2, 10) * 1e3  # noqa: F821
        rows.append(row)
        save()
        del m, cache, graphed
        torch.cuda.empty_cache()
    base = next(r for r in rows if r["case"] == f"AttnRes none{label}")
    for r in rows:
        if r["case"] in (f"AttnRes snapshot{label}", f"AttnRes full{label}"):
            if "ms" in r:
                r["train_overhead"] = r["ms"] / base["ms"] - 1
            r["decode_overhead"] = r["decode_ms"] / base["decode_ms"] - 1


def prefill_rows(rows: list, save, quick: bool) -> None:
    """(f) one-GPU prefill of 128K (and 1M) tokens, one pass with logits at the last token only."""
    for full in (False, True):
        cfg = get_preset("small-1b")
        if full:
            cfg = cfg.replace(mla_layers=list(range(12)))
        m = K3ForCausalLM(cfg).cuda().to(torch.bfloat16).eval()
        for length in (131072,) if quick else (131072, 1048576):
            torch.cuda.reset_peak_memory_stats()
            ids = torch.randint(0, 32768, (1, length), device="cuda")
            try:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                    m(ids, last_only=True)
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                rows.append(
                    {
                        "case": f"prefill {'full-MLA' if full else 'hybrid'} {length}",
                        "model": "small-1b full-MLA twin" if full else "small-1b",
                        "ms": dt * 1e3,
                        "tokens_per_s": length / dt,
                        "peak_GiB": torch.cuda.max_memory_allocated() / 2**30,
                    }
                )
            except torch.OutOfMemoryError as e:
                rows.append({"case": f"prefill {'full-MLA' if full else 'hybrid'} {length}", "error": f"OOM: {e}"[:80]})
            save()
            torch.cuda.empty_cache()
        del m
        torch.cuda.empty_cache()
