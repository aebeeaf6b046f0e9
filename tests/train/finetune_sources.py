"""Checkpoints the fine-tuning tests start from: a tiny model with non-trivial weights and a small BPE with Kimi's
chat tokens, written as a k3 checkpoint, a run directory, or a release layout."""

import json
from pathlib import Path

import torch

from k3.config import get_preset
from k3.checkpoint.format import save_pretrained
from k3.data.tokenizer import train_bpe
from k3.model.decoder import K3ForCausalLM
from k3.train.trainer import TrainConfig

TEXT = (
    "def add(a, b):\n    return a + b\n\nThe user asks and the assistant answers in a few words.\n"
    "import os\nprint(os.path.join('a', 'b'))\nWhat is 2 + 3? It is 5. Reverse 'abc': 'cba'.\n"
)


def tokenizer():
    return train_bpe([TEXT * 20], vocab_size=300)


def tiny_model(tok, seed: int = 0, cls=K3ForCausalLM, config=None):
    """A tiny model whose router biases and AttnRes queries are non-zero (they start at zero), so loading them
    wrongly would change the logits."""
    torch.manual_seed(seed)
    cfg = (config or get_preset("tiny")).replace(
        vocab_size=tok.vocab_size, eos_token_id=tok.eos_id, bos_token_id=tok.bos_id
    )
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    return model


def write_checkpoint(directory: Path, model, tok, **save) -> Path:
    save_pretrained(model, directory, **save)
    tok.save(directory)
    return directory


def write_run(run: Path, model, tok) -> Path:
    """A run directory's layout: checkpoints/step-000002 and checkpoints/latest naming it."""
    step = write_checkpoint(run / "checkpoints" / "step-000002", model, tok)
    (run / "checkpoints" / "latest").write_text(step.name)
    return step


def corpus(directory: Path) -> Path:
    """A small text corpus (.jsonl, 80 documents): quicker to read than the standard library."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "corpus.jsonl"
    lines = [json.dumps({"text": f"# part {i}\n" + TEXT.replace("2 + 3", f"{i} + 3")}) for i in range(80)]
    path.write_text("\n".join(lines) + "\n")
    return path


def finetune_cfg(out, init_from, **kw) -> TrainConfig:
    base = dict(
        init_from=str(init_from),
        data=str(corpus(Path(out).parent / "data")),
        steps=4,
        batch_size=2,
        seq_len=48,
        max_tokens=6_000,
        eval_every=2,
        eval_rows=2,
        save_every=2,
        samples=1,
        out=str(out),
        seed=0,
    )
    base.update(kw)
    return TrainConfig(**base)


def logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(ids).logits
