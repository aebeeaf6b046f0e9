"""`k3 train`'s flags are made from TrainConfig's fields: every field has one (with help), the flag names stay
stable, giving each field's default back parses to the default config, and a resume honours only the fields
RESUME_MAY_CHANGE lists."""

import argparse
import dataclasses
import json

import pytest

from k3.cli import train as train_cli
from k3.cli.main import build_parser
from k3.train.config import RESUME_MAY_CHANGE, TrainConfig

# the flags `k3 train` has always taken; a derived flag must not rename any of them
FLAGS = [
    "--preset",
    "--task",
    "--vision-eval",
    "--set",
    "--data",
    "--tokenizer",
    "--vocab-size",
    "--max-tokens",
    "--steps",
    "--batch-size",
    "--grad-accum",
    "--seq-len",
    "--lr",
    "--weight-decay",
    "--clip",
    "--no-per-head-muon",
    "--balance",
    "--qk-clip",
    "--qat",
    "--qat-scale-mode",
    "--activation-checkpointing",
    "--eval-every",
    "--eval-rows",
    "--save-every",
    "--samples",
    "--out",
    "--resume",
    "--seed",
    "--device",
    "--dp",
    "--ep",
    "--cp",
    "--no-progress",
]
FIELDS = dataclasses.fields(TrainConfig)


def train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    train_cli.add_arguments(p)
    return p


def flag_of(name: str) -> argparse.Action:
    return next(a for a in train_parser()._actions if a.dest == name)


def config(*argv: str) -> TrainConfig:
    return train_cli.config_from_args(build_parser().parse_args(["train", *argv]))


def test_every_field_has_a_flag_with_help():
    for f in FIELDS:
        action = flag_of(f.name)
        assert action.option_strings and action.help, f.name
        assert f.metadata["help"] in action.help.replace("%%", "%"), f.name


def test_flag_names_are_kept():
    options = {o for a in train_parser()._actions for o in a.option_strings}
    assert set(FLAGS) <= options, sorted(set(FLAGS) - options)
    assert flag_of("per_head_muon").option_strings == ["--no-per-head-muon"]
    assert flag_of("activation_checkpointing").option_strings == ["--activation-checkpointing"]
    assert flag_of("overrides").option_strings == ["--set"]
    assert flag_of("qk_clip").metavar == "TAU"


def test_no_flags_give_the_default_config():
    assert config() == TrainConfig(out="runs/small")
    assert config("--preset", "tiny") == TrainConfig(preset="tiny", out="runs/tiny")
    vision = TrainConfig(task="vision", out="runs/small-vision", **train_cli.VISION_DEFAULTS)
    assert config("--task", "vision") == vision


@pytest.mark.parametrize(
    "f",
    [f for f in FIELDS if f.default not in (None, dataclasses.MISSING) and not isinstance(f.default, bool)],
    ids=lambda f: f.name,
)
def test_giving_the_default_round_trips(f):
    flag = "--" + f.name.replace("_", "-")
    cfg = config(flag, str(f.default), *(["--out", "runs/small"] if f.name != "out" else []))
    assert cfg == TrainConfig()
    assert type(getattr(cfg, f.name)) is type(f.default)


def test_switches_optional_values_and_overrides():
    assert config("--no-per-head-muon").per_head_muon is False
    assert config("--activation-checkpointing").activation_checkpointing is True
    cfg = config(
        "--qk-clip",
        "100",
        "--schedule-steps",
        "200",
        "--max-tokens",
        "5",
        "--qat",
        "mxfp4",
        "--data",
        "corpus.txt",
        "--tokenizer",
        "tok.json",
        "--set",
        "moe.num_experts=16",
        "--set",
        "name=x",
    )
    assert (cfg.qk_clip, cfg.schedule_steps, cfg.max_tokens, cfg.qat) == (100.0, 200, 5, "mxfp4")
    assert (cfg.data, cfg.tokenizer) == ("corpus.txt", "tok.json")
    assert cfg.overrides == {"moe.num_experts": 16, "name": "x"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--balance", "nope"])


def test_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = capsys.readouterr().out
    for flag in FLAGS + ["--" + f.name.replace("_", "-") for f in FIELDS if f.type != "bool" and f.name != "overrides"]:
        assert flag in text, flag


def test_resume_keeps_recorded_settings(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    recorded = TrainConfig(steps=10, lr=1e-3, out=str(out))
    (out / "train_config.json").write_text(json.dumps(dataclasses.asdict(recorded)))
    cfg = config("--resume", "--out", str(out), "--steps", "20", "--save-every", "5")
    assert cfg == dataclasses.replace(recorded, steps=20, schedule_steps=10, save_every=5)
    assert config("--resume", "--out", str(out), "--schedule-steps", "30").schedule_steps == 30
    assert {"steps", "schedule_steps", "save_every"} <= set(RESUME_MAY_CHANGE)
    with pytest.raises(ValueError, match="--lr"):
        config("--resume", "--out", str(out), "--lr", "0.5")


def test_start_up_says_what_runs_and_where_in_a_few_lines(tmp_path, monkeypatch, capsys, caplog):
    """Before the first step, `k3 train` on a CPU prints at most 10 lines (logs included): the tokenizer, the data,
    the model, the kernel plan in one line, the steps and the run directory; the detail waits for -v."""
    import logging

    from k3.cli.main import main
    from k3.train.trainer import Trainer
    from tests.train.train_cli import cli_args

    seen = {}

    def stop(self):
        seen["out"] = capsys.readouterr().out
        records = [r for r in caplog.records if r.levelno >= logging.INFO]
        seen["logs"] = [line for r in records for line in r.getMessage().split("\n")]
        raise ValueError("stopped before the first step")

    monkeypatch.setattr(Trainer, "run", stop)
    caplog.set_level(logging.INFO)
    out, data = tmp_path / "run", tmp_path / "corpus"
    data.mkdir()
    for i in range(8):  # a small corpus: documents are files, a few held out for validation
        (data / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 60)
    assert main(cli_args(out, "--data", str(data))) == 2
    lines = seen["out"].splitlines() + seen["logs"]
    assert len(lines) <= 10, "\n".join(lines)
    text = "\n".join(lines)
    for words in ("tokenizer", f"data {data}:", "model tiny:", "kernel plan on cpu:", f"the run goes to {out}"):
        assert words in text, (words, text)
