"""A ``k3 serve`` child process on 127.0.0.1 for the serving benchmarks (benchmarks/serve_faults.py,
benchmarks/serve_load.py), and a tiny random checkpoint to serve when none is given."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

import k3

# the directory k3 was imported from: the child `python -m k3` imports the same k3 (a source tree or an install)
IMPORT_ROOT = str(Path(k3.__file__).resolve().parent.parent)
DEFAULT_ARGS = [
    "--device",
    "cpu",
    "--max-batch",
    "16",
    "--max-context",
    "2048",
    "--max-request-mb",
    "4",
    "--drain-timeout",
    "1",
]


def bench_tokenizer():
    """A 400-token BPE trained on standard-library docstrings: the tokenizer of the serving benchmarks' random
    models (deterministic, so the server and its engine process build the same one)."""
    import collections
    import email
    import inspect
    import textwrap

    from k3.data.tokenizer import train_bpe

    text = "\n".join(m.__doc__ for m in (argparse, collections, email, inspect, json, textwrap))
    return train_bpe([text], vocab_size=400)


def random_config(preset: str, tokenizer):
    """``preset`` text-only, its vocabulary narrowed to ``tokenizer``'s."""
    from k3.config import get_preset

    return get_preset(preset).replace(vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_id, vision=None)


def random_model(config, device, dtype=None, seed: int = 0):
    """A model of ``config`` built straight on ``device`` (bfloat16 by default; the router, A_log and dt_bias stay
    fp32) and filled with small random values: no fp32 copy, no host round trip, no checkpoint on disk (a 48B
    model does not fit a benchmark machine's disk). Eval mode."""
    import torch

    from k3.model.decoder import K3ForCausalLM

    dtype = dtype or torch.bfloat16
    with torch.device("meta"):
        model = K3ForCausalLM(config).to(dtype)
    model.to_empty(device=device).cast(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            t.normal_(0, 0.02, generator=gen) if not name.endswith("A_log") else t.uniform_(0, 1, generator=gen)
    return model.eval()


def tiny_checkpoint(path: Path, preset: str = "tiny") -> Path:
    """A random model of ``preset`` (``tiny`` by default) with :func:`bench_tokenizer` (the model's vocabulary
    narrowed to it), for serving benchmarks that need no trained weights."""
    import torch

    from k3.checkpoint.format import save_pretrained
    from k3.model.decoder import K3ForCausalLM

    tok = bench_tokenizer()
    torch.manual_seed(0)
    model = K3ForCausalLM(random_config(preset, tok))
    save_pretrained(model, path)
    tok.save(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``k3 serve --ckpt CKPT`` (``ckpt`` None: the model named in ``args``, e.g. ``--random PRESET``) in a child
    process on 127.0.0.1 with ``args`` (default: the fault benchmark's CPU
    settings); its output goes to ``log``. Waits (at most ``start_s``) until /health answers."""

    def __init__(self, ckpt: Path, log: Path, args: list[str] | None = None, start_s: float = 120):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "w")  # noqa: SIM115 - held for the child's lifetime, closed in stop()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "k3",
                "serve",
                *([] if ckpt is None else ["--ckpt", str(ckpt)]),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                *(DEFAULT_ARGS if args is None else args),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={
                **os.environ,
                "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(p for p in (IMPORT_ROOT, os.environ.get("PYTHONPATH")) if p),
            },
        )
        deadline = time.monotonic() + start_s
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = "".join(Path(log).read_text(errors="replace").splitlines(keepends=True)[-20:])
                raise RuntimeError(f"k3 serve did not start; the end of {log}:\n{tail}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.kill()
        code = self.proc.wait(30)
        self.log.close()
        return code
