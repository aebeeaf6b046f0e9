"""The fp32 parts of the architecture (docs/precision.md) on the GPU's training path: a real training step under
bf16 autocast with the fast paths (fla KDA, flash MLA, grouped-GEMM experts, compiled pointwise ops), and the
compiled AttnRes phase 1 (run with ``pytest -m gpu`` on a CUDA machine)."""

import math

import pytest
import torch

from k3.model.moe import moe_layers

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"


def test_training_step_router_scores_are_fp32(tmp_path):
    """One Trainer step on the GPU (bf16 autocast, fast paths): every MoE layer's input reaches it in fp32, its
    router scores are fp32 and equal sigmoid of the fp32 GEMM of that input (fp64 truth; cuBLAS fp32, no TF32),
    and the expert sets are the top-k of the fp32 scores plus bias."""
    from k3.train.trainer import TrainConfig, Trainer

    cfg = TrainConfig(
        preset="tiny",
        steps=1,
        batch_size=2,
        seq_len=256,
        vocab_size=400,
        tokenizer_train_bytes=200_000,
        max_tokens=30_000,
        eval_every=1,
        save_every=0,
        samples=0,
        out=str(tmp_path),
        seed=0,
        device="cuda",
        overrides={
            "kda.num_heads": 4,
            "kda.head_dim": 64,
            "kda.v_head_dim": 64,
            "moe.num_experts": 64,
            "moe.num_experts_per_token": 8,
        },
    )
    trainer = Trainer(cfg, progress=False)
    seen = []

    def hook(moe, args, out):
        seen.append((moe.gate.weight.detach().clone(), args[0].detach(), out[1]))  # before the update

    handles = [m.register_forward_hook(hook) for m in moe_layers(trainer.model)]
    try:
        record = trainer.train_step()
    finally:
        for h in handles:
            h.remove()
    assert seen and math.isfinite(record["loss"])
    for weight, x, stats in seen:
        assert x.dtype == torch.float32 and stats.scores.dtype == torch.float32
        truth = torch.sigmoid(x.double() @ weight.double().T)
        assert (stats.scores.double() - truth).abs().max().item() <= 1e-5
        biased = stats.scores.detach() + stats.bias
        chosen = torch.topk(biased, stats.k, dim=-1).indices.sort(-1).values
        assert torch.equal(stats.topk_idx.sort(-1).values, chosen)


def test_compiled_attn_res_phase1_is_fp32_under_autocast():
    """The compiled phase 1 under bf16 autocast, at token counts scored by multiply-and-sum (<= 2048) and by GEMMs
    (above): log-sum-exp within 1e-5 of fp64 (a bf16 GEMM gave ~1e-2)."""
    from k3.ops import backend
    from k3.ops.attn_res import attn_res_phase1

    assert backend.resolve("attn_res_phase1", torch.device(DEV))[0] == "fast"
    g = torch.Generator(device=DEV).manual_seed(3)
    for n in (1000, 4096):
        sources = [torch.randn(n, 1024, device=DEV, generator=g) * (1 + i) for i in range(5)]
        queries = torch.randn(4, 1024, device=DEV, generator=g) * 0.1
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, lse = attn_res_phase1(queries, sources, 1e-6)
        v = torch.stack([s.double() for s in sources])
        logits = torch.einsum("snd,md->smn", v, queries.double()) * torch.rsqrt(v.pow(2).mean(-1) + 1e-6)[:, None]
        lse64 = torch.logsumexp(logits, 0)  # [M, N]
        assert lse.dtype == torch.float32
        assert (lse.double() - lse64).abs().max().item() <= 1e-5, n
