"""Fault injection against a live ``k3 serve`` on 127.0.0.1: what a hostile client can do to the other clients.

    python benchmarks/serve_faults.py [--ckpt DIR] [--timeout 240] [--log FILE] [--out benchmarks/results]

Without ``--ckpt`` it writes a tiny random checkpoint (BPE vocab 400, the ``tiny`` preset) to a temporary folder.
It starts ``k3 serve`` (CPU, --max-batch 16, --max-context 2048, --max-request-mb 4, --drain-timeout 1) and runs:
tiny temperature / repetition penalty, a huge declared body, a huge chunked body, a huge prompt, an echo + logprobs
blow-up, 16 abandoned non-streamed requests then a fresh request's latency, a lone surrogate then a request on the
same connection, and SIGTERM with streams and non-streamed requests open. During each case a thread polls
``/health`` (its worst latency is reported) and, but for SIGTERM, four bystander streams run whose text must equal
what they produce alone (greedy). Prints one table row per case: case | status | other requests hurt | max
/health latency. Every loop is bounded in count and time; nothing leaves the loopback interface.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import select
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path

import httpx

from k3.bench.live_server import Server, tiny_checkpoint

MODEL = "k3"
BYSTANDERS = [f"bystander {i}: the json module" for i in range(4)]


class HealthProbe:
    """Polls /health every 50 ms in a thread (at most ``limit`` s); ``worst()`` is the slowest answer."""

    def __init__(self, url: str, limit: float):
        self.url, self.limit, self.latencies, self._stop = url, limit, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        end = time.monotonic() + self.limit
        with httpx.Client(timeout=5) as c:
            while not self._stop.is_set() and time.monotonic() < end:
                t = time.perf_counter()
                try:
                    c.get(self.url + "/health")
                except httpx.TransportError:  # refused (shut down) or over 5 s: count the wait
                    pass
                self.latencies.append(time.perf_counter() - t)
                self._stop.wait(0.05)

    def worst(self) -> float:
        self._stop.set()
        self._thread.join(10)
        return max(self.latencies, default=float("nan"))


def complete(url: str, prompt, max_tokens: int, stream: bool = False, timeout: float = 60, **extra):
    """One completion: (status, text or error message)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream, **extra}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
        j = r.json()
        return r.status_code, j["choices"][0]["text"] if r.status_code == 200 else j["error"]["message"]
    text = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                j = json.loads(line[6:])
                if "error" in j:
                    return 500, j["error"]["message"]
                text.append(j["choices"][0]["text"])
    return r.status_code, "".join(text)


class Bystanders:
    """Four greedy streams running beside a case; ``hurt()``: any failed or differs from its output alone."""

    def __init__(self, url: str, expected: list[str]):
        self.expected, self.results = expected, [None] * len(BYSTANDERS)

        def one(i, p):
            try:
                self.results[i] = complete(url, p, 24, stream=True)
            except Exception as e:  # noqa: BLE001 - a transport error is a hurt bystander
                self.results[i] = (0, repr(e))

        self.threads = [threading.Thread(target=one, args=(i, p), daemon=True) for i, p in enumerate(BYSTANDERS)]
        for t in self.threads:
            t.start()

    def hurt(self) -> bool:
        for t in self.threads:
            t.join(60)
        return any(r is None or r != (200, e) for r, e in zip(self.results, self.expected))


def raw_post(url: str, path: str, body: bytes, sock: socket.socket | None = None) -> tuple[int, bytes, socket.socket]:
    """POST on a raw socket (kept open: a second call on the same socket proves the connection survived)."""
    host, port = url.removeprefix("http://").split(":")
    sock = sock or socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
        "\r\n\r\n".encode()
        + body
    )
    return (*read_response(sock), sock)


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(head.split()[1]), body


# ---------------------------------------------------------------------- cases: each returns (status, hurt or None)
def case_tiny_values(url):
    codes = [complete(url, "Hello", 8, **{k: 1e-40})[0] for k in ("temperature", "repetition_penalty")]
    return f"{codes[0]} / {codes[1]}", None


def case_huge_declared_body(url):
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:  # 50 MB declared, only the headers sent
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 52428800\r\n\r\n"
        )
        status, _ = read_response(s)
    return f"{status} (50 MB declared)", None


def case_huge_chunked_body(url):
    host, port = url.removeprefix("http://").split(":")
    sent, chunk = 0, b"x" * 65536
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        while sent < 50 << 20 and not select.select([s], [], [], 0)[0]:  # until the server answers, 50 MB at most
            try:
                s.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            except OSError:
                break
            sent += len(chunk)
        status, _ = read_response(s)
    return f"{status} after {sent >> 20} MiB chunked", None


def case_huge_prompt(url):
    t = time.perf_counter()
    status, _ = complete(url, "word " * 700_000, 8)  # 3.5 MB, under the 4 MiB body limit
    return f"{status} in {time.perf_counter() - t:.2f} s", None


def case_echo_logprobs(url):
    body = {"model": MODEL, "prompt": [[5] * 1500] * 64, "echo": True, "logprobs": 20, "max_tokens": 1}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    return f"{r.status_code}, {len(r.content)} B response", None


def case_abandoned(url, baseline_s):
    def give_up():
        with contextlib.suppress(httpx.TimeoutException):
            complete(url, "Hello", 1500, timeout=1)

    threads = [threading.Thread(target=give_up, daemon=True) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    time.sleep(0.3)
    t = time.perf_counter()
    status, _ = complete(url, "Hello", 8)
    took = time.perf_counter() - t
    return f"{status}; next 8 tokens {took:.2f} s (alone {baseline_s:.2f} s)", took > 5 * baseline_s + 1


def case_surrogate(url):
    status1, _, sock = raw_post(
        url, "/v1/completions", b'{"model": "k3", "prompt": "ab\\ud800cd", "max_tokens": 4, "temperature": 0}'
    )
    try:
        status2, _, _ = raw_post(
            url,
            "/v1/completions",
            json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode(),
            sock,
        )
    except OSError as e:
        status2 = type(e).__name__
    finally:
        sock.close()
    return f"{status1} then {status2} on one connection", None


def case_sigterm(server: Server):
    results = []

    def stream():
        events = []
        try:
            with httpx.stream(
                "POST",
                server.url + "/v1/completions",
                timeout=60,
                json={"model": MODEL, "prompt": "Hello", "max_tokens": 1500, "temperature": 0, "stream": True},
            ) as r:
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        except httpx.TransportError as e:
            results.append(f"stream {type(e).__name__}")
            return
        ok = len(events) >= 2 and events[-1] == "[DONE]" and "error" in json.loads(events[-2])
        results.append("stream ok" if ok else "stream cut")

    def whole():
        try:
            r = httpx.post(
                server.url + "/v1/completions",
                timeout=60,
                json={"model": MODEL, "prompt": "Hello", "max_tokens": 1500, "temperature": 0},
            )
            ok = r.status_code == 503 and "error" in r.json()
        except (httpx.TransportError, ValueError) as e:
            results.append(f"whole {type(e).__name__}")
            return
        results.append("whole ok" if ok else f"whole {r.status_code}")

    threads = [threading.Thread(target=f, daemon=True) for f in (stream,) * 4 + (whole,) * 2]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while httpx.get(server.url + "/health", timeout=5).json().get("running", 0) < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    code = server.proc.wait(60)
    bad = [r for r in results if not r.endswith("ok")]
    return f"exit {code}; {len(results) - len(bad)}/6 ended with an error body", bool(bad) or len(results) < 6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", type=Path, default=None, help="a checkpoint to serve (default: a tiny random one)")
    ap.add_argument("--timeout", type=float, default=240, help="seconds for the whole run")
    ap.add_argument("--log", type=Path, default=None, help="keep the server's output there")
    ap.add_argument("--out", default=None, help="also write serve_faults.md / .json there (e.g. benchmarks/results)")
    args = ap.parse_args()
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.ckpt or tiny_checkpoint(Path(tmp) / "ckpt")
        server = Server(ckpt, Path(tmp) / "serve.log")
        rows = []
        try:
            expected = [complete(server.url, p, 24)[1] for p in BYSTANDERS]
            t = time.perf_counter()
            complete(server.url, "Hello", 8)
            baseline = time.perf_counter() - t
            cases = [
                ("tiny temperature / penalty", case_tiny_values),
                ("huge body (declared)", case_huge_declared_body),
                ("huge body (chunked)", case_huge_chunked_body),
                ("huge prompt", case_huge_prompt),
                ("echo x logprobs blow-up", case_echo_logprobs),
                ("16 abandoned requests", lambda url: case_abandoned(url, baseline)),
                ("lone surrogate + reuse", case_surrogate),
            ]
            for name, case in cases:
                if time.monotonic() - start > args.timeout:
                    rows.append((name, "skipped (time)", "-", "-"))
                    continue
                probe = HealthProbe(server.url, 60)
                bystanders = Bystanders(server.url, expected)
                try:
                    status, hurt = case(server.url)
                except Exception as e:  # noqa: BLE001 - a case that broke is a row, not the end of the run
                    status, hurt = f"failed: {type(e).__name__}: {e}", True
                hurt = bystanders.hurt() or bool(hurt)
                rows.append((name, status, "yes" if hurt else "no", f"{probe.worst() * 1000:.0f} ms"))
            probe = HealthProbe(server.url, 60)
            status, hurt = case_sigterm(server)
            rows.append(("SIGTERM with 6 open", status, "yes" if hurt else "no", f"{probe.worst() * 1000:.0f} ms"))
        finally:
            server.stop()
        log = (Path(tmp) / "serve.log").read_text()
        if args.log:
            args.log.write_text(log)
    widths = [
        max(len(r[i]) for r in rows + [("case", "status", "other requests hurt", "max /health")]) for i in range(4)
    ]

    def line(r):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"

    print(line(("case", "status", "other requests hurt", "max /health")))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))
    note = f"tracebacks in the server log: {log.count('Traceback')}; run took {time.monotonic() - start:.0f} s"
    print(f"({note})")
    if args.out:
        from k3.bench.common import environment, write_results

        columns = ["case", "status", "other_requests_hurt", "max_health_latency"]
        write_results(
            "serve_faults",
            [dict(zip(columns, r)) for r in rows],
            columns,
            environment() | {"server": "k3 serve on 127.0.0.1, CPU, tiny random checkpoint"},
            note,
            out_dir=args.out,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
