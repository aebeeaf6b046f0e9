"""QAT (MXFP4 expert weights + MXFP8 expert inputs) vs the plain bf16 run: same preset, data, seed and steps.

Run on a GPU: ``python benchmarks/qat_vs_bf16.py [--steps N]``; writes benchmarks/results/qat_vs_bf16.{json,md}
(or $K3_BENCH_OUT). Both runs use bf16 autocast; the QAT run fake-quantises the routed experts only.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
import time

from k3.bench.common import environment, write_results
from k3.train.trainer import TrainConfig, Trainer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    rows = []
    for qat in (None, "mxfp4"):
        out = tempfile.mkdtemp(prefix="k3_qat_")
        cfg = TrainConfig(
            preset=args.preset,
            steps=args.steps,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            eval_every=max(1, args.steps // 5),
            eval_rows=128,
            samples=0,
            out=out,
            qat=qat,
            seed=0,
            max_tokens=args.steps * args.batch_size * args.seq_len + 1,
        )
        t0 = time.perf_counter()
        hist = Trainer(cfg, progress=False).run()["history"]
        evals = [h for h in hist if "val_loss" in h]
        rows.append(
            {
                "run": qat or "bf16",
                "steps": args.steps,
                "final_val_loss": evals[-1]["val_loss"],
                "final_val_bpb": evals[-1]["val_bpb"],
                "initial_val_loss": hist[0]["val_loss_init"],
                "last10_train_loss": sum(h["loss"] for h in hist[-10:]) / 10,
                "wall_s": time.perf_counter() - t0,
            }
        )
        print(rows[-1], flush=True)
        shutil.rmtree(out, ignore_errors=True)
    gap = rows[1]["final_val_loss"] - rows[0]["final_val_loss"]
    write_results(
        "qat_vs_bf16",
        rows,
        ["run", "steps", "initial_val_loss", "final_val_loss", "final_val_bpb", "last10_train_loss", "wall_s"],
        environment(),
        notes=f"validation-loss gap QAT - bf16 = {gap:+.4f} nats/token ({gap / rows[0]['final_val_loss']:+.2%})",
    )


if __name__ == "__main__":
    main()
