"""The training loop: exact resume, atomic checkpoints, packing == per-document, QB vs none, NaN handling."""

import json

import pytest
import torch
import torch.nn.functional as F

import k3
import k3.checkpoint.run as run_ckpt
from k3.cli.main import main
from tests.train.train_cli import cli_args
from k3.config import get_preset
from k3.model.decoder import K3ForCausalLM
from k3.checkpoint.format import latest_checkpoint, resolve_checkpoint
from k3.train.trainer import TrainConfig, Trainer, TrainingDiverged


def tiny_cfg(out, **kw):
    base = dict(
        preset="tiny",
        steps=6,
        batch_size=2,
        seq_len=48,
        vocab_size=400,
        tokenizer_train_bytes=200_000,
        max_tokens=30_000,
        eval_every=3,
        eval_rows=4,
        save_every=3,
        samples=1,
        out=str(out),
        seed=0,
    )
    base.update(kw)
    return TrainConfig(**base)


def losses(history):
    return [h["loss"] for h in history]


def test_resume_is_bitwise_identical(tmp_path):
    full = Trainer(tiny_cfg(tmp_path / "full"), progress=False).run()
    first = Trainer(tiny_cfg(tmp_path / "split"), progress=False)
    first.run(stop_at=3)  # "killed" after the step-3 checkpoint
    assert latest_checkpoint(tmp_path / "split").name == "step-000003"
    resumed = Trainer(tiny_cfg(tmp_path / "split"), resume=True, progress=False).run()
    assert losses(resumed["history"]) == losses(full["history"])  # bitwise, every step
    a = k3.from_pretrained(full["checkpoint"]).state_dict()
    b = k3.from_pretrained(resumed["checkpoint"]).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    lines = (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(6))


def test_failed_checkpoint_write_keeps_previous(tmp_path, monkeypatch):
    trainer = Trainer(tiny_cfg(tmp_path / "run", steps=4, save_every=2), progress=False)
    trainer.run(stop_at=2)
    good = latest_checkpoint(tmp_path / "run")
    before = k3.from_pretrained(good).state_dict()
    trainer.run(stop_at=3)

    def broken_save(obj, path, *a, **k):
        raise OSError("disk full (simulated) while writing " + str(path))

    monkeypatch.setattr(run_ckpt.torch, "save", broken_save)
    with pytest.raises(OSError, match="simulated"):
        trainer.save()
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path / "run") == good
    after = k3.from_pretrained(good).state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["latest", "step-000002"]
    assert resolve_checkpoint(tmp_path / "run") == good
    Trainer(tiny_cfg(tmp_path / "run", steps=4, save_every=2), resume=True, progress=False).run()


def test_packed_step_equals_per_document_step(perturb):
    """In fp64, so the only difference allowed is summation order (rel. 1e-10)."""
    torch.manual_seed(0)
    model = perturb(K3ForCausalLM(get_preset("tiny")).double(), bias_std=0)
    docs = [torch.randint(0, 512, (n,)) for n in (17, 40, 9)]

    def grads_of(loss):
        model.zero_grad()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ids = torch.cat(docs)[None]
    cu = torch.tensor([0, 17, 57, 66])
    labels = torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in docs])
    packed = F.cross_entropy(model(ids, cu_seqlens=cu).logits[0], labels, ignore_index=-100, reduction="sum") / 63
    g_packed = grads_of(packed)
    separate = sum(F.cross_entropy(model(d[None]).logits[0, :-1], d[1:], reduction="sum") for d in docs) / 63
    g_sep = grads_of(separate)
    assert abs(packed.item() - separate.item()) <= 1e-12 * abs(separate.item())
    assert g_packed.keys() == g_sep.keys()
    for n in g_sep:
        err = ((g_packed[n] - g_sep[n]).norm() / g_sep[n].norm().clamp_min(1e-30)).item()
        assert err <= 1e-10, (n, err)


def test_qb_balances_better_than_none(tmp_path, capsys):
    kw = dict(
        steps=50,
        save_every=0,
        eval_every=50,
        batch_size=4,
        seq_len=64,
        max_tokens=60_000,
        lr=1e-2,
        overrides={"moe.num_experts": 16, "moe.num_experts_per_token": 2},
    )
    runs = {
        m: Trainer(tiny_cfg(tmp_path / m, balance=m, **kw), progress=False).run()["history"] for m in ("qb", "none")
    }
    late = {m: sum(h["maxvio"] for h in hist[-10:]) / 10 for m, hist in runs.items()}
    with capsys.disabled():
        print(f"\nglobal-batch MaxVio, mean of steps 40-49: qb {late['qb']:.3f}, none {late['none']:.3f}")
    assert late["qb"] < 0.5 * late["none"], late


def test_nan_steps_are_skipped_then_stop(tmp_path, monkeypatch):
    trainer = Trainer(tiny_cfg(tmp_path / "run", steps=10, save_every=0), progress=False)
    real = trainer._forward_loss
    bad_steps = {1, 3, 4, 5}

    def flaky(batch, record=False):
        loss_sum, n, out = real(batch, record)
        return (loss_sum * float("nan") if trainer.step in bad_steps else loss_sum), n, out

    monkeypatch.setattr(trainer, "_forward_loss", flaky)
    weights_after_step_2 = {}

    def snapshot():
        weights_after_step_2.update({k: v.clone() for k, v in trainer.model.state_dict().items()})

    trainer.run(stop_at=3)
    snapshot()
    with pytest.raises(TrainingDiverged, match="3 bad steps in a row"):
        trainer.run()
    hist = trainer.history
    assert hist[1]["skipped"] and not hist[2].get("skipped") and all(hist[i]["skipped"] for i in (3, 4, 5))
    saved = k3.from_pretrained(latest_checkpoint(tmp_path / "run")).state_dict()
    assert all(torch.equal(saved[k], weights_after_step_2[k]) for k in saved)  # the last good weights


def test_cli_train_end_to_end(tmp_path, capsys):
    out = tmp_path / "cli"
    args = cli_args(out, "--set", "moe.num_experts=4")
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "validation loss" in text and "at start" in text and "checkpoint:" in text
    lines = text.splitlines()
    heading = next(
        i
        for i, line in enumerate(lines)
        if line.startswith("samples (prompt\u2502continuation) of the tiny model after 4 steps (")
    )
    assert "drawn at temperature 0.8, top-p 0.95, repetition penalty 1.3, seed 0" in lines[heading], lines[heading]
    assert lines[heading + 1] == "-" * 72 and "\u2502" in lines[heading + 2]  # prompt│continuation
    for f in ("metrics.jsonl", "loss.png", "expert_load.png", "attn_res.png", "tokenizer.json", "train_config.json"):
        assert (out / f).is_file(), f
    rec = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all({"step", "loss", "lr"} <= set(r) for r in rec) and len(rec) == 4
    assert k3.from_pretrained(out / "checkpoints" / "step-000004").config.moe.num_experts == 4
    assert main(args) == 2  # the run exists: refuse to overwrite without --resume
    assert "already holds a run" in capsys.readouterr().err
    assert main(args[:4] + ["6"] + args[5:] + ["--resume"]) == 0  # extend to 6 steps
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 6


@pytest.mark.parametrize("task,steps", [("text", 2), ("vision", 1)])  # vision rows are longer: one step
def test_maxvio_three_forms(tmp_path, task, steps):
    """maxvio (global batch), maxvio_micro and maxvio_seq in metrics.jsonl equal the figures recomputed from the
    router statistics with plain Python, and maxvio.png is written; the vision task's offsets span the router's
    tokens as the text task's do. With equal-sized micro-batches on one process the forms also obey
    global <= micro <= per-sequence (a merged load's maximum is at most the sum of the parts')."""
    trainer = Trainer(
        tiny_cfg(
            tmp_path / "run",
            task=task,
            steps=steps,
            grad_accum=2,
            save_every=0,
            eval_every=2,
            eval_rows=1,
            seq_len=32,
            tokenizer_train_bytes=20_000,
            max_tokens=4_000,
        ),
        progress=False,
    )
    real, seen = trainer._forward_loss, {}

    def spy(batch, record=False):
        loss_sum, n, out = real(batch, record)
        if trainer.model.training:
            seen.setdefault(trainer.step, []).append(
                (batch.cu_seqlens.tolist(), [(s.layer, s.topk_idx.tolist()) for s in out.router_stats])
            )
        return loss_sum, n, out

    trainer._forward_loss = spy
    trainer.run()
    e = trainer.model_cfg.moe.num_experts
    rec = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rec] == list(range(steps)) and (tmp_path / "run" / "maxvio.png").is_file()

    def vio(counts):
        return max(counts) / (sum(counts) / len(counts)) - 1

    def counts_of(rows):
        c = [0] * e
        for t in rows:
            for j in t:
                c[j] += 1
        return c

    for r in rec:
        micro_batches = seen[r["step"]]
        assert len(micro_batches) == 2 and len(micro_batches[0][1]) >= 2  # grad_accum micro-batches, MoE layers
        micro, seq, merged = [], [], {}
        for cu, layers in micro_batches:
            for layer, rows in layers:
                assert len(rows) == cu[-1]  # the offsets span the router's tokens
                c = counts_of(rows)
                micro.append(vio(c))
                merged[layer] = [a + b for a, b in zip(merged.get(layer, [0] * e), c)]
                parts = [rows[a:b] for a, b in zip(cu[:-1], cu[1:]) if b > a]
                seq.append(sum(len(p) * vio(counts_of(p)) for p in parts) / sum(len(p) for p in parts))
        assert r["maxvio"] == pytest.approx(sum(map(vio, merged.values())) / len(merged), rel=1e-5)
        assert r["maxvio_micro"] == pytest.approx(sum(micro) / len(micro), rel=1e-5)
        assert r["maxvio_seq"] == pytest.approx(sum(seq) / len(seq), rel=1e-5)
        assert 0 <= r["maxvio"] <= r["maxvio_micro"] + 1e-6 and r["maxvio_micro"] <= r["maxvio_seq"] + 1e-6
        assert r["maxvio_seq"] > r["maxvio_micro"]  # packed documents differ: the per-sequence form is not the same


def test_validation_rows_are_the_same_for_every_seed_and_span_the_split(tmp_path):
    """The evaluation rows come from the validation documents in a fixed shuffled order: two seeds evaluate the same
    tokens, and they are not just the split's first documents."""
    from k3.data.corpus import load_corpus
    from k3.data.packing import PackedDataset
    from k3.train.trainer import VALIDATION_SEED

    a, b = (Trainer(tiny_cfg(tmp_path / f"s{s}", seed=s, eval_rows=64), progress=False) for s in (0, 1))
    assert torch.equal(a.val_data.tokens, b.val_data.tokens)
    assert not torch.equal(a.train_data.tokens[:1000], b.train_data.tokens[:1000])
    in_order = PackedDataset(load_corpus(None, "validation"), a.tokenizer, 48, shuffle=False, max_tokens=64 * 48 + 1)
    assert not torch.equal(a.val_data.tokens[:500], in_order.tokens[:500])
    shuffled = PackedDataset(load_corpus(None, "validation"), a.tokenizer, 48, seed=VALIDATION_SEED, max_tokens=3073)
    assert torch.equal(a.val_data.tokens, shuffled.tokens)


def test_samples_are_seeded_draws_of_the_serving_engine(tmp_path, monkeypatch):
    """The end-of-run samples are the engine's draws with Trainer.sample_params (sampled with a repetition
    penalty, not greedy; seeded, so a fresh engine draws the same) and leave the model training."""
    import k3.train.trainer as trainer_module
    from k3.infer.engine import Engine

    monkeypatch.setattr(trainer_module, "SAMPLE_TOKENS", 8)
    cfg = tiny_cfg(tmp_path / "run", steps=1, save_every=0, samples=2, tokenizer_train_bytes=20_000, max_tokens=4_000)
    trainer = Trainer(cfg, progress=False)
    trainer.run()
    params = trainer.sample_params()
    assert params.temperature > 0 and params.top_p < 1 and params.repetition_penalty > 1 and params.seed == 0
    assert params.max_tokens == 8
    got = trainer.sample()
    assert len(got) == 2 and trainer.model.training
    prompts = [trainer.tokenizer.encode(d.text[:2000])[:24] for d in trainer.val_docs[:2]]
    want = Engine(trainer.model, trainer.tokenizer, max_batch=2).generate(prompts, params)
    assert got == [(trainer.tokenizer.decode(p), w["text"]) for p, w in zip(prompts, want)]
