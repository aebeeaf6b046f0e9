"""Expert-parallel serving (k3.distributed.serve) on 2 and 4 gloo processes: the same requests through an EP
engine give token for token what one process's engine gives (greedy and seeded sampling, several at once, of
different lengths, joining and aborted mid-run), with contiguous blocks of experts or a placement such as k3 plan
writes (banks of different sizes, out of order, hot experts on several ranks); unseeded requests sample the same
on every rank (rank 0 gives them their seeds); a follower that dies (exits, is killed, or goes silent) ends rank 0's
engine with an error instead of a hang."""

from __future__ import annotations

import re

import pytest
import torch

from k3.config import get_preset
from k3.distributed.placement import ExpertPlacement
from k3.infer.engine import Engine
from k3.infer.sampling import SamplingParams
from k3.model.decoder import K3ForCausalLM
from tests.conftest import _perturb, pack_model_experts
from tests.distributed.spawn import run


class IdTokenizer:
    eos_id = None

    def decode(self, ids):
        return "".join(f" {i}" for i in ids)


PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((5, 23, 11, 40))]
PARAMS = [  # each token's logprob too: a wrong expert sum shows there (~1e-3) before it flips a token
    SamplingParams(max_tokens=9, temperature=0, logprobs=0),
    SamplingParams(max_tokens=6, temperature=0.9, top_k=50, seed=11, logprobs=0),
    SamplingParams(max_tokens=12, temperature=0, logprobs=0),
    SamplingParams(max_tokens=7, temperature=1.0, top_p=0.9, seed=5, logprobs=0),
]
LATE = ([3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(max_tokens=5, temperature=0.7, seed=2, logprobs=0))


# tiny's 4 MoE layers of 8 experts. On 2 ranks: banks of 3 and 6, out of order, expert 3 (then 6) on both ranks;
# on 4 ranks: what k3 plan --preset tiny --gpus 4 --zipf 1.2 places (one hot expert per layer on two GPUs).
PLACED = {
    2: ExpertPlacement(8, [[[5, 0, 3], [1, 2, 4, 6, 7, 3]], [[6, 7, 0, 1], [2, 3, 4, 5, 6]]] * 2),
    4: ExpertPlacement(
        8,
        [
            [[1, 7], [1, 2], [6, 0], [4, 3, 5]],
            [[6, 4], [6, 0], [2, 3], [5, 7, 1]],
            [[3, 0], [3, 7], [5, 6], [2, 4, 1]],
            [[3, 5], [3, 0], [4, 2], [7, 6, 1]],
        ],
    ),
}


def build_model(packed: bool = False):
    """The tiny preset in fp32, perturbed as tests/conftest.py does; ``packed``: its routed experts in MXFP4."""
    torch.manual_seed(0)
    model = _perturb(K3ForCausalLM(get_preset("tiny")), bias_std=0.05).eval()
    return pack_model_experts(model) if packed else model


def make_engine(model) -> Engine:
    # chunked prefill (16 tokens a step): prompts and decode steps mix within steps
    return Engine(model, IdTokenizer(), max_batch=3, max_num_batched_tokens=16)


def record(seen: dict, outputs) -> None:
    """Each request's (tokens, their logprobs) from one step's outputs."""
    for o in outputs:
        tokens, logprobs = seen.setdefault(o.request_id, ([], []))
        tokens += o.token_ids
        logprobs += [lp.logprob for lp in o.logprobs or []]


def script(engine) -> dict[str, tuple[list[int], list[float]]]:
    """Requests added at once, one more joining after two steps, one aborted once it has 2 tokens: each request's
    tokens and their logprobs."""
    seen = {f"r{i}": ([], []) for i in range(len(PROMPTS))} | {"victim": ([], [])}
    for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS)):
        engine.add(p, sp, request_id=f"r{i}")
    engine.add([9, 9, 9], SamplingParams(max_tokens=20, temperature=0, logprobs=0), request_id="victim")
    steps = 0
    while engine.has_work():
        record(seen, engine.step())
        steps += 1
        if steps == 2:
            engine.add(*LATE, request_id="late")
        if len(seen["victim"][0]) >= 2:
            engine.abort("victim")
    return seen


def assert_same_run(got: dict, want: dict) -> None:
    """The same requests, token for token, with logprobs equal to float32 rounding."""
    assert sorted(got) == sorted(want)
    for rid, (tokens, logprobs) in want.items():
        assert got[rid][0] == tokens, rid
        assert got[rid][1] == pytest.approx(logprobs, abs=2e-5), rid


def unseeded(engine) -> dict[str, tuple[list[int], list[float]]]:
    got = engine.generate(PROMPTS[:2], SamplingParams(max_tokens=6, temperature=1.0))
    return {f"req-{i}": (g["token_ids"], []) for i, g in enumerate(got)}  # Engine.generate's ids


def _ep_worker(rank, world, which, packed=False, placement=None):
    from k3.distributed.serve import LockstepEngine, follow, init_serving, shard_experts
    from k3.model.moe import moe_layers

    meshes, control = init_serving(world, timeout_s=30)
    model = shard_experts(build_model(packed), meshes, placement)
    held = [m.experts.expert_ids for m in moe_layers(model)]
    assert all(
        (m.experts.w1_packed if packed else m.experts.w1).shape[0] == len(h) for m, h in zip(moe_layers(model), held)
    )
    engine = make_engine(model)
    if rank == 0:
        lock = LockstepEngine(engine, control, timeout_s=30)
        try:
            out = which(lock)
        finally:
            lock.close()
        return out, held
    seen: dict = {}
    follow(engine, control, lambda outputs: record(seen, outputs))
    return seen, held


_ONE_PROCESS: dict[bool, dict] = {}


def one_process(packed: bool) -> dict[str, list[int]]:
    """The script's tokens from one process's engine (computed once per kind of experts)."""
    if packed not in _ONE_PROCESS:
        _ONE_PROCESS[packed] = script(make_engine(build_model(packed)))
    return _ONE_PROCESS[packed]


@pytest.mark.parametrize(
    "world, packed, placed",
    [
        (2, False, False),
        (2, False, True),
        pytest.param(2, True, False, marks=pytest.mark.slow),
        pytest.param(2, True, True, marks=pytest.mark.slow),
        (4, False, False),
        (4, False, True),
    ],
)
def test_ep_engine_equals_one_process(world, packed, placed):
    want = one_process(packed)
    assert len(want["victim"][0]) < 20 and all(want[k][0] for k in want)  # the abort cut it short
    placement = PLACED[world] if placed else None
    results = run(world, _ep_worker, script, packed, placement, timeout=120)
    experts = get_preset("tiny").moe.num_experts
    for rank, (seen, held) in enumerate(results):
        assert_same_run(seen, want)  # every rank ran the same steps
        if placed:
            assert held == [layer[rank] for layer in placement.layers]
        else:
            per = experts // world
            assert held == [tuple(range(rank * per, (rank + 1) * per))] * 4


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--ep", "0"], "--ep=0 must be >= 1"),
        (["--ep", "2", "--ep-timeout", "0"], "--ep-timeout=0.0 must be a positive"),
        (["--ep", "2", "--engine", "process"], "--engine process is not supported"),
        (["--ep", "2", "--compile-decode"], "--compile-decode is not supported"),
        (["--placement", "p.json"], "--placement places experts on the ranks of --ep N"),
    ],
)
def test_serve_ep_flags_are_checked(flags, message):
    from k3.cli.main import build_parser
    from k3.cli.serve import check_args

    args = build_parser("serve").parse_args(["serve", "--random", "tiny", *flags])
    with pytest.raises(ValueError, match=re.escape(message)):
        check_args(args)


def test_ep_outside_torchrun_is_one_error(monkeypatch):
    from k3.distributed.serve import init_serving

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="runs under torchrun --nproc-per-node 2"):
        init_serving(2)


def test_ep2_unseeded_sampling_agrees_across_ranks():
    """Requests without a seed: rank 0 draws one for each and the followers sample the same tokens."""
    (lead, _), (follower, _) = run(2, _ep_worker, unseeded, timeout=120)
    assert lead == follower and sorted(lead) == ["req-0", "req-1"] and all(len(v[0]) == 6 for v in lead.values())


def _with_timeout(rank, world, folder, timeout_s):
    """Remake this worker's default group with a ``timeout_s`` timeout (the helper's has the default 30 min)."""
    import datetime

    import torch.distributed as dist

    dist.destroy_process_group()
    dist.init_process_group(
        "gloo",
        init_method=f"file://{folder}/store",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _failure_worker(rank, world, folder, mode, victim):
    """Follower ``victim`` stops after two steps: it leaves (``exit``), dies (``killed``: SIGKILL) or stays without
    answering (``silent``); the other followers report how they ended."""
    import os
    import signal
    import time

    from k3.distributed.serve import LockstepEngine, follow, init_serving, shard_experts

    _with_timeout(rank, world, folder, 2.0)
    meshes, control = init_serving(world, timeout_s=2.0)
    engine = make_engine(shard_experts(build_model(), meshes))
    if rank == 0:
        told = []
        lock = LockstepEngine(engine, control, timeout_s=2.0, on_failure=told.append)
        for p, sp in zip(PROMPTS, PARAMS):
            lock.add(p, sp)
        t0, steps = time.monotonic(), 0
        with pytest.raises(Exception):
            while lock.has_work():
                t0 = time.monotonic()
                lock.step()
                steps += 1
        waited = time.monotonic() - t0
        with pytest.raises(RuntimeError, match="expert-parallel serving stopped"):
            lock.add([1, 2], SamplingParams(max_tokens=2))
        lock.close()  # sends nothing after a failure
        return told, lock.failed, lock.has_work(), steps, waited
    if rank != victim:
        with pytest.raises(RuntimeError) as err:
            follow(engine, control)
        return str(err.value)

    class Gone(Exception):
        pass

    def stop_after_two(outputs, n=[0]):
        n[0] += 1
        if n[0] == 2:
            if mode == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
            raise Gone

    with pytest.raises(Gone):
        follow(engine, control, stop_after_two)
    if mode == "silent":
        time.sleep(6.0)
    return None


@pytest.mark.parametrize(
    "world, mode", [(2, "exit"), (2, "killed"), (4, "killed"), pytest.param(2, "silent", marks=pytest.mark.slow)]
)
def test_lost_follower_fails_rank0(tmp_path, world, mode):
    """Rank 0's step raises once a follower is gone (at once) or silent (after the group's 2 s timeout); its
    engine then reports no work, refuses requests and calls ``on_failure`` once with the reason. The other
    followers end with an error naming their rank."""
    victim = world // 2
    killed = (victim,) if mode == "killed" else ()
    results = run(world, _failure_worker, str(tmp_path), mode, victim, timeout=60, killed=killed)
    told, failed, has_work, steps, waited = results[0]
    assert steps == 2 and told == [failed] and "step failed" in failed and not has_work
    assert waited < (5.0 if mode == "silent" else 1.5), waited
    assert results[victim] is None
    for rank in range(1, world):
        if rank != victim:
            assert re.match(rf"rank {rank}: step 2 failed|rank {rank} lost rank 0 or another rank", results[rank])


def _idle_worker(rank, world, folder):
    """Rank 0 idles for 3 x the group's 1 s timeout between two requests: heartbeats keep the follower waiting."""
    import time

    from k3.distributed.serve import LockstepEngine, follow, init_serving, shard_experts

    _with_timeout(rank, world, folder, 1.0)
    meshes, control = init_serving(world, timeout_s=1.0)
    engine = make_engine(shard_experts(build_model(), meshes))
    if rank != 0:
        return follow(engine, control)
    lock = LockstepEngine(engine, control, timeout_s=1.0)
    first = lock.generate([PROMPTS[0]], PARAMS[0])[0]["token_ids"]
    time.sleep(3.0)
    second = lock.generate([PROMPTS[1]], PARAMS[1])[0]["token_ids"]
    lock.close()
    return first, second, lock.failed


@pytest.mark.slow
def test_idle_longer_than_timeout(tmp_path):
    (first, second, failed), steps = run(2, _idle_worker, str(tmp_path), timeout=60)
    assert failed is None and len(first) == 9 and len(second) == 6 and steps > 0
