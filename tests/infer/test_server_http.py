"""The OpenAI server's HTTP hardening: connection timeouts and limit, the error-log rate limit, the API key, the
docs switch and SSE events that stay one line. Servers run in-process on the tiny checkpoint of test_server with
short timeouts; every socket has a timeout, so a server that never answers fails the test instead of hanging it.
"""

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import time

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from k3.infer.async_engine import AsyncEngine
from k3.infer.engine import Engine
from k3.infer.load import load_for_inference
from k3.infer.responses import sse
from k3.infer.server import LogRateLimit, create_app, http_options
from tests.infer import test_server
from tests.infer.test_server import CONTEXT, MODEL, REPO, LiveServer, free_port

ckpt = test_server.ckpt  # the tiny checkpoint fixture
KEY, READ = "s3cret-key", 0.5  # the guarded server's API key and read timeout (seconds)


def make_app(ckpt, **options):
    model, tok, _ = load_for_inference(ckpt, "cpu", "float32")
    return create_app(AsyncEngine(Engine(model, tok, max_batch=4, max_context=CONTEXT)), tok, MODEL, CONTEXT, **options)


@pytest.fixture(scope="module")
def guarded(ckpt):
    """A server requiring KEY, with READ-second request reads and a long keep-alive."""
    live = LiveServer(
        make_app(ckpt, read_timeout=READ, api_key=KEY), **http_options(timeout_keep_alive=30, read_timeout=READ)
    )
    yield live
    live.stop()


def connect(url: str, timeout: float = 10) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=timeout)


def closed_after(sock: socket.socket) -> float:
    """Seconds until the server closes ``sock`` (reading and dropping what it sends); the socket's timeout fails
    the test if it stays open."""
    start = time.monotonic()
    while sock.recv(65536):
        pass
    return time.monotonic() - start


def read_response(f) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one response with a Content-Length from a socket's file."""
    status = f.readline()
    assert status, "the server closed the connection"
    headers = {}
    for line in iter(f.readline, b"\r\n"):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    return int(status.split()[1]), headers, f.read(int(headers["content-length"]))


AUTH = f"Authorization: Bearer {KEY}\r\n"


def test_idle_and_slow_head_connections_are_closed(guarded):
    with connect(guarded.url) as sock:  # sends nothing at all
        assert READ * 0.8 < closed_after(sock) < READ + 5
    with connect(guarded.url) as sock:  # half a request head, never finished
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        assert closed_after(sock) < READ + 5
    with connect(guarded.url) as sock:  # a keep-alive connection: one request, then half of the next one's head
        f = sock.makefile("rb")
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(f)[0] == 200
        time.sleep(READ * 1.5)  # idle between requests: the keep-alive timeout's (30 s) business, not the head's
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        assert READ * 0.8 < closed_after(sock) < READ + 5


def test_slow_body_is_cut_off_with_408(guarded):
    with connect(guarded.url) as sock:
        f = sock.makefile("rb")
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{AUTH}Content-Type: application/json\r\n"
            "Content-Length: 100\r\n\r\n".encode()
            + b'{"model": '  # 10 of the 100 bytes promised
        )
        status, headers, body = read_response(f)
        assert status == 408 and headers["connection"] == "close"
        error = json.loads(body)["error"]
        assert error["code"] == "request_timeout" and "--timeout-request-read" in error["message"]
        assert closed_after(sock) < 5
    r = httpx.get(guarded.url + "/health", timeout=10)  # the server goes on serving
    assert r.status_code == 200


def test_api_key_is_required_on_v1_but_not_health(guarded):
    missing = httpx.get(guarded.url + "/v1/models", timeout=10)
    wrong = httpx.get(guarded.url + "/v1/models", headers={"Authorization": "Bearer s3cret-kez"}, timeout=10)
    other_scheme = httpx.get(guarded.url + "/v1/models", headers={"Authorization": f"Basic {KEY}"}, timeout=10)
    for r in (missing, wrong, other_scheme):
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert "didn't provide an API key" in missing.json()["error"]["message"]
    assert wrong.json()["error"]["code"] == "invalid_api_key"
    post = httpx.post(guarded.url + "/v1/completions", json={"model": MODEL, "prompt": "a"}, timeout=10)
    assert post.status_code == 401  # refused before the body is read or the model runs
    assert httpx.get(guarded.url + "/health", timeout=10).status_code == 200
    auth = {"Authorization": f"Bearer {KEY}"}
    for method, path, body in (
        ("GET", "/tokenizer_info", None),
        ("POST", "/tokenize", {"prompt": "a"}),
        ("POST", "/detokenize", {"tokens": [7]}),
    ):  # the tokenizer endpoints need the key as the others do
        assert httpx.request(method, guarded.url + path, json=body, timeout=10).status_code == 401, path
        assert httpx.request(method, guarded.url + path, json=body, headers=auth, timeout=10).status_code == 200
    client = openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = client.completions.create(model=MODEL, prompt="The json module", max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_lm_eval_with_the_api_key(guarded, monkeypatch):
    """lm-evaluation-harness's local-completions on a server with a key: its remote tokenizer sends the key given
    as auth_token, its completions the one in OPENAI_API_KEY."""
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    url = f"{guarded.url}/v1/completions"
    lm = get_model("local-completions").create_from_arg_string(f"base_url={url},auth_token={KEY}")
    assert lm.tokenizer_backend == "remote"
    [(logprob, _)] = lm.loglikelihood([Instance("loglikelihood", {}, ("The json", " module"), 0)], disable_tqdm=True)
    assert logprob < 0


def test_docs_are_off_unless_asked_for(ckpt, guarded):
    for path in ("/docs", "/redoc", "/openapi.json"):
        r = httpx.get(guarded.url + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", (path, r.text)
    client = TestClient(make_app(ckpt, docs=True, api_key=KEY))  # docs are open even when a key is required
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert client.get(path).status_code == 200, path
    assert "/v1/completions" in client.get("/openapi.json").json()["paths"]


def test_connections_beyond_the_limit_answer_503(ckpt):
    live = LiveServer(make_app(ckpt), **http_options(read_timeout=30, max_connections=2))
    connections = live.server.server_state.connections

    def wait_for(n):
        deadline = time.monotonic() + 10
        while len(connections) != n:
            assert time.monotonic() < deadline, f"{len(connections)} connections open, not {n}"
            time.sleep(0.01)

    try:
        idle = [connect(live.url), connect(live.url)]  # the limit, held by connections that send nothing
        wait_for(2)
        with connect(live.url) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            status, headers, _ = read_response(sock.makefile("rb"))
            assert status == 503 and headers["connection"] == "close"
        with connect(live.url) as sock:  # one over the limit that sends nothing is let go within a second or so
            assert closed_after(sock) < 5
        idle.pop().close()
        wait_for(1)
        assert httpx.get(live.url + "/health", timeout=10).status_code == 200  # room again: served
    finally:
        for sock in idle:
            sock.close()
        live.stop()


def test_log_rate_limit_caps_a_burst():
    records, now = [], [100.0]

    class Collect(logging.Handler):
        def emit(self, record):
            records.append((record.name, record.levelno, record.getMessage()))

    handler = Collect()
    handler.addFilter(LogRateLimit(handler, per_second=5, clock=lambda: now[0]))
    noisy, other = logging.getLogger("k3.test.noisy"), logging.getLogger("k3.test.other")
    noisy.propagate = other.propagate = False
    noisy.setLevel(logging.INFO)
    noisy.addHandler(handler)
    other.addHandler(handler)
    try:
        for i in range(1000):
            noisy.error("accept failed %d", i)
        other.error("another logger's own budget")
        noisy.info("access line")  # below WARNING: never held back
        assert [m for n, _, m in records if n == "k3.test.noisy"] == [f"accept failed {i}" for i in range(5)] + [
            "access line"
        ]
        assert ("k3.test.other", logging.ERROR, "another logger's own budget") in records
        records.clear()
        now[0] += 1.0  # the next second: one line counts what was held back, then messages pass again
        noisy.error("accept failed again")
        assert records == [
            ("k3.test.noisy", logging.WARNING, "suppressed 995 messages (more than 5 a second from this logger)"),
            ("k3.test.noisy", logging.ERROR, "accept failed again"),
        ]
    finally:
        for logger in (noisy, other):
            logger.removeHandler(handler)
            logger.propagate = True
            logger.setLevel(logging.NOTSET)


def test_sse_event_is_one_line_whatever_the_text():
    text = "a\u2028b\u2029c\x85d\re\nf\x0bg\x0ch\x1ci\x1dj\x1ek"  # every character str.splitlines breaks on
    event = sse({"choices": [{"text": text}], text: 1})
    assert event.endswith("\n\n")
    lines = event.splitlines()
    assert len(lines) == 2 and lines[1] == "" and lines[0].startswith("data: ")
    assert json.loads(lines[0].removeprefix("data: ")) == {"choices": [{"text": text}], text: 1}
    assert "é日" in sse({"text": "é日"})  # other text stays UTF-8, not \\u escapes


def test_k3_serve_http_flags(ckpt, monkeypatch, capsys, caplog):
    import resource

    import k3.cli.serve as serve_mod
    from k3.cli.main import main

    base = ["serve", "--ckpt", str(ckpt), "--device", "cpu"]
    for flags, message in [
        (["--timeout-keep-alive", "0"], "--timeout-keep-alive=0.0 must be a positive number of seconds"),
        (["--timeout-request-read", "nan"], "--timeout-request-read=nan must be a positive number of seconds"),
        (["--max-connections", "0"], "--max-connections=0 must be >= 1"),
        (["--api-key", " "], "the API key (--api-key or K3_API_KEY) must be non-empty printable ASCII"),
    ]:
        assert main(base + flags) == 2
        assert capsys.readouterr().err == f"k3 serve: error: {message}\n"
    seen = {}
    monkeypatch.setattr(
        serve_mod, "_server", lambda config, *a: seen.update(config=config) or argparse.Namespace(run=lambda: None)
    )
    added = []  # (the real limit_log_rate would filter pytest's own handlers)
    monkeypatch.setattr("k3.infer.server.limit_log_rate", lambda: added.append(True))
    monkeypatch.setenv("K3_API_KEY", "from-env")
    flags = ["--timeout-keep-alive", "2", "--timeout-request-read", "7", "--max-connections", "100", "--docs"]
    assert main(base + flags) == 0
    config = seen["config"]
    guard = next(m for m in config.app.user_middleware if m.cls.__name__ == "_Guard")
    assert guard.kwargs["api_key"] == "from-env" and guard.kwargs["read_timeout"] == 7
    assert config.timeout_keep_alive == 2 and config.limit_concurrency == 101 and config.http.read_timeout == 7
    assert config.app.docs_url == "/docs" and added
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (256, hard))
    with caplog.at_level(logging.WARNING, "k3.serve"):
        assert main(base + ["--api-key", "from-flag"]) == 0
    config = seen["config"]
    assert next(m for m in config.app.user_middleware if m.cls.__name__ == "_Guard").kwargs["api_key"] == "from-flag"
    assert config.app.docs_url is None and config.timeout_keep_alive == 5 and config.http.read_timeout == 30
    assert config.limit_concurrency - 1 < 256 - 32 and "--max-connections 512 capped at" in caplog.text


FLOOD_SERVER = """
import logging, resource, sys
import uvicorn
from k3.infer.async_engine import AsyncEngine
from k3.infer.engine import Engine
from k3.infer.load import load_for_inference
from k3.infer.server import connection_limit, create_app, http_options, limit_log_rate

resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
model, tok, _ = load_for_inference(sys.argv[1], "cpu", "float32")
app = create_app(AsyncEngine(Engine(model, tok, max_batch=2, max_context=64)), tok, "m", 64, read_timeout=0.5)
options = http_options(read_timeout=0.5, max_connections=connection_limit(512))
config = uvicorn.Config(app, port=int(sys.argv[2]), log_level="info", **options)
limit_log_rate()
uvicorn.Server(config).run()
"""


@pytest.mark.slow
def test_idle_connections_past_the_descriptor_limit_do_not_take_the_server_down(ckpt, tmp_path):
    """Far more idle connections than descriptors: accepts fail while they are held (asyncio logs each failure),
    but the server logs a few lines a second, cuts the idle connections off and answers again."""
    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(FLOOD_SERVER), str(ckpt), str(port)],
            cwd=REPO,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    url = f"http://127.0.0.1:{port}"
    socks = []
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        for _ in range(250):  # the kernel's backlog completes these handshakes even when the server cannot accept
            socks.append(connect(url, timeout=5))
        time.sleep(2)
        assert httpx.get(url + "/health", timeout=15).status_code == 200
    finally:
        for sock in socks:
            sock.close()
        proc.terminate()
        proc.wait(30)
    lines = log_path.read_text().splitlines()
    assert any("--max-connections 512 capped at" in line for line in lines)
    assert len(lines) < 2000, f"{len(lines)} log lines"
