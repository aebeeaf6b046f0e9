"""Run-directory safety: divergence handling (non-finite loss, gradients, weights), explicit resume, the run lock,
stray temp directories, a torn metrics line, and a trainer state that loads only plain data under checksums."""

import json
import os
import pickle
import shutil

import pytest
import torch

import k3
from k3.cli.main import main
from tests.train.train_cli import cli_args
from k3.checkpoint.format import CHECKSUMS
from k3.checkpoint.format import latest_checkpoint
from k3.checkpoint.run import STATE_FILE, resume_checkpoint
from k3.train.trainer import Trainer, TrainingDiverged
from tests.train.test_trainer import tiny_cfg


def all_finite(directory):
    model = k3.from_pretrained(directory)
    return all(torch.isfinite(t).all() for t in model.state_dict().values() if t.is_floating_point())


def small_cfg(out, **kw):
    return tiny_cfg(
        out,
        **{
            "tokenizer_train_bytes": 20_000,
            "max_tokens": 6_000,
            "seq_len": 32,
            "eval_rows": 2,
            "eval_every": 100,
            **kw,
        },
    )


def test_exploding_lr_stops_with_a_finite_checkpoint(tmp_path):
    """lr 100 (the gradients turn NaN): the steps are skipped, the QB balancer does not crash on NaN router
    scores, and the stop leaves a finite checkpoint, loadable with its state."""
    trainer = Trainer(small_cfg(tmp_path / "run", lr=100.0, steps=20, save_every=2, keep_checkpoints=1), progress=False)
    with pytest.raises(TrainingDiverged, match="3 bad steps in a row"):
        trainer.run()
    steps = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))
    assert steps and all(all_finite(p) for p in steps)
    state = torch.load(latest_checkpoint(tmp_path / "run") / STATE_FILE, weights_only=True)
    assert all(
        torch.isfinite(v).all()
        for s in state["optimizer"]["state"].values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.is_floating_point()
    )


def test_nonfinite_weights_after_an_update_roll_back(tmp_path, monkeypatch):
    """An update that makes the weights NaN (finite loss and gradients) is caught with the next step's numbers:
    the last saved state comes back, nothing non-finite is saved, and repeated failures stop the run."""
    trainer = Trainer(
        small_cfg(tmp_path / "run", balance="none", steps=8, save_every=2, max_bad_steps=2), progress=False
    )
    real_step = trainer.optimizer.step

    def poisoned_step(*a, **k):
        real_step(*a, **k)
        if trainer.step in (2, 4):
            with torch.no_grad():
                next(trainer.model.parameters()).view(-1)[0] = float("nan")

    monkeypatch.setattr(trainer.optimizer, "step", poisoned_step)
    with pytest.raises(TrainingDiverged, match="2 bad steps in a row"):
        trainer.run()
    assert [h.get("skipped") for h in trainer.history] == [
        None,
        None,
        None,
        "non-finite weights",
        None,
        "non-finite weights",
    ]
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))
    assert [p.name for p in ckpts] == ["step-000002", "step-000004", "step-000006"]
    good = k3.from_pretrained(ckpts[0]).state_dict()
    for p in ckpts[1:]:  # the rolled-back state, saved again
        assert all(torch.equal(good[k], v) for k, v in k3.from_pretrained(p).state_dict().items())


def test_nonfinite_gradient_norm_skips_the_step(tmp_path, monkeypatch):
    trainer = Trainer(small_cfg(tmp_path / "run", steps=2, save_every=0), progress=False)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    monkeypatch.setattr(trainer, "clip", lambda: torch.tensor(float("inf")))
    record = trainer.train_step()
    assert record["skipped"] and trainer.bad_steps == 1
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def test_nan_router_weights_skip_without_crashing_the_balancer(tmp_path):
    """NaN in a router (not from an update): the step is skipped, QB does not crash, and the checkpoint saved on
    stopping holds the last finite weights, not the NaN ones."""
    trainer = Trainer(small_cfg(tmp_path / "run", steps=6, save_every=0, max_bad_steps=2), progress=False)
    gate = next(
        layer.block_sparse_moe.gate for layer in trainer.model.model.layers if hasattr(layer, "block_sparse_moe")
    )
    with torch.no_grad():
        gate.weight.fill_(float("nan"))
    with pytest.raises(TrainingDiverged):
        trainer.run()
    assert all(h["skipped"] for h in trainer.history)
    assert all_finite(latest_checkpoint(tmp_path / "run"))


def test_resume_is_explicit(tmp_path, capsys):
    """A copied run resumes into the copy; conflicting flags are refused with one line naming them; --steps
    extends the run and the learning rate keeps the recorded schedule (the minimum past its end)."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(cli_args(a, "--save-every", "2")) == 0
    shutil.copytree(a, b)
    capsys.readouterr()
    for flag, value in (("--lr", "0.1"), ("--batch-size", "3"), ("--seed", "7"), ("--preset", "small")):
        args = cli_args(b, "--save-every", "2", "--resume")
        if flag in args:
            i = args.index(flag)
            args = args[:i] + args[i + 2 :]
        assert main(args + [flag, value]) == 2, flag
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and flag in err and "Traceback" not in err, err
    args = cli_args(b, "--save-every", "2", "--resume")
    args[args.index("--steps") + 1] = "6"
    assert main(args) == 0
    assert len((a / "metrics.jsonl").read_text().splitlines()) == 4  # the original is untouched
    assert not (a / "checkpoints" / "step-000006").exists() and (b / "checkpoints" / "step-000006").is_dir()
    rec = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rec] == list(range(6))
    cfg = json.loads((b / "train_config.json").read_text())
    assert cfg["out"] == str(b) and cfg["steps"] == 6 and cfg["schedule_steps"] == 4
    assert rec[3]["lr"] == pytest.approx(cfg["lr"] * cfg["min_lr_ratio"])
    assert rec[4]["lr"] == rec[5]["lr"] == rec[3]["lr"]  # no jump
    # the extended run can itself be resumed with the same flags
    assert main(args) == 2 and "already at step 6" in capsys.readouterr().err


class Boom:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_trainer_state_is_plain_data_under_checksums(tmp_path, monkeypatch):
    trainer = Trainer(tiny_cfg(tmp_path / "run", steps=2, save_every=1), progress=False)
    trainer.run(stop_at=1)
    ckpt = latest_checkpoint(tmp_path / "run")
    assert STATE_FILE in json.loads((ckpt / CHECKSUMS).read_text())["sha256"]
    torch.load(ckpt / STATE_FILE, weights_only=True)  # tensors and plain data only
    good = (ckpt / STATE_FILE).read_bytes()
    (ckpt / STATE_FILE).write_bytes(good[:-40] + bytes(40))
    with pytest.raises(ValueError, match="trainer_state.pt is corrupted"):
        Trainer(tiny_cfg(tmp_path / "run", steps=2, save_every=1), resume=True, progress=False)
    # a pickle that runs code, with a matching checksum: refused, and the code does not run
    monkeypatch.chdir(tmp_path)
    with open(ckpt / STATE_FILE, "wb") as f:
        pickle.dump({"step": Boom()}, f)
    from k3.checkpoint.format import _sha256

    sums = json.loads((ckpt / CHECKSUMS).read_text())
    sums["sha256"][STATE_FILE] = _sha256(ckpt / STATE_FILE)
    (ckpt / CHECKSUMS).write_text(json.dumps(sums))
    with pytest.raises(ValueError, match="trainer_state.pt"):
        Trainer(tiny_cfg(tmp_path / "run", steps=2, save_every=1), resume=True, progress=False)
    assert not (tmp_path / "pwned").exists()


def test_lock_stray_temp_dirs_and_torn_metrics_line(tmp_path, caplog):
    run = tmp_path / "run"
    first = Trainer(tiny_cfg(run, steps=4, save_every=2), progress=False)
    with pytest.raises(ValueError, match=f"in use by another k3 train .*pid {os.getpid()}"):
        Trainer(tiny_cfg(run, steps=4, save_every=2), progress=False)
    first.run(stop_at=2)  # "killed" after the step-2 checkpoint: the lock goes with it
    stray = run / "checkpoints" / ".step-000003.tmp-abc123"
    stray.mkdir()
    (stray / "model.safetensors").write_bytes(b"partial")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "lo')  # a kill mid-write
    resumed = Trainer(tiny_cfg(run, steps=4, save_every=2), resume=True, progress=False)
    assert not stray.exists()
    assert "partial last line" in caplog.text
    resumed.run()
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]


def test_resume_without_latest_uses_the_newest_complete_checkpoint(tmp_path, caplog):
    """A kill between a step directory's swap and the ``latest`` pointer's write leaves a complete step directory
    and no pointer: --resume continues from it. A damaged newest step is passed over for the one before it."""
    run = tmp_path / "run"
    Trainer(small_cfg(run, steps=6, save_every=2), progress=False).run(stop_at=2)
    (run / "checkpoints" / "latest").unlink()  # the state a kill during the first checkpoint's publish leaves
    with pytest.raises(ValueError, match="already holds a run"):
        Trainer(small_cfg(run, steps=6, save_every=2), progress=False)
    resumed = Trainer(small_cfg(run, steps=6, save_every=2), resume=True, progress=False)
    assert resumed.resume_from.name == "step-000002" and resumed.step == 2
    resumed.run(stop_at=4)
    ckpts = run / "checkpoints"
    assert resume_checkpoint(run).name == "step-000004"
    (ckpts / "latest").unlink()
    weights = ckpts / "step-000004" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8] ^= 0xFF
    weights.write_bytes(bytes(data))
    caplog.clear()
    assert resume_checkpoint(run).name == "step-000002"  # what Trainer(..., resume=True) continues from
    assert "step-000004" in caplog.text and "corrupted" in caplog.text
    (ckpts / "latest").write_text("step-000004")  # a pointer naming the damaged one
    assert resume_checkpoint(run).name == "step-000002"
    (ckpts / "latest").write_text("step-000009")  # a pointer naming a directory that is gone
    assert resume_checkpoint(run).name == "step-000002"
    (ckpts / "step-000002" / STATE_FILE).write_bytes(b"torn")
    with pytest.raises(ValueError, match="no complete checkpoint to resume from.*step-000004.*step-000002"):
        Trainer(small_cfg(run, steps=6, save_every=2), resume=True, progress=False)


def test_out_at_or_under_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("keep")
    for out in (tmp_path / "file", tmp_path / "file" / "run"):
        assert main(cli_args(out)) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and f"{tmp_path / 'file'} is a file, not a directory" in err, err
    assert (tmp_path / "file").read_text() == "keep"


def test_a_full_disk_while_saving_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    import errno

    import k3.checkpoint.run as run_ckpt

    real, calls = run_ckpt.torch.save, []

    def save(obj, path, *a, **k):
        calls.append(path)
        if len(calls) == 2:  # the second checkpoint: the disk fills up half way through its trainer state
            with open(path, "wb") as f:
                f.write(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(obj, path, *a, **k)

    monkeypatch.setattr(run_ckpt.torch, "save", save)
    out = tmp_path / "run"
    assert main(cli_args(out, "--save-every", "2")) == 1  # saves after step 2, then at the end (step 4)
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "No space left on device" in err and "Traceback" not in err, err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-000002"]
    assert latest_checkpoint(out).name == "step-000002" and all_finite(latest_checkpoint(out))
