"""Kimi-Linear-48B-A3B at full size on one GPU: checkpoint write + streamed load, decode, prefill, peer.

Phases (each guarded: one failing still leaves the others' rows):
1. ``checkpoint``: preset ``kimi-linear-48b`` with ``--layers`` layers (default: the most that fit the free disk,
   at most 27) built on the GPU in bf16, written sharded by our writer (k3.checkpoint.format), its pages dropped
   from the page cache, then stream-loaded back to the GPU in a fresh process (:func:`load_in_child`): GB/s, the
   resident set's rise while loading (sampled) and the process's whole peak, bit-exact check.
2. ``decode``: the full 27-layer model built on the GPU in bf16; ms per decode step at B=1 / 4K and B=64 / 32K
   (k3.bench.decode: filled caches, CUDA-graph decode step) against the bandwidth limit
   (k3.bench.decode.step_bytes / k3.bench.common.read_bandwidth).
3. ``prefill``: one 32K-token prompt, tokens/s.
4. ``peer``: transformers' KimiLinearForCausalLM at the same shapes (built in bf16 on the GPU after ours is freed);
   its error is recorded if it does not fit or fails.
Results: benchmarks/results/kimi-linear-48b.{md,json} (k3.bench.common.write_results), written after every phase
and peer row. ``--smoke`` runs every phase on a tiny config (CPU works) to check the code path.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from k3.bench.common import environment, read_bandwidth, write_results
from k3.bench.live_server import random_model
from k3.config import get_preset
from k3.checkpoint.format import save_pretrained
from k3.model.decoder import K3ForCausalLM

COLUMNS = ["phase", "case", "value", "unit", "detail", "error"]
PER_LAYER_BYTES = 3.8e9  # one bf16 MoE layer of the 48B config (256 experts x 3 x 2304 x 1024, + attention)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(cfg, device: torch.device, seed: int = 0) -> K3ForCausalLM:
    """The model straight on ``device`` in bf16 (k3.bench.live_server.random_model)."""
    return random_model(cfg, device, torch.bfloat16, seed)


def fingerprint(t: torch.Tensor) -> int:
    """An exact, order-independent checksum of a tensor's bytes: the int64 sum of its 16-bit words. A float sum
    depends on the reduction order, which follows the process's thread count, so two processes can disagree on
    the same tensor."""
    flat = t.contiguous().view(-1)
    words = flat.view(torch.int16) if flat.element_size() >= 2 else flat.to(torch.int16)  # bytes: their values
    return int(words.sum(dtype=torch.int64))


def drop_page_cache(directory: Path) -> None:
    """Ask the kernel to forget the files' cached pages, so the load reads the disk (best effort)."""
    for f in directory.iterdir():
        try:
            fd = os.open(f, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        except (OSError, AttributeError):
            pass


def phase_checkpoint(rows, cfg, device, layers: int, shard_gb: float, workdir: Path) -> None:
    small = cfg.replace(num_hidden_layers=layers, mla_layers=tuple(i for i in cfg.mla_layers if i < layers) or (0,))
    model = build(small, device)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    path = workdir / "ckpt"
    t0 = time.perf_counter()
    save_pretrained(model, path, max_shard_bytes=int(shard_gb * 1e9))
    write_s = time.perf_counter() - t0
    shards = sorted(path.glob("*.safetensors"))
    largest = max(s.stat().st_size for s in shards)
    rows.append(
        {
            "phase": "checkpoint",
            "case": f"write {layers} layers",
            "value": nbytes / 1e9 / write_s,
            "unit": "GB/s",
            "detail": f"{nbytes / 1e9:.1f} GB in {len(shards)} shards (largest "
            f"{largest / 1e9:.2f} GB), {write_s:.1f}s incl. SHA-256",
        }
    )
    reference = {k: fingerprint(v) for k, v in model.state_dict().items()}
    del model
    torch.cuda.empty_cache() if device.type == "cuda" else None
    drop_page_cache(path)
    child = load_in_child(path, device)
    detail = f"{nbytes / 1e9:.1f} GB in {child['load_s']:.1f}s in a fresh process; SHA-256 verified while reading"
    if device.type == "cuda":
        detail += f"; GPU peak {child['gpu_peak'] / 2**30:.1f} GiB"
    same = child["sums"] == reference
    bound = f"bound: largest shard {largest / 2**30:.2f} GiB + 1 GiB"
    rows += [
        {
            "phase": "checkpoint",
            "case": f"stream-load {layers} layers",
            "value": nbytes / 1e9 / child["load_s"],
            "unit": "GB/s",
            "detail": detail + ("; same tensors" if same else "; TENSORS DIFFER"),
        },
        {
            "phase": "checkpoint",
            "case": "host memory while loading",
            "value": (child["rss_peak"] - child["rss_before"]) / 2**30,
            "unit": "GiB",
            "detail": f"resident set sampled every 2 ms, above its {child['rss_before'] / 2**30:.2f} GiB before the "
            f"load (torch, CUDA context); {bound}",
        },
        {
            "phase": "checkpoint",
            "case": "peak host RSS of the loading process",
            "value": child["max_rss"] / 2**30,
            "unit": "GiB",
            "detail": f"the whole process (ru_maxrss: torch, CUDA context and the load); {bound}",
        },
    ]
    shutil.rmtree(path, ignore_errors=True)


_CHILD = """
import json, resource, sys, threading, time
import torch
from k3.checkpoint.load import from_pretrained

#FINGERPRINT#

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()

device = torch.device(sys.argv[2])
if device.type == "cuda":
    torch.zeros(1, device=device)  # the CUDA context, before the baseline
before, peak, done = rss(), [0], threading.Event()

def sample():  # the resident set every 2 ms while loading
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.002)

watcher = threading.Thread(target=sample)
watcher.start()
t0 = time.perf_counter()
model = from_pretrained(sys.argv[1], device=device)
if device.type == "cuda":
    torch.cuda.synchronize(device)
load_s = time.perf_counter() - t0
done.set()
watcher.join()
out = {
    "load_s": load_s,
    "rss_before": before,
    "rss_peak": max(peak[0], rss()),
    "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "gpu_peak": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0,
    "sums": {k: fingerprint(v) for k, v in model.state_dict().items()},
}
print("RESULT " + json.dumps(out))
"""


def load_in_child(path: Path, device: torch.device) -> dict:
    """Stream-load ``path`` onto ``device`` in a fresh Python process (its peak RSS is the loader's alone):
    seconds, host RSS before and at peak, GPU peak, and every tensor's :func:`fingerprint`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1])] + sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD.replace("#FINGERPRINT#", inspect.getsource(fingerprint)), str(path), str(device)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if done.returncode or line is None:
        raise RuntimeError(f"the loading process failed ({done.returncode}): {done.stderr[-500:]}")
    return json.loads(line[len("RESULT ") :])


@torch.no_grad()
def decode_ms(model, batch: int, context: int, device: torch.device, steps: int) -> float:
    """ms per decode step: k3.bench.decode.ours on a GPU (filled caches, CUDA graph); on the CPU (smoke) an
    eager prefill + decode of the same shapes."""
    if device.type == "cuda":
        from k3.bench.decode import ours

        return ours(model, batch, context, steps=steps) * 1e3
    cache = model.new_cache(batch, dtype=torch.bfloat16, capacity=context + steps + 8)
    ids = torch.randint(0, model.config.vocab_size, (batch, context))
    model(ids, cache=cache, last_only=True)
    tok = torch.randint(0, model.config.vocab_size, (batch,))
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = model.decode(tok, cache, list(range(batch))).argmax(-1)
    return (time.perf_counter() - t0) / steps * 1e3


@torch.no_grad()
def prefill_tps(model, tokens: int, device: torch.device) -> float:
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=device)
    for _ in range(2):
        cache = model.new_cache(1, dtype=torch.bfloat16, capacity=tokens + 8)
        sync(device)
        t0 = time.perf_counter()
        model(ids, cache=cache, last_only=True)
        sync(device)
        elapsed = time.perf_counter() - t0
        del cache
    return tokens / elapsed


def phase_decode_prefill(rows, cfg, device, cases, prefill_tokens: int, steps: int) -> None:
    model = build(cfg, device)
    rows.append(
        {
            "phase": "model",
            "case": "full size",
            "value": sum(p.numel() for p in model.parameters()) / 1e9,
            "unit": "B params",
            "detail": f"{cfg.num_hidden_layers} layers, bf16 on {device}",
        }
    )
    bandwidth = read_bandwidth() if device.type == "cuda" else None
    for batch, context in cases:
        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            ms = decode_ms(model, batch, context, device, steps)
            detail = ""
            if bandwidth:
                from k3.bench.decode import step_bytes

                limit = step_bytes(model, batch, context) / bandwidth * 1e3
                detail = (
                    f"bandwidth limit {limit:.3f} ms ({limit / ms:.0%} of it); GPU peak "
                    f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB"
                )
            rows.append(
                {
                    "phase": "decode",
                    "case": f"B={batch} ctx={context}",
                    "value": ms,
                    "unit": "ms/step",
                    "detail": detail,
                }
            )
        except Exception as e:  # noqa: BLE001 - a benchmark row records any failure
            rows.append({"phase": "decode", "case": f"B={batch} ctx={context}", "error": repr(e)[:300]})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        tps = prefill_tps(model, prefill_tokens, device)
        detail = f"GPU peak {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB" if device.type == "cuda" else ""
        rows.append(
            {"phase": "prefill", "case": f"{prefill_tokens} tokens", "value": tps, "unit": "tokens/s", "detail": detail}
        )
    except Exception as e:  # noqa: BLE001
        rows.append({"phase": "prefill", "case": f"{prefill_tokens} tokens", "error": repr(e)[:300]})
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()


@torch.no_grad()
def phase_peer(rows, cfg, device, cases, steps: int, save=lambda: None) -> None:
    """transformers' KimiLinearForCausalLM from our config (kimi_linear format), bf16 on the device; ``save`` after
    each row (its B=64 / 32K prompt is one 2M-token prefill through transformers' code, which may not finish)."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    from k3.config.hf import to_hf_config

    hf_cfg = KimiLinearConfig(**to_hf_config(cfg, "kimi_linear"))
    try:
        with torch.device(device):
            model = KimiLinearForCausalLM._from_config(hf_cfg, torch_dtype=torch.bfloat16).eval()
    except Exception as e:  # noqa: BLE001
        rows.append({"phase": "peer", "case": "build", "error": repr(e)[:300]})
        return
    for batch, context in cases:
        try:
            ids = torch.randint(3, cfg.vocab_size, (batch, context), device=device)

            def generate(n: int) -> float:
                sync(device)
                t0 = time.perf_counter()
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
                sync(device)
                return time.perf_counter() - t0

            generate(1)
            one = generate(1)
            rows.append(
                {
                    "phase": "peer",
                    "case": f"B={batch} ctx={context}",
                    "value": (generate(steps + 1) - one) / steps * 1e3,
                    "unit": "ms/step",
                    "detail": "transformers generate, prefill subtracted",
                }
            )
        except Exception as e:  # noqa: BLE001
            rows.append({"phase": "peer", "case": f"B={batch} ctx={context}", "error": repr(e)[:300]})
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="a tiny config and shapes: checks the code path (CPU ok)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=None, help="layers of the written checkpoint (default: disk)")
    p.add_argument("--shard-gb", type=float, default=5.0)
    p.add_argument("--workdir", default=None, help="where to write the checkpoint (default: a temp dir)")
    p.add_argument("--skip", nargs="*", default=[], choices=["checkpoint", "decode", "peer"])
    p.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cfg = get_preset("kimi-linear-48b")
    cases, prefill_tokens, steps, name = [(1, 4096), (64, 32768)], 32768, 16, "kimi-linear-48b"
    if args.smoke:
        cfg = cfg.replace(
            hidden_size=256,
            vocab_size=1024,
            intermediate_size=512,
            num_hidden_layers=4,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            mla_layers=(3,),
            **{"kda.num_heads": 2, "mla.num_heads": 2, "moe.num_experts": 8, "moe.moe_intermediate_size": 64},
        )
        cases, prefill_tokens, steps, name = [(1, 64), (4, 128)], 256, 4, "kimi-linear-48b-smoke"
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="k3-ckpt-"))
    workdir.mkdir(parents=True, exist_ok=True)
    layers = args.layers
    if layers is None:
        emb = 2 * cfg.vocab_size * cfg.hidden_size * 2
        free = shutil.disk_usage(workdir).free
        per_layer = PER_LAYER_BYTES if not args.smoke else 1e6
        layers = max(1, min(cfg.num_hidden_layers, int((0.8 * free - emb) // per_layer)))
    rows: list[dict] = []
    t_start = time.perf_counter()
    meta = {**environment(), "config": cfg.name, "smoke": args.smoke, "checkpoint_layers": layers}
    notes = (
        "Checkpoint phase: the same config with fewer layers (disk), pages dropped from the page cache before "
        "the load (best effort, posix_fadvise). Decode: k3.bench.decode.ours (CUDA graph); the limit is "
        "step_bytes / read bandwidth. Peer: transformers' KimiLinearForCausalLM in bf16; an error row when it "
        "does not fit or fails."
    )

    def save() -> None:  # after every phase and peer row: a run cut short keeps what it measured
        meta["seconds"] = round(time.perf_counter() - t_start, 1)
        write_results(name, rows, COLUMNS, meta, notes, out_dir=args.out)

    phases = [
        (
            "checkpoint",
            lambda: phase_checkpoint(rows, cfg, device, layers, args.shard_gb if not args.smoke else 0.002, workdir),
        ),
        ("decode", lambda: phase_decode_prefill(rows, cfg, device, cases, prefill_tokens, steps)),
        ("peer", lambda: phase_peer(rows, cfg, device, cases, steps, save)),
    ]
    for phase, fn in phases:
        if phase in args.skip:
            continue
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - record and go on to the next phase
            traceback.print_exc()
            rows.append({"phase": phase, "case": "(phase)", "error": repr(e)[:300]})
        print(f"[{phase}] {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
