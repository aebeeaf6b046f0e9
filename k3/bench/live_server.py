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

REPO = Path(__file__).resolve().parents[2]
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


def tiny_checkpoint(path: Path, preset: str = "tiny") -> Path:
    """A random model of ``preset`` (``tiny`` by default) with a 400-token BPE trained on standard-library
    docstrings (the model's vocabulary narrowed to it), for serving benchmarks that need no trained weights."""
    import collections
    import email
    import inspect
    import textwrap

    import torch

    from k3.config import get_preset
    from k3.convert.checkpoint import save_pretrained
    from k3.data.tokenizer import train_bpe
    from k3.model.decoder import K3ForCausalLM

    text = "\n".join(m.__doc__ for m in (argparse, collections, email, inspect, json, textwrap))
    tok = train_bpe([text], vocab_size=400)
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset(preset).replace(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id, vision=None))
    save_pretrained(model, path)
    tok.save(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``k3 serve --ckpt CKPT`` in a child process on 127.0.0.1 with ``args`` (default: the fault benchmark's CPU
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
                "--ckpt",
                str(ckpt),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                *(DEFAULT_ARGS if args is None else args),
            ],
            cwd=REPO,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
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
