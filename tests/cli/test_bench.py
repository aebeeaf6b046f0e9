"""`k3 bench`: its arguments are checked before it asks for a GPU (one clear error each, exit code 2), and the decode
benchmark's goals-only run picks the goals' compiled rows; the KDA layer comparison times the layers in turn."""

import pytest
import torch

from k3.bench import decode, kernels
from k3.cli.main import main


@pytest.mark.parametrize("argv,message", [
    (["bench", "decode", "--cases", "train"], "k3 bench decode --cases takes goals, not 'train'"),
    (["bench", "kernels", "--cases", "goals"], "--cases applies to k3 bench model and decode only"),
])
def test_bad_cases_are_one_clear_error(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_without_a_gpu_it_says_so(capsys):
    assert main(["bench", "decode", "--cases", "goals"]) == 2
    assert "k3 bench needs a CUDA GPU" in capsys.readouterr().err


def test_goals_run_the_compiled_rows_and_the_twin_at_128k_only():
    assert [decode.modes(b, t, False, goals=True) for b, t in decode.GOAL_CASES] == [("compiled",)] * 3
    assert [decode.modes(b, t, True, goals=True) for b, t in decode.GOAL_CASES] == [(), (), ("compiled",)]
    assert decode.modes(64, 32768, False) == ("graph", "eager", "compiled")  # the full run: unchanged


def test_layers_are_timed_in_turn_and_compared_by_their_medians():
    calls, clock = [], iter(range(100))
    fns = {"ours": lambda: None, "fla": lambda: None}

    def timer(fn, warmup, iters):  # a host whose speed drifts: each timing slower than the last
        calls.append((next(n for n, f in fns.items() if f is fn), warmup))
        return float(next(clock))

    med = kernels.interleaved_times(fns, rounds=5, timer=timer)
    assert calls == [("ours", 3), ("fla", 3)] + [("ours", 1), ("fla", 1)] * 4  # alternating, warm-up once each
    assert med == {"ours": 4.0, "fla": 5.0}  # medians of 0, 2, .., 8 and 1, 3, .., 9: the drift shared
