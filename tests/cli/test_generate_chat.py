"""``k3 generate`` and ``k3 chat`` on a tiny random checkpoint: the printed text is the engine's greedy output."""

import io
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3.cli.main import main
from k3.config import get_preset
from k3.data.chat import render_chat
from k3.infer.engine import Engine
from k3.infer.load import load_for_inference
from k3.infer.sampling import SamplingParams
from k3.model.decoder import K3ForCausalLM
from k3.data.tokenizer import DEFAULT_SPECIAL_TOKENS, train_bpe
from k3.checkpoint.format import save_pretrained

REPO = Path(__file__).resolve().parents[2]
TEXT = "The assistant answers the user in a few words. Hello there, how are you today? " * 30


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    tok = train_bpe([TEXT], vocab_size=400)
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset("tiny").replace(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id))
    path = tmp_path_factory.mktemp("ckpt")
    save_pretrained(model, path)
    tok.save(path)
    return path


@pytest.fixture(scope="module")
def greedy(ckpt):
    model, tok, _ = load_for_inference(ckpt, "cpu", "float32")
    engine = Engine(model, tok, max_batch=1)

    def run(prompt_ids, max_tokens, **kw):
        return engine.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, temperature=0, **kw))[0]["text"]

    return tok, run


def test_generate_prints_the_greedy_continuation(ckpt, greedy, capsys):
    tok, run = greedy
    assert (
        main(
            [
                "generate",
                "--ckpt",
                str(ckpt),
                "--prompt",
                "Hello there",
                "--max-tokens",
                "8",
                "--temperature",
                "0",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert out == run(tok.encode("Hello there"), 8) + "\n"
    assert "prompt +" in err and "generated tokens" in err and "finish:" in err


def test_generate_from_a_run_directory(ckpt, tmp_path, capsys):
    step = tmp_path / "run" / "checkpoints" / "step-000001"
    shutil.copytree(ckpt, step)
    (step.parent / "latest").write_text(step.name)
    assert (
        main(
            [
                "generate",
                "--ckpt",
                str(tmp_path / "run"),
                "--prompt",
                "Hi",
                "--max-tokens",
                "3",
                "--seed",
                "1",
                "--top-k",
                "5",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.endswith("\n")


def test_generate_clear_errors(ckpt, tmp_path, capsys):
    bare = tmp_path / "bare"
    shutil.copytree(ckpt, bare)
    (bare / "tokenizer.json").unlink()
    assert main(["generate", "--ckpt", str(bare), "--prompt", "Hi", "--device", "cpu"]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err
    assert main(["generate", "--ckpt", str(tmp_path / "missing"), "--prompt", "Hi"]) == 2
    assert "neither a checkpoint directory" in capsys.readouterr().err
    assert main(["generate", "--ckpt", str(ckpt), "--prompt", "Hi", "--top-p", "0"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_chat_two_turns_reset_and_exit(ckpt, greedy, capsys, monkeypatch):
    tok, run = greedy
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\nHow are you?\n/reset\nHello\n/exit\nnever read\n"))
    assert (
        main(
            [
                "chat",
                "--ckpt",
                str(ckpt),
                "--max-tokens",
                "6",
                "--temperature",
                "0",
                "--device",
                "cpu",
                "--system",
                "Be brief.",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()

    def reply(history):
        r = render_chat(history, tok)
        return run(r.token_ids, 6, stop=r.stop, stop_token_ids=r.stop_token_ids)

    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    first = reply(history)
    history += [{"role": "assistant", "content": first.strip()}, {"role": "user", "content": "How are you?"}]
    second = reply(history)
    assert out == f"{first}\n{second}\n{first}\n"  # after /reset the first turn repeats; /exit stops reading
    assert "[history cleared]" in err


def test_chat_over_a_pipe(ckpt):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "k3",
            "chat",
            "--ckpt",
            str(ckpt),
            "--max-tokens",
            "4",
            "--temperature",
            "0",
            "--device",
            "cpu",
            "--stats",
        ],
        cwd=REPO,
        input="Hello\nHow are you?\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("generated tokens") == 2  # two replies, then EOF ends the REPL
    assert "you>" not in proc.stdout  # no prompts when stdin is not a terminal


def test_generate_refuses_a_temperature_the_sampler_cannot_use(ckpt, capsys):
    with pytest.raises(ValueError) as alone:
        SamplingParams(temperature=-1e-40).validate()
    assert main(["generate", "--ckpt", str(ckpt), "--prompt", "Hi", "--temperature=-1e-40", "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"k3 generate: error: {alone.value}\n"  # one line, the server's message too


def test_an_empty_prompt_starts_from_the_bos_token(ckpt, tmp_path, capsys):
    """``--prompt ""`` continues the BOS token (one prompt token); without a BOS in the vocabulary, one line."""
    argv = ["generate", "--prompt", "", "--max-tokens", "6", "--temperature", "0", "--device", "cpu"]
    assert main([*argv, "--ckpt", str(ckpt)]) == 2
    out, err = capsys.readouterr()
    last = err.splitlines()[-1]
    assert out == "" and "Traceback" not in err
    assert last.startswith("k3 generate: error: the prompt is empty") and "no BOS token" in last
    tok = train_bpe([TEXT], vocab_size=400, special_tokens=(*DEFAULT_SPECIAL_TOKENS, "<s>"))
    with_bos = tmp_path / "bos"
    save_pretrained(K3ForCausalLM(get_preset("tiny").replace(vocab_size=tok.vocab_size)), with_bos)
    tok.save(with_bos)
    model, tok, _ = load_for_inference(with_bos, "cpu", "float32")
    assert tok.bos_token == "<s>"
    want = Engine(model, tok, max_batch=1).generate([[tok.bos_id]], SamplingParams(max_tokens=6, temperature=0))
    assert main([*argv, "--ckpt", str(with_bos)]) == 0
    out, err = capsys.readouterr()
    assert out == want[0]["text"] + "\n" and err.splitlines()[-1].startswith("[1 prompt + 6 generated tokens")


def test_a_config_that_is_not_an_object_is_one_line(ckpt, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    (bad / "config.json").write_text("[]")
    assert main(["generate", "--ckpt", str(bad), "--prompt", "Hi", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err == f"k3 generate: error: {bad / 'config.json'} must hold a JSON object, not list\n", err


def test_invalid_utf8_in_a_prompt_is_one_line(ckpt, capsys):
    prompt = b"Hello \xff\xfe there".decode("utf-8", "surrogateescape")  # how Python hands over such argv bytes
    for argv in (["generate", "--prompt", prompt], ["generate", "--prompt", "Hi", "--stop", prompt]):
        assert main([*argv, "--ckpt", str(ckpt), "--device", "cpu", "--max-tokens", "2"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1 and "is not valid UTF-8 (byte 0xff at character 6)" in err
    assert main(["chat", "--ckpt", str(ckpt), "--device", "cpu", "--system", prompt]) == 2
    assert "--system is not valid UTF-8" in capsys.readouterr().err


@pytest.mark.parametrize("surrogates", [False, True])
def test_chat_skips_a_line_that_is_not_utf8(ckpt, greedy, capsys, monkeypatch, surrogates):
    """Bytes on stdin (a pipe) or text already decoded with surrogateescape: the bad line gets one line on stderr,
    the conversation goes on as if it had not been typed."""
    tok, run = greedy
    data = b"Hello \xff there\nHello\n"
    stdin = io.StringIO(data.decode("utf-8", "surrogateescape")) if surrogates else io.TextIOWrapper(io.BytesIO(data))
    monkeypatch.setattr(sys, "stdin", stdin)
    assert main(["chat", "--ckpt", str(ckpt), "--max-tokens", "4", "--temperature", "0", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    r = render_chat([{"role": "user", "content": "Hello"}], tok)
    assert out == run(r.token_ids, 4, stop=r.stop, stop_token_ids=r.stop_token_ids) + "\n"
    assert "[that line is not valid UTF-8 (byte 0xff at " in err and "Traceback" not in err


@pytest.fixture
def keep_threads(monkeypatch):
    from k3.cli.threads import THREAD_ENV

    for name in THREAD_ENV:
        monkeypatch.delenv(name, raising=False)
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_single_stream_decode_runs_one_cpu_thread_unless_told(keep_threads, monkeypatch):
    from k3.cli.threads import single_stream_threads

    cpu = torch.device("cpu")
    torch.set_num_threads(2)
    assert single_stream_threads(None, torch.device("cuda")) == 2  # a GPU's decode: torch's own count
    assert single_stream_threads(None, cpu) == 1
    assert single_stream_threads(2, cpu) == 2  # --threads
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    assert single_stream_threads(None, cpu) == 2  # the user's OMP_NUM_THREADS stands
    with pytest.raises(ValueError, match="--threads=0 must be a positive integer"):
        single_stream_threads(0, cpu)


def test_generate_sets_its_threads(ckpt, keep_threads, capsys):
    base = ["generate", "--ckpt", str(ckpt), "--prompt", "Hi", "--max-tokens", "2", "--device", "cpu"]
    torch.set_num_threads(2)
    assert main(base) == 0 and torch.get_num_threads() == 1
    assert main([*base, "--threads", "2"]) == 0 and torch.get_num_threads() == 2
    capsys.readouterr()
    assert main([*base, "--threads", "0"]) == 2
    assert capsys.readouterr().err == "k3 generate: error: --threads=0 must be a positive integer\n"
