"""``k3 convert`` as a command: what ``--to`` may be, ``--force``, the tokenizer copied along, one-line errors."""

import errno
import json
import os
import shutil

import pytest

import k3
import k3.checkpoint.format as ckpt_module
from k3.cli.main import main
from k3.convert import check_destination
from k3.infer.load import load_for_inference
from tests.cli.test_generate_chat import ckpt  # noqa: F401  (a tiny checkpoint with its tokenizer)
from tests.checkpoint.test_checkpoint import assert_same


def convert(src, dst, *extra):
    return main(["convert", "--from", str(src), "--to", str(dst), *extra])


def one_error(capsys, *words):
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("k3 convert: error: ") and all(w in err for w in words), err
    return err


def tree(path):
    """Every file under path with its bytes, to show nothing was touched."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def src(ckpt, tmp_path):  # noqa: F811
    shutil.copytree(ckpt, tmp_path / "src")
    return tmp_path / "src"


def test_output_holds_the_tokenizer_and_serves(src, tmp_path, capsys):
    assert convert(src, tmp_path / "out", "--dtype", "bfloat16") == 0
    out = tmp_path / "out"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    model, tok, _ = load_for_inference(out, "cpu")
    assert tok.eos_id == load_for_inference(src, "cpu")[1].eos_id
    capsys.readouterr()
    assert main(["generate", "--ckpt", str(out), "--prompt", "Hello", "--max-tokens", "2", "--device", "cpu"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # no temp directories left


def test_a_non_empty_directory_is_refused_and_kept(src, tmp_path, capsys):
    dst = tmp_path / "mine"
    (dst / "sub").mkdir(parents=True)
    (dst / "notes.txt").write_text("mine")
    (dst / "sub" / "data.bin").write_bytes(b"\x00\x01")
    before = tree(dst)
    for extra in ((), ("--force",)):
        assert convert(src, dst, *extra) == 2
        one_error(capsys, "not empty", "notes.txt", "sub/")
        assert tree(dst) == before
    # a checkpoint with someone's file in it is not only a checkpoint: refused even with --force
    assert convert(src, tmp_path / "ck") == 0
    (tmp_path / "ck" / "README.md").write_text("notes")
    before = tree(tmp_path / "ck")
    assert convert(src, tmp_path / "ck", "--force") == 2
    one_error(capsys, "README.md")
    assert tree(tmp_path / "ck") == before


def test_to_cannot_be_from_inside_it_or_above_it(src, tmp_path, capsys):
    before = tree(src)
    os.symlink(src, tmp_path / "link")
    for dst, words in (
        (src, ["--from directory itself"]),
        (tmp_path / "link" / ".." / "src", ["--from directory itself"]),
        (src / "sub", ["inside --from"]),
        (tmp_path, ["holds --from"]),
    ):
        for extra in ((), ("--force",)):
            assert convert(src, dst, *extra) == 2, dst
            one_error(capsys, *words)
    assert convert(tmp_path / "link", src, "--force") == 2  # --from through a symbolic link
    one_error(capsys, "itself")
    assert convert(src, tmp_path / "link", "--force") == 2
    one_error(capsys, "symbolic link")
    assert tree(src) == before


def test_a_file_as_to_or_above_it_is_one_line(src, tmp_path, capsys):
    (tmp_path / "file").write_text("keep")
    assert convert(src, tmp_path / "file") == 2
    one_error(capsys, "is an existing file")
    assert convert(src, tmp_path / "file" / "out") == 2
    one_error(capsys, "is a file, not a directory")
    assert (tmp_path / "file").read_text() == "keep"


def test_root_home_and_the_current_directory_are_refused_outright(src, tmp_path, monkeypatch, capsys):
    home, work = tmp_path / "home", tmp_path / "home" / "work"
    shutil.copytree(src, work)  # a checkpoint, so only the rule about home / cwd refuses them
    shutil.copytree(src, home / "ck")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    before = tree(home)
    for dst, what in ((home, "the home directory"), (work, "the current directory"), (".", "current directory")):
        for extra in ((), ("--force",)):
            assert convert(src, dst, *extra) == 2
            one_error(capsys, what)
    for dst in ("/", home.parent):  # the check alone, before any write: nothing here touches them
        with pytest.raises(ValueError, match="which is or holds the (root|home) directory"):
            check_destination(src, dst, force=True)
    assert tree(home) == before


def test_force_replaces_an_old_checkpoint_whole(src, tmp_path, capsys):
    dst = tmp_path / "out"
    assert convert(src, dst) == 0
    assert convert(src, dst, "--dtype", "bfloat16") == 2
    one_error(capsys, "already holds a checkpoint", "--force")
    assert json.loads((dst / "config.json").read_text())["torch_dtype"] == "float32"
    assert convert(src, dst, "--dtype", "bfloat16", "--force") == 0
    assert json.loads((dst / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert (dst / "tokenizer.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_a_full_disk_is_one_line_and_keeps_the_old_checkpoint(src, tmp_path, monkeypatch, capsys):
    dst = tmp_path / "out"
    assert convert(src, dst) == 0
    old = k3.from_pretrained(dst)
    before = tree(dst)

    def full(tensors, path, *a, **k):
        with open(path, "wb") as f:
            f.write(b"partial")  # what a write cut short by a full disk leaves
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(ckpt_module, "save_file", full)
    assert convert(src, dst, "--dtype", "bfloat16", "--force") == 1
    one_error(capsys, "No space left on device")
    assert tree(dst) == before
    assert_same(old, k3.from_pretrained(dst))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # the partial copy is gone


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e-12"])
def test_max_shard_gb_must_be_positive(src, tmp_path, capsys, value):
    assert convert(src, tmp_path / "out", f"--max-shard-gb={value}") == 2
    one_error(capsys, "--max-shard-gb", "positive")
    assert not (tmp_path / "out").exists()


def test_from_a_training_run_directory_converts_its_latest_checkpoint(src, tmp_path, capsys):
    run = tmp_path / "run"
    step = run / "checkpoints" / "step-000002"
    shutil.copytree(src, step)
    (step.parent / "latest").write_text(step.name)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a run keeps its tokenizer beside the checkpoints too
        shutil.copyfile(src / name, run / name)
    (step / "tokenizer.json").unlink()
    before = tree(run)
    assert convert(run, tmp_path / "out") == 0
    assert_same(k3.from_pretrained(src), k3.from_pretrained(tmp_path / "out"))
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    # --to is kept apart from the run directory given, which holds the checkpoint read
    for dst, words in ((run / "export", ["inside --from"]), (step, ["inside --from"]), (tmp_path, ["holds --from"])):
        assert convert(run, dst) == 2
        one_error(capsys, *words)
    assert tree(run) == before
    assert convert(tmp_path / "empty-run", tmp_path / "out2") == 2
    one_error(capsys, "neither a checkpoint directory")
