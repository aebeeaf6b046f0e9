"""``torchrun --nproc-per-node N -m k3 serve --random tiny --ep N`` end to end over HTTP, on 2 and 4 ranks (on 4
with the placement ``k3 plan --placement`` writes: hot experts on two ranks, banks of different sizes): completions
(greedy, seeded sampling, two prompts at once, several clients at once) equal the one-process engine's on the same
random model; SIGTERM to rank 0 drains and stops every rank (torchrun exits 0); a follower killed mid-request ends
the server within seconds with one error line from rank 0 (and torchrun naming the killed rank). About 10 to 30 s
each on 2 CPU cores: slow."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from k3.bench.live_server import free_port

ROOT = Path(__file__).resolve().parents[2]
REQUESTS = [
    {"prompt": [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]], "max_tokens": 8, "temperature": 0},
    {"prompt": [[20, 21, 22]], "max_tokens": 10, "temperature": 0.8, "seed": 3},
    {"prompt": [[30, 31, 32, 33, 34]], "max_tokens": 12, "temperature": 0},
    {"prompt": [[40, 41]], "max_tokens": 9, "temperature": 1.0, "top_p": 0.9, "seed": 8},
]
PLAN = ["plan", "--preset", "tiny", "--gpus", "4", "--hbm-gib", "80", "--zipf", "1.2"]


def post(port: int, body: dict) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps({"model": "k3", **body}).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def texts(body: dict) -> list[str]:
    return [c["text"] for c in body["choices"]]


def one_process_texts() -> list[list[str]]:
    from k3.bench.live_server import bench_tokenizer, random_config, random_model
    from k3.infer.engine import Engine
    from k3.infer.sampling import SamplingParams

    import torch

    tok = bench_tokenizer()
    engine = Engine(random_model(random_config("tiny", tok), torch.device("cpu"), torch.float32), tok)
    out = []
    for body in REQUESTS:
        params = SamplingParams(
            max_tokens=body["max_tokens"],
            temperature=body["temperature"],
            top_p=body.get("top_p", 1.0),
            seed=body.get("seed"),
        )
        out.append([g["text"] for g in engine.generate(body["prompt"], params)])
    return out


def start(tmp_path: Path, ranks: int, *flags: str) -> tuple[subprocess.Popen, int, Path]:
    """torchrun with ``ranks`` ranks serving --random tiny; returns once /health answers."""
    port = free_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m", "k3"]
    cmd += ["serve", "--random", "tiny", "--dtype", "float32", "--device", "cpu", "--ep", str(ranks)]
    cmd += ["--port", str(port), "--ep-timeout", "20", "--drain-timeout", "5", *flags]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc, port, log
        except OSError:
            time.sleep(0.3)


def rank_pids(proc: subprocess.Popen) -> dict[int, int]:
    """torchrun's workers: RANK -> pid (from their environments)."""
    out = {}
    for child in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
        env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        rank = next((int(v[5:]) for v in env if v.startswith(b"RANK=")), None)
        if rank is not None:
            out[rank] = int(child)
    return out


def concurrently(port: int, bodies: list[dict]) -> list:
    """Each body posted from a thread of its own, all at once: the responses (or the exceptions) in order."""
    got: list = [None] * len(bodies)

    def one(i: int) -> None:
        try:
            got[i] = texts(post(port, bodies[i]))
        except Exception as e:  # noqa: BLE001 - returned to the test
            got[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    return got


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])
def test_torchrun_ep_http_equals_one_process(tmp_path, ranks):
    flags = []
    if ranks == 4:
        from k3.cli.main import main

        assert main([*PLAN, "--placement", str(tmp_path / "placement.json")]) == 0
        flags = ["--placement", str(tmp_path / "placement.json")]
    proc, port, log = start(tmp_path, ranks, *flags)
    try:
        want = one_process_texts()
        assert texts(post(port, REQUESTS[0])) == want[0]  # alone
        assert concurrently(port, REQUESTS) == want  # four clients at once
        rank0 = int(re.search(r"Started server process \[(\d+)\]", log.read_text()).group(1))
        os.kill(rank0, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_killed_rank_ends_the_server(tmp_path):
    proc, port, log = start(tmp_path, 4)
    try:
        victim = rank_pids(proc)[2]
        long = {"prompt": [[5, 6, 7]], "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
        got = []
        client = threading.Thread(target=lambda: got.append(concurrently(port, [long])[0]))
        client.start()
        time.sleep(2.0)  # the request is decoding
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        code = proc.wait(timeout=30)
        ended = time.monotonic() - t0
        client.join(30)
        text = log.read_text()
        assert code != 0 and ended < 20, (code, ended, text[-3000:])
        assert re.search(r"rank\s*:\s*2 .*\n.*exitcode\s*:\s*-9", text), text[-3000:]  # torchrun's summary
        assert len(re.findall(r"^k3 serve: error: expert-parallel group failed: .*lost another rank", text, re.M)) == 1
        assert "/k3/" not in text, text[-3000:]  # no traceback through k3: the error line says it all
        assert isinstance(got[0], (urllib.error.URLError, ConnectionError, OSError)) or "error" in str(got[0])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
