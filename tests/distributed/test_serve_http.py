"""``torchrun --nproc-per-node 2 -m k3 serve --random tiny --ep 2`` end to end over HTTP: completions (greedy,
seeded sampling, two prompts at once) equal the one-process engine's on the same random model; SIGTERM to rank 0
drains and stops every rank (torchrun exits 0). About 10 s on 2 CPU cores: slow."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from k3.bench.live_server import free_port

ROOT = Path(__file__).resolve().parents[2]
REQUESTS = [
    {"prompt": [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]], "max_tokens": 8, "temperature": 0},
    {"prompt": [[20, 21, 22]], "max_tokens": 10, "temperature": 0.8, "seed": 3},
]


def post(port: int, body: dict) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps({"model": "k3", **body}).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


def one_process_texts() -> list[list[str]]:
    from k3.bench.live_server import bench_tokenizer, random_config, random_model
    from k3.infer.engine import Engine
    from k3.infer.sampling import SamplingParams

    import torch

    tok = bench_tokenizer()
    engine = Engine(random_model(random_config("tiny", tok), torch.device("cpu"), torch.float32), tok)
    out = []
    for body in REQUESTS:
        params = SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"], seed=body.get("seed"))
        out.append([g["text"] for g in engine.generate(body["prompt"], params)])
    return out


@pytest.mark.slow
def test_torchrun_ep2_http_equals_one_process(tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "k3"]
    cmd += ["serve", "--random", "tiny", "--dtype", "float32", "--device", "cpu", "--ep", "2"]
    cmd += ["--port", str(port), "--ep-timeout", "20", "--drain-timeout", "5"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.3)
        got = [[c["text"] for c in post(port, body)["choices"]] for body in REQUESTS]
        assert got == one_process_texts()
        rank0 = int(re.search(r"Started server process \[(\d+)\]", log.read_text()).group(1))
        os.kill(rank0, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
