"""The distributed trainer (gloo, 2 and 4 processes) against the single-process trainer on the same global batch.

One optimiser step with DP2, EP2 (dp2 x ep2), CP2 and all combined (dp2 x ep2 x cp2 on 4 processes): same loss,
same updated weights, and the same QB router bias (the histograms are all-reduced). Then a DCP checkpoint saved
on 4 ranks resumes on 2 ranks for one more step and matches two single-process steps.

Tolerances (fp32 on CPU): the distributed step sums the same per-token terms in another order (per rank, then
over ranks), so loss and gradients agree to ~1e-7 relative; one K3Muon step maps them through Newton-Schulz
(5 iterations, ~1e-6 amplification) and AdamW's first step g / (|g| + eps) (entries with |g| ~ eps amplify
rounding), hence 1e-5 on updated weights and 1e-6 on the loss. Under CP the KDA state passes through the
composed transition (P S_in + B) and each parameter gradient is summed in another order: per parameter this moves
results by up to ~2e-5 in fp32, the size of fp32's own error against fp64 for these gradients (the CP tests check
exactness in fp64 to 1e-10), hence 1e-4 per updated weight with CP. QB: the bias comes from the same reduced
histogram, so it must agree to well within one bin (we check 1e-6 absolute and one bin as the spec's bound).
"""

import dataclasses

import pytest
import torch

from k3.config import get_preset
from k3.distributed.mesh import ParallelDims
from k3.train.trainer import TrainConfig, Trainer
from tests.distributed.spawn import run
from tests.helpers import rel

ROWS = 2  # per data-parallel rank


def cfg(out, dp=1, **kw):
    base = dict(
        preset="tiny",
        steps=1,
        batch_size=ROWS * dp,
        seq_len=48,
        vocab_size=400,
        tokenizer_train_bytes=200_000,
        max_tokens=30_000,
        eval_every=1,
        eval_rows=4,
        samples=0,
        out=str(out),
        seed=0,
        lr=3e-3,
        overrides={"moe.num_experts": 8},
    )
    base.update(kw)
    return TrainConfig(**base)


def _rank_train(rank, world, config, dims, resume, records=False):
    from k3.distributed.train import DistributedTrainer

    torch.manual_seed(0)
    trainer = DistributedTrainer(config, dims, resume=resume, progress=False)
    history = trainer.run()["history"]
    return history if records else [h["loss"] for h in history]


def single(tmp_path, name, steps=1, dp=2):
    out = tmp_path / name
    result = Trainer(cfg(out, dp=1, batch_size=ROWS * dp, steps=steps), progress=False).run()
    return [h["loss"] for h in result["history"]], _weights(result["checkpoint"])


def _weights(ckpt):
    from k3.checkpoint.load import from_pretrained

    return from_pretrained(ckpt).state_dict()


def dist_weights(run_dir):
    """The run's latest DCP checkpoint through from_pretrained (config.json + shards gathered in one process)."""
    from k3.checkpoint.format import latest_checkpoint

    return _weights(latest_checkpoint(run_dir))


def compare(got, want, tol=1e-5, queries_tol=None):
    """Every weight within ``tol`` relative (the AttnRes queries, ``*_res_proj``, within ``queries_tol`` if given)."""
    worst = {}
    for k, w in want.items():
        if not w.is_floating_point() or k.endswith("e_score_correction_bias"):
            continue
        worst[k] = rel(got[k], w)
    bad = {k: v for k, v in worst.items() if v > (queries_tol if queries_tol and "_res_proj" in k else tol)}
    assert not bad, bad
    biases = [k for k in want if k.endswith("e_score_correction_bias")]
    assert biases
    for k in biases:  # QB bias from the all-reduced histograms
        assert (got[k] - want[k]).abs().max() <= 1e-6, k
        assert want[k].abs().max() > 0  # one QB update happened


@pytest.mark.parametrize(
    "world,dims,ac",
    [
        (1, ParallelDims(dp=1), False),
        (2, ParallelDims(dp=2), False),
        (2, ParallelDims(dp=2, ep=2), False),
        (2, ParallelDims(dp=1, cp=2), False),
        (4, ParallelDims(dp=2, ep=2, cp=2), False),
        (4, ParallelDims(dp=2, ep=2, cp=2), True),
    ],
    ids=["one-rank", "dp2", "ep2", "cp2", "dp2-ep2-cp2", "dp2-ep2-cp2-activation-checkpointing"],
)
def test_one_step_equals_single_process(tmp_path, world, dims, ac):
    """The first case is the one-GPU distributed path (FSDP2 over one rank, EP 1, DCP): the trainer's step within
    fp32 noise (the loss equal; the weights within 1e-6 relative but for the zero-initialised AttnRes queries,
    up to ~3e-5 after their first AdamW step). The last case recomputes every mixer and FFN in
    the backward pass (FSDP-sharded parameters, expert all-to-alls and CP exchanges repeated) and is compared with
    the single process without recomputation."""
    want_loss, want = single(tmp_path, "single", dp=dims.dp)
    losses = run(
        world, _rank_train, cfg(tmp_path / "dist", dp=1, batch_size=ROWS, activation_checkpointing=ac), dims, False
    )
    assert all(abs(loss[0] - want_loss[0]) <= 1e-6 * want_loss[0] for loss in losses), (losses, want_loss)
    tol = 1e-4 if dims.cp > 1 else 1e-5
    compare(dist_weights(tmp_path / "dist"), want, tol=tol, queries_tol=1e-4 if world == 1 else None)


def test_expert_parallel_step_records_all_to_all_time_and_rows_per_rank(tmp_path):
    """Rows received over the EP ranks = every (token, expert) pair of every MoE layer; time is measured per rank."""
    config = cfg(tmp_path / "dist", dp=1, batch_size=ROWS, steps=2, eval_every=2)
    histories = run(2, _rank_train, config, ParallelDims(dp=2, ep=2), False, True)
    model_cfg = get_preset("tiny")
    moe_layers = sum(model_cfg.ffn(i) == "moe" for i in range(model_cfg.num_hidden_layers))
    for h in histories[0] + histories[1]:  # each rank's record (rank 0 writes them)
        rows = h["ep_rows_per_rank"]
        assert len(rows) == 2 and min(rows) > 0
        assert sum(rows) == 2 * ROWS * config.seq_len * model_cfg.moe.num_experts_per_token * moe_layers
        assert h["ep_rows_imbalance"] == max(rows) / (sum(rows) / 2)
        assert len(h["a2a_s_per_rank"]) == 2 and all(t > 0 for t in h["a2a_s_per_rank"])
        assert 0 < h["a2a_share"] < 1
        assert h["tokens_per_s_per_gpu"] == pytest.approx(h["tokens_per_s"] / 2)
    # router metrics are those of the global batch (loads all-reduced), as one process on the whole batch
    one = Trainer(cfg(tmp_path / "single", dp=2, steps=1), progress=False).run()["history"]
    step0 = [h for h in one if "maxvio" in h][0]
    assert histories[0][0]["maxvio"] == pytest.approx(step0["maxvio"], rel=1e-9)
    assert histories[0][0]["dead_experts"] == step0["dead_experts"]


def test_dcp_resume_on_fewer_ranks(tmp_path):
    """Step 1 on 4 ranks (dp4 x ep2), checkpoint, step 2 on 2 ranks (dp2 x ep2) reading the same global
    batches == two single-process steps."""
    want_loss, want = single(tmp_path, "single", steps=2, dp=4)
    out = tmp_path / "dist"
    run(4, _rank_train, cfg(out, dp=1, batch_size=ROWS, steps=1), ParallelDims(dp=4, ep=2), False)
    # resume: same global batch of 4 x ROWS rows, now 2 ranks x 2 ROWS
    run(
        2,
        _rank_train,
        dataclasses.replace(cfg(out, batch_size=2 * ROWS, keep_checkpoints=1), steps=2),
        ParallelDims(dp=2, ep=2),
        True,
    )
    compare(dist_weights(out), want)
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert kept == ["latest", "step-000002"], kept  # keep_checkpoints=1 pruned step 1
    from k3.cli.main import main  # one process serves the distributed run directory as it is

    assert main(["generate", "--ckpt", str(out), "--prompt", "def f", "--max-tokens", "3", "--temperature", "0"]) == 0


@pytest.mark.parametrize("balance", ["aux", "seqaux"])
def test_auxiliary_loss_is_not_multiplied_by_the_data_ranks(tmp_path, balance):
    """Each rank's auxiliary loss is computed on its own rows and its gradients are summed over the ranks, so it
    is divided by the data ranks; the recorded aux_loss is the all-summed term that was backpropagated. It must
    be about the one-process value on the same global batch (per-rank routing statistics differ a little), not
    dp times it (the bug this guards against: 2x here)."""
    one = Trainer(cfg(tmp_path / "single", dp=2, balance=balance), progress=False).run()["history"]
    dist = run(2, _rank_train, cfg(tmp_path / "dist", balance=balance), ParallelDims(dp=2), False, True)[0]
    want = [h["aux_loss"] for h in one if "aux_loss" in h][0]
    got = [h["aux_loss"] for h in dist if "aux_loss" in h][0]
    assert want > 0 and 0.8 < got / want < 1.25, (got, want)
