"""torch.distributed.checkpoint with resharding: train state saved on 4 ranks (dp=4, ep=2) loads exactly on 2 ranks
(dp=2, ep=2) and into a plain single-process model + K3Muon; a step after loading matches across layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.distributed.spawn import run
from tests.distributed.test_expert_parallel import (
    build_model,
    compare,
    full,
    make_optimizer,
    one_thread,
    portable,
    prepare,
    single_step,
    train_step,
)

EXTRA = {"step": 1, "data": {"epoch": 0, "position": 4}, "note": "dcp test"}


def train_state(model, opt) -> dict:
    """Full (gathered) parameters, buffers and optimizer state by parameter name, and the param-group settings."""
    names = {p: n for n, p in model.named_parameters()}
    state = {}
    for p, s in opt.state.items():
        state[names[p]] = {k: full(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return {
        "params": {n: full(p) for n, p in model.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
        "optim": state,
        "groups": groups,
    }


def save_on_ranks(rank, world, path):
    from k3.checkpoint.dcp import save

    meshes, model, opt = prepare(dp=4, ep=2)
    with torch.no_grad():  # a router-bias update, as the balancer would do (identical on every rank)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(0.01)
    train_step(meshes, model, opt)
    save(path, model, opt, EXTRA)
    save(path, model, opt, EXTRA)  # overwriting an existing checkpoint is atomic too
    return portable(train_state(model, opt))


def load_on_ranks(rank, world, path):
    from k3.checkpoint.dcp import load

    meshes, model, opt = prepare(dp=2, ep=2, seed=1)  # other initial weights: everything must come from the file
    extra = load(path, model, opt)
    loaded = train_state(model, opt)
    after = train_step(meshes, model, opt)  # the resumed run goes on
    return portable({"extra": extra, "state": loaded, "step": after})


def assert_same(a, b, where=""):
    """Exact equality of nested dicts / lists of arrays, tensors and plain values."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, sorted(a), sorted(b))
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, (np.ndarray, torch.Tensor)):
        x, y = np.asarray(a), np.asarray(b)
        assert x.shape == y.shape and x.dtype == y.dtype and np.array_equal(x, y), where
    else:
        assert a == b, (where, a, b)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("dcp") / "ckpt"
    return path, run(4, save_on_ranks, str(path))


def test_saved_checkpoint_layout(saved):
    path, states = saved
    assert (path / ".metadata").exists() and (path / "extra.pt").exists()
    assert [p.name for p in path.parent.iterdir()] == ["ckpt"], "temp directories left behind"
    for s in states[1:]:  # the replicas agree before saving
        assert_same(s, states[0])
    optim = states[0]["optim"]
    assert optim.keys() == states[0]["params"].keys()  # every parameter has optimizer state
    assert all(s["step"] == 1 for s in optim.values() if "step" in s)
    assert all(np.abs(s["momentum_buffer"]).max() > 0 for s in optim.values() if "momentum_buffer" in s)


def test_load_on_two_ranks_reshards_exactly(saved):
    path, states = saved
    results = run(2, load_on_ranks, str(path))
    for res in results:
        assert res["extra"] == EXTRA
        assert_same(res["state"], states[0], "dp=2 ep=2")
    # the resumed step is the same on every rank and equals one process resuming from the same checkpoint
    ref = one_thread(single_resumed_step, path)
    compare([r["step"] for r in results], ref, label="resumed dp=2 ep=2 vs 1 process")


def test_load_into_single_process_exactly(saved):
    from k3.checkpoint.dcp import load_into_single

    path, states = saved
    model = build_model(seed=2)
    opt = make_optimizer(model)
    extra = load_into_single(path, model, opt)
    assert extra == EXTRA
    assert_same(portable(train_state(model, opt)), states[0], "single")
    # weights only (no optimizer)
    model = build_model(seed=3)
    load_into_single(path, model)
    assert_same(portable({n: p.detach() for n, p in model.named_parameters()}), states[0]["params"], "weights only")


def single_resumed_step(path) -> dict:
    """single_step's computation, started from the checkpoint instead of the initial weights."""
    from k3.checkpoint.dcp import load_into_single

    model = build_model(seed=2)
    opt = make_optimizer(model)
    load_into_single(path, model, opt)
    return single_step(model=model, opt=opt)
