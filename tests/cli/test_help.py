"""``k3 --help`` and ``k3 COMMAND --help`` import no torch, matplotlib or trainer (they answer in a fraction of a
second), and the torch-free copies of the values flags offer equal their sources."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from k3.cli import generate, serve
from k3.train import config
from k3.cli.main import COMMANDS, build_parser

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "matplotlib", "k3.train.trainer")

# runs each command line's --help in one interpreter, in order, and reports the heavy modules imported after each
PROBE = """
import json, runpy, sys
lines, seen = sys.argv[1:], {}
for line in lines:
    sys.argv = ["k3", *line.split()]
    try:
        runpy.run_module("k3", run_name="__main__")
    except SystemExit:
        pass
    seen[line] = sorted(m for m in sys.modules if m in HEAVY or m == "k3.train" or m.startswith("k3.cli."))
print(json.dumps(seen), file=sys.stderr)
"""


def probe(*lines: str) -> dict:
    code = f"HEAVY = {HEAVY!r}\n" + PROBE
    proc = subprocess.run(
        [sys.executable, "-c", code, *lines], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    assert "usage: k3" in proc.stdout
    return json.loads(proc.stderr.strip().splitlines()[-1])


def test_help_imports_no_torch():
    seen = probe("--help", *(f"{c} --help" for c in COMMANDS))
    assert seen["--help"] == ["k3.cli.main"]  # no command's module, no k3.train, no torch
    for c in COMMANDS:
        heavy = [m for m in seen[f"{c} --help"] if m in HEAVY]
        assert not heavy, f"k3 {c} --help imported {heavy}"


def subparsers(parser) -> dict:
    return next(a for a in parser._actions if a.dest == "command").choices


def test_every_command_parses_and_names_its_help():
    sub = subparsers(build_parser())
    assert list(sub) == list(COMMANDS)
    for name, p in sub.items():
        assert p.get_default("func").__module__ == f"k3.cli.{name}"
    assert build_parser("info").parse_args(["info", "--kernels"]).kernels


def test_unknown_or_missing_command_is_one_usage_error(capsys):
    from k3.cli.main import main

    for argv in (["nope"], []):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert "usage: k3" in capsys.readouterr().err


def test_flag_choices_equal_their_sources():
    from k3.checkpoint.format import DEFAULT_SHARD_BYTES
    from k3.checkpoint.load import PACKED_MODES
    from k3.infer.load import DTYPE_CHOICES
    from k3.infer.serving import DEFAULT_CHAT_MAX_TOKENS
    from k3.model.balance import BALANCE_METHODS, DEFAULT_GAMMA
    from k3.ops.mx import MODES
    from k3.quant.qat import RECIPES

    assert generate.DTYPE_CHOICES == DTYPE_CHOICES
    assert generate.PACKED_MODES == PACKED_MODES
    assert serve.DEFAULT_CHAT_MAX_TOKENS == DEFAULT_CHAT_MAX_TOKENS
    assert config.MX_MODES == MODES
    assert config.BALANCE_METHODS == BALANCE_METHODS
    assert config.DEFAULT_GAMMA == DEFAULT_GAMMA
    assert set(config.QAT_RECIPES) == set(RECIPES)
    shard = next(a for a in subparsers(build_parser("convert"))["convert"]._actions if a.dest == "max_shard_gb")
    assert f"(default {DEFAULT_SHARD_BYTES / 1e9:g})" in shard.help
