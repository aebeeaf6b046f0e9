"""Expert placements for serving (k3.distributed.placement): contiguous blocks by default, any placement checked
when made (every expert held, none twice on a rank, the same ranks in every layer), the per-rank tables that
split a replicated expert's tokens, the file ``k3 plan --placement`` writes and ``k3 serve --placement`` reads
(one error line for a bad one), and what k3 plan writes being its plan's placement."""

import json

import pytest

from k3.cli.main import main
from k3.distributed.placement import ExpertPlacement, contiguous, read_placement, write_placement

PLAN = ["plan", "--preset", "tiny", "--gpus", "4", "--hbm-gib", "80", "--zipf", "1.2"]


def test_contiguous_blocks():
    assert contiguous(2, 8, 4).layers == (((0, 1), (2, 3), (4, 5), (6, 7)),) * 2
    assert contiguous(1, 8, 3).layers == (((0, 1, 2), (3, 4, 5), (6, 7)),)
    assert contiguous(1, 3, 4).layers == (((0,), (1,), (2,), ()),)  # more ranks than experts: one holds none


def test_tables_split_a_replicated_experts_tokens():
    p = ExpertPlacement(4, [[[1, 3], [2, 0, 3], [3]]])
    slot, replica, replicas = (t.tolist() for t in p.tables(0, 1))
    assert slot == [1, -1, 0, 2] and replica == [0, -1, 0, 1] and replicas == [1, 1, 1, 3]
    assert [t.tolist() for t in p.tables(0, 2)][:2] == [[-1, -1, -1, 0], [-1, -1, -1, 2]]


@pytest.mark.parametrize(
    "experts, layers, message",
    [
        (4, [[[0, 1], [2]]], r"MoE layer 0: experts \[3\] are held by no rank"),
        (4, [[[0, 1, 1], [2, 3]]], r"MoE layer 0, rank 0 holds an expert twice: \[0, 1, 1\]"),
        (4, [[[0, 1, 4], [2, 3]]], r"MoE layer 0, rank 0: experts \[4\] are outside 0..3"),
        (4, [[[0, 1], [2, 3]], [[0, 1, 2, 3]]], "MoE layer 1 places experts on 1 ranks, layer 0 on 2"),
        (4, [[[0, 1], [2, 3.0]]], "a rank's experts must be integers"),
        (4, [[[0, True], [2, 3]]], "a rank's experts must be integers"),
        (4, [], "at least one MoE layer and one rank"),
        (4, {"0": 1}, "layers must be a list, not dict"),
        (0, [[[0]]], "num_experts=0 must be a positive integer"),
    ],
)
def test_bad_placements_are_one_error(experts, layers, message):
    with pytest.raises(ValueError, match=message):
        ExpertPlacement(experts, layers)


def test_a_placement_for_another_model_or_ep_is_refused():
    p = contiguous(4, 8, 2, "tiny")
    p.check(4, 8, 2)
    with pytest.raises(ValueError, match=r"the placement \(for tiny\) is for 2 ranks, but --ep=4"):
        p.check(4, 8, 4)
    with pytest.raises(ValueError, match="has 4 MoE layers of 8 experts; the model has 3 of 8"):
        p.check(3, 8, 2)


def test_file_round_trip_and_bad_files(tmp_path):
    p = ExpertPlacement(8, [[[5, 0, 3], [1, 2, 4, 6, 7, 3]]], "tiny")
    assert read_placement(write_placement(tmp_path / "sub" / "p.json", p)) == p
    good = json.loads((tmp_path / "sub" / "p.json").read_text())
    bad = tmp_path / "bad.json"
    for text, message in [
        ("{", "is not JSON"),
        ("[]", "is not an expert placement"),
        (json.dumps({**good, "format": "other"}), "is not an expert placement"),
        (json.dumps({**good, "version": 2}), "placement version 2; this k3 reads version 1"),
        (json.dumps({**good, "ranks": 3}), "ranks is 3, but its layers place experts on 2"),
        (json.dumps({**good, "layers": [[[0], [1]]]}), r"MoE layer 0: experts \[2, 3, 4, 5, 6, 7\] are held by no"),
        (json.dumps({**good, "model": 7}), "model=7 must be a name"),
    ]:
        bad.write_text(text)
        with pytest.raises(ValueError, match=f"{bad}.*{message}|{message}"):
            read_placement(bad)
    with pytest.raises(FileNotFoundError, match="placement file .*missing.json does not exist"):
        read_placement(tmp_path / "missing.json")


def test_k3_plan_writes_its_placement(tmp_path, capsys):
    out = tmp_path / "placement.json"
    assert main([*PLAN, "--json", "--placement", str(out)]) == 0
    plan = json.loads(capsys.readouterr().out)
    placement = read_placement(out)
    assert placement.model == "tiny" and placement.ranks == 4 and placement.num_experts == 8
    assert [list(map(list, layer)) for layer in placement.layers] == [p["gpu_experts"] for p in plan["placement"]]
    assert any(r > 1 for p in plan["placement"] for r in p["replicas"])  # hot experts replicated: tested as such


def test_k3_plan_placement_is_for_serving_plans(tmp_path, capsys):
    out = tmp_path / "placement.json"
    assert main([*PLAN, "--workload", "train", "--placement", str(out)]) == 2
    assert "--placement writes one serving plan's placement" in capsys.readouterr().err and not out.exists()
    assert main([*PLAN[:-4], "--hbm-gib", "0.001", "--placement", str(out)]) == 1  # does not fit: nothing written
    assert "not written (the model does not fit)" in capsys.readouterr().err and not out.exists()
