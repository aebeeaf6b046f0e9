"""Multi-query associative recall (MQAR), the synthetic recall task where the token mixers differ.

Task (Zoology / Based / Kimi Linear style, dense-query form). The vocabulary is split into ``num_keys`` key
tokens (ids 1 .. K) and ``num_values`` value tokens (ids K+1 .. K+V); id 0 is unused. A sequence is

    k_1 v_1 k_2 v_2 ... k_n v_n   q_1 w_1 q_2 w_2 ... q_m w_m

with n distinct keys drawn without replacement, values drawn with replacement, and m <= n queries q_i that are
distinct keys of the context in a random order, each followed by its associated value w_i (teacher forcing).
The target at the position of q_i is w_i; every other position is ignored (-100). Chance accuracy is 1 / V.
A model has to store n key -> value bindings and read m of them back: attention can look them up exactly, a
linear-attention state (KDA) has to hold them in its fixed-size memory.

Models. :func:`mqar_config` makes a 2-layer K3 model (``[KDA, MLA]`` by K3's schedule) from the grid's base
config with dense FFNs (no router: balancing is not what this task measures) and the task's vocabulary; the
ablation transforms of :mod:`k3.audit.ablate` then give the mixer variants (``no_kda`` = ``[MLA, MLA]``,
``no_mla`` = ``[KDA, KDA]``, ``no_attnres``). :func:`train_mqar` is its own small loop: AdamW, linear warmup +
cosine decay, a fresh batch every step from a seeded generator, accuracy on a fixed held-out set.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from k3.config import K3Config

IGNORE_INDEX = -100


@dataclass(frozen=True)
class MQARTask:
    """One MQAR setting; ``num_queries`` None = every key of the context is queried."""

    num_keys: int = 64
    num_values: int = 64
    num_pairs: int = 8
    num_queries: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_keys", "num_values", "num_pairs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MQAR {name}={v!r} must be a positive integer")
        if self.num_pairs > self.num_keys:
            raise ValueError(f"MQAR num_pairs={self.num_pairs} must be <= num_keys={self.num_keys} (keys are distinct)")
        q = self.queries
        if isinstance(q, bool) or not isinstance(q, int) or not 1 <= q <= self.num_pairs:
            raise ValueError(f"MQAR num_queries={self.num_queries!r} must be in [1, num_pairs={self.num_pairs}]")

    @property
    def queries(self) -> int:
        return self.num_pairs if self.num_queries is None else self.num_queries

    @property
    def vocab_size(self) -> int:
        return 1 + self.num_keys + self.num_values

    @property
    def seq_len(self) -> int:
        return 2 * (self.num_pairs + self.queries)

    @property
    def chance(self) -> float:
        return 1.0 / self.num_values

    def key_ids(self, idx: Tensor) -> Tensor:
        return idx + 1

    def value_ids(self, idx: Tensor) -> Tensor:
        return idx + 1 + self.num_keys


def generate(task: MQARTask, batch: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``batch`` sequences: inputs int64 [B, T] and targets int64 [B, T] (-100 except at the query keys).

    Vectorised and a pure function of the generator's state (CPU generator; move the tensors afterwards).
    """
    n, m = task.num_pairs, task.queries
    # n distinct keys per row: the first n of a random permutation of the key space
    keys = torch.rand(batch, task.num_keys, generator=generator).argsort(dim=1)[:, :n]
    values = torch.randint(task.num_values, (batch, n), generator=generator)
    order = torch.rand(batch, n, generator=generator).argsort(dim=1)[:, :m]  # which pairs are queried, in order
    q_keys, q_values = keys.gather(1, order), values.gather(1, order)
    context = torch.stack([task.key_ids(keys), task.value_ids(values)], dim=2).reshape(batch, 2 * n)
    queries = torch.stack([task.key_ids(q_keys), task.value_ids(q_values)], dim=2).reshape(batch, 2 * m)
    inputs = torch.cat([context, queries], dim=1)
    targets = torch.full_like(inputs, IGNORE_INDEX)
    targets[:, 2 * n :: 2] = task.value_ids(q_values)  # at each query key: its value
    return inputs, targets


def k3_mla_layers(num_layers: int) -> list[int]:
    """K3's mixer schedule for ``num_layers`` layers: MLA at every 4th layer (3, 7, ...) and the last one."""
    return sorted(set(range(3, num_layers - 1, 4)) | {num_layers - 1})


def mqar_config(base: K3Config, task: MQARTask, num_layers: int = 2) -> K3Config:
    """The MQAR model before any ablation: ``base``'s widths, ``num_layers`` layers in K3's schedule, dense FFNs."""
    return base.replace(
        vocab_size=task.vocab_size,
        num_hidden_layers=num_layers,
        mla_layers=k3_mla_layers(num_layers),
        first_k_dense_replace=num_layers,
        max_position_embeddings=max(base.max_position_embeddings, task.seq_len),
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        name="mqar",
    )


@dataclass
class MQARTrainConfig:
    steps: int = 300
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 20
    eval_size: int = 256
    seed: int = 0
    device: str = "cpu"


def _lr_factor(step: int, steps: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


@torch.no_grad()
def evaluate(model, inputs: Tensor, targets: Tensor, batch_size: int = 256) -> dict:
    """Query accuracy and mean cross-entropy at the query positions."""
    was_training = model.training
    model.eval()
    correct = total = 0
    loss_sum = 0.0
    for start in range(0, inputs.shape[0], batch_size):
        x, y = inputs[start : start + batch_size], targets[start : start + batch_size]
        logits = model(x).logits.float()
        mask = y != IGNORE_INDEX
        correct += int((logits.argmax(-1)[mask] == y[mask]).sum())
        total += int(mask.sum())
        loss_sum += float(F.cross_entropy(logits[mask], y[mask], reduction="sum"))
    model.train(was_training)
    return {"accuracy": correct / max(total, 1), "loss": loss_sum / max(total, 1), "queries": total}


def train_mqar(config: K3Config, task: MQARTask, cfg: MQARTrainConfig) -> dict:
    """Train a fresh model of ``config`` on ``task``; returns accuracy / loss on a held-out set and timings."""
    from k3.model.decoder import K3ForCausalLM

    if config.vocab_size < task.vocab_size:
        raise ValueError(f"vocab_size={config.vocab_size} is smaller than the MQAR vocabulary {task.vocab_size}")
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    model = K3ForCausalLM(config).to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.98),
    )
    train_gen = torch.Generator().manual_seed(cfg.seed)
    eval_gen = torch.Generator().manual_seed(1_000_003 + cfg.seed)  # disjoint stream from the training batches
    eval_x, eval_y = (t.to(device) for t in generate(task, cfg.eval_size, eval_gen))
    t0 = time.perf_counter()
    model.train()
    losses = []
    for step in range(cfg.steps):
        for g in opt.param_groups:
            g["lr"] = cfg.lr * _lr_factor(step, cfg.steps, cfg.warmup_steps)
        x, y = (t.to(device) for t in generate(task, cfg.batch_size, train_gen))
        logits = model(x).logits.float()
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    train_s = time.perf_counter() - t0
    result = evaluate(model, eval_x, eval_y)
    result.update(
        train_loss=sum(losses[-10:]) / max(1, len(losses[-10:])),
        steps=cfg.steps,
        seed=cfg.seed,
        train_s=train_s,
        chance=task.chance,
        task=dataclasses.asdict(task),
        params=sum(p.numel() for p in model.parameters()),
        layers=[config.mixer(i) for i in range(config.num_hidden_layers)],
    )
    return result
