"""Which optimiser rule each parameter of a K3 model gets: the parameter groups of :class:`k3.train.muon.K3Muon`
(``muon_head`` per attention head, ``muon_expert`` per expert matrix, ``muon`` whole matrices, ``adamw`` for
embeddings, norms, biases, convs, AttnRes and LoRA factors), with or without weight decay.

The rules read the model's modules (KDA and MLA projections by head, routed experts, the router), so they live
apart from the optimiser, which knows only group kinds.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor, nn

from k3.model.kda import KimiDeltaAttention
from k3.model.lora import LoRA
from k3.model.mla import MultiheadLatentAttention
from k3.model.moe import RoutedExperts, Router


def _head_dims(config) -> dict[type, dict[str, int]]:
    """Rows per head of every per-head projection, keyed by attention class and projection name."""
    k, m = config.kda, config.mla
    return {
        KimiDeltaAttention: {
            "q_proj": k.head_dim,
            "k_proj": k.head_dim,
            "v_proj": k.v_head_dim,
            "g_proj": k.v_head_dim,
        },
        MultiheadLatentAttention: {
            "q_proj": m.qk_head_dim,
            "q_b_proj": m.qk_head_dim,
            "kv_b_proj": m.qk_nope_head_dim + m.v_head_dim,
            "g_proj": m.v_head_dim,
        },
    }


def classify_parameters(
    model: nn.Module, per_head: bool = True, router: str = "muon", config=None
) -> list[tuple[str, Tensor, str, int | None, bool]]:
    """(name, param, kind, head_dim, decay) for every trainable parameter, in ``named_parameters`` order.

    Rules, first match wins:
      LoRA adapters (lora_A, lora_B; k3.model.lora)        -> adamw, no decay
      embeddings, lm_head                                  -> adamw, decay
      convs (q/k/v_conv1d, any *conv* weight)              -> adamw, no decay
      AttnRes *_res_proj / *_res_norm                      -> adamw, no decay
      1-D (norms, biases, A_log, dt_bias)                  -> adamw, no decay
      routed expert stacks (experts.w1/w2/w3)              -> muon_expert
      MoE router gate.weight                               -> ``router`` ("muon" default, or "adamw" with decay)
      KDA q/k_proj (head_dim), v/g_proj (v_head_dim);
      MLA q_proj | q_b_proj (qk_nope+qk_rope), kv_b_proj (qk_nope+v), g_proj (v)   -> muon_head (muon if not per_head)
      any other 2-D matrix                                 -> muon
      anything else (e.g. a >2-D non-expert weight)        -> adamw, no decay
    """
    if router not in ("muon", "adamw"):
        raise ValueError(f"router={router!r} must be 'muon' or 'adamw'")
    config = config if config is not None else getattr(model, "config", None)
    if config is None:
        raise ValueError("param_groups_for needs model.config (a K3Config) or config=")
    heads = _head_dims(config)
    modules = dict(model.named_modules())
    lm_head = getattr(model, "lm_head", None)
    out, seen = [], set()
    for mod_name, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            name = f"{mod_name}.{pname}" if mod_name else pname
            parent_name, _, leaf = mod_name.rpartition(".")
            parent = modules.get(parent_name)
            if isinstance(mod, LoRA):  # low-rank factors: AdamW, as LoRA trains them
                out.append((name, p, "adamw", None, False))
            elif isinstance(mod, nn.Embedding) or (lm_head is not None and mod is lm_head):
                out.append((name, p, "adamw", None, True))
            elif isinstance(mod, nn.modules.conv._ConvNd) or "conv" in pname:
                out.append((name, p, "adamw", None, False))
            elif leaf.endswith(("_res_proj", "_res_norm")):
                out.append((name, p, "adamw", None, False))
            elif p.dim() < 2:
                out.append((name, p, "adamw", None, False))
            elif isinstance(mod, RoutedExperts):
                out.append((name, p, "muon_expert", None, True))
            elif isinstance(mod, Router):
                out.append((name, p, router, None, True))
            elif p.dim() == 2:
                # isinstance, not type(): FSDP2 swaps a sharded module's class for a subclass of it
                per_class = next((v for cls, v in heads.items() if isinstance(parent, cls)), {})
                hd = per_class.get(leaf) if isinstance(mod, nn.Linear) else None
                if hd is not None and per_head:
                    if p.shape[0] % hd:
                        raise ValueError(f"{name} has {p.shape[0]} rows, not a multiple of its head size {hd}")
                    out.append((name, p, "muon_head", hd, True))
                else:
                    out.append((name, p, "muon", None, True))
            else:
                out.append((name, p, "adamw", None, False))
    return out


def param_groups_for(
    model: nn.Module, lr: float, weight_decay: float = 0.1, per_head: bool = True, router: str = "muon", config=None
) -> list[dict]:
    """Param groups for :class:`K3Muon`: one group per (kind, head_dim, decay), in first-seen order.

    Each group: ``params``, ``param_names``, ``kind``, ``lr``, ``weight_decay`` (``weight_decay`` or 0 for
    the no-decay AdamW group) and ``head_dim`` (muon_head only). See :func:`classify_parameters`.
    """
    groups: dict[tuple, dict] = {}
    for name, p, kind, hd, decay in classify_parameters(model, per_head, router, config):
        key = (kind, hd, decay)
        if key not in groups:
            groups[key] = {
                "params": [],
                "param_names": [],
                "kind": kind,
                "lr": lr,
                "weight_decay": weight_decay if decay else 0.0,
            }
            if hd is not None:
                groups[key]["head_dim"] = hd
        groups[key]["params"].append(p)
        groups[key]["param_names"].append(name)
    return list(groups.values())


def describe_groups(groups: Iterable[dict]) -> str:
    """A small table (one line per group) of kind, head_dim, weight decay, tensor and element counts."""
    lines = [f"{'kind':<12} {'head_dim':>8} {'wd':>6} {'tensors':>8} {'elements':>14}"]
    totals: dict[str, int] = {}
    for g in groups:
        n = sum(p.numel() for p in g["params"])
        totals[g["kind"]] = totals.get(g["kind"], 0) + n
        hd = g.get("head_dim")
        lines.append(
            f"{g['kind']:<12} {'-' if hd is None else hd:>8} {g['weight_decay']:>6g} {len(g['params']):>8} {n:>14,}"
        )
    total = sum(totals.values()) or 1
    lines.append("share: " + ", ".join(f"{k} {v / total:.1%}" for k, v in totals.items()))
    return "\n".join(lines)
