"""`k3 bench`: its arguments are checked before it asks for a GPU (one clear error each, exit code 2), and the decode
benchmark's goals-only run picks the goals' compiled rows."""

import pytest
import torch

from k3.bench import decode
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
