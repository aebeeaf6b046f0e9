"""Audit question 5 (analytic part): the router frontier of a top-k MoE under capacity limits and expert
parallelism. Nothing here runs the model; it takes E, k, d and l from the config.

Routing models
- uniform: every token picks k distinct experts uniformly at random. Exact results: an expert's load over T
  tokens is Binomial(T, k/E), so the expected overflow Σ_j E[(L_j - C)^+] / (T k) (dropped slots, or the slots
  a rerouting policy must move) and the expected padding follow from one binomial pmf; the number of distinct
  EP ranks a token reaches is hypergeometric.
- Zipf(s): expert j (0-indexed) has popularity w_j ∝ (j + 1)^-s and each token takes the top-k of
  log w + Gumbel noise (sampling k experts without replacement in proportion to w, i.e. a noisy, skewed router
  without load balancing). Figures come from a seeded simulation (``torch.Generator``).
Expert parallelism: R ranks, experts placed contiguously (rank r holds experts [r E/R, (r+1) E/R)); for the
Zipf model both the popularity-sorted placement (hot experts together: worst case) and a random placement.
A token's payload is sent once to every distinct rank holding one of its experts (deduplicated dispatch) and
one partial sum per rank comes back (combine); the token's home rank is uniform, so (R-1)/R of that traffic
crosses the network. The straggler model: the MoE phase of a step takes max-rank load / mean-rank load times
the balanced time (the slowest rank gates the all-to-all).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from k3.config import K3Config
from k3.model.router_stats import drop_fraction, expert_capacity, expert_loads

TOKENS_PER_STEP = (64, 256, 1024, 4096, 16384, 65536)
SIM_TOKENS = (64, 256, 1024, 4096, 16384)
EP_SIZES = (8, 64)
CAPACITY_FACTORS = (1.0, 1.25)
PAD_MULTIPLES = (8, 128)


# ---------------------------------------------------------------------------------------------- uniform, exact
def _binomial_window(n: int, p: float, lo: int = 0, hi: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Support points and pmf of Binomial(n, p) over a window holding all but ~1e-30 of the mass."""
    mean, sd = n * p, math.sqrt(n * p * (1 - p))
    a = max(0, min(lo, int(mean - 14 * sd - 2)))
    b = min(n, max(hi or 0, int(mean + 14 * sd + 2)))
    x = np.arange(a, b + 1, dtype=np.float64)
    lgamma = np.vectorize(math.lgamma)
    logpmf = math.lgamma(n + 1) - lgamma(x + 1) - lgamma(n - x + 1) + x * math.log(p) + (n - x) * math.log1p(-p)
    return x, np.exp(logpmf)


def uniform_overflow(tokens: int, num_experts: int, k: int, capacity_factor: float) -> float:
    """Expected fraction of token-slots over capacity C = ceil(cf T k / E) (the same C as
    ``balance.drop_fraction``) under uniform routing: E E[(L - C)^+] / (T k), L ~ Binomial(T, k/E)."""
    cap = expert_capacity(capacity_factor, tokens, k, num_experts)
    x, pmf = _binomial_window(tokens, k / num_experts, hi=cap)
    over = float(np.sum(np.clip(x - cap, 0, None) * pmf))
    return num_experts * over / (tokens * k)


def uniform_padding(tokens: int, num_experts: int, k: int, multiple: int) -> float:
    """Expected share of padding rows when every expert's group is padded to a multiple of ``multiple``:
    E[ceil(L/m) m - L] / E[ceil(L/m) m] (empty experts take no rows)."""
    x, pmf = _binomial_window(tokens, k / num_experts)
    padded = np.ceil(x / multiple) * multiple
    return float(np.sum((padded - x) * pmf) / max(np.sum(padded * pmf), 1e-30))


def rank_sizes(num_experts: int, ranks: int) -> list[int]:
    """Experts per rank for a contiguous placement (sizes differ by at most one)."""
    base, extra = divmod(num_experts, ranks)
    return [base + (r < extra) for r in range(ranks)]


def distinct_ranks(num_experts: int, k: int, ranks: int) -> float:
    """Expected distinct ranks holding a uniform token's k experts (exact): sum_r 1 - C(E - n_r, k) / C(E, k)."""
    total = math.comb(num_experts, k)
    return sum(1 - math.comb(num_experts - n, k) / total for n in rank_sizes(num_experts, ranks))


def all_to_all(config: K3Config, ranks: int, act_bytes: int = 2) -> dict:
    """Bytes per token per MoE layer (dispatch + combine, deduplicated per rank, network share (R-1)/R) when the
    payload is the latent z (l wide) and when it is x (d wide)."""
    moe = config.moe
    d, latent = config.hidden_size, moe.latent_size or config.hidden_size
    ranks_hit = distinct_ranks(moe.num_experts, moe.num_experts_per_token, ranks)
    remote = ranks_hit * (ranks - 1) / ranks
    full = 2 * remote * d * act_bytes
    lat = 2 * remote * latent * act_bytes
    return {
        "ep": ranks,
        "experts_per_rank": moe.num_experts / ranks,
        "distinct_ranks": ranks_hit,
        "remote_ranks": remote,
        "bytes_x": full,
        "bytes_z": lat,
        "ratio_z_over_x": lat / full,
        "bytes_x_no_dedup": 2 * moe.num_experts_per_token * (ranks - 1) / ranks * d * act_bytes,
    }


# ---------------------------------------------------------------------------------------------- simulation
def zipf_logits(num_experts: int, s: float) -> torch.Tensor:
    return -s * torch.log(torch.arange(1, num_experts + 1, dtype=torch.float64)).float()


def simulate_routes(
    tokens: int, num_experts: int, k: int, s: float, gen: torch.Generator, chunk: int = 8192
) -> torch.Tensor:
    """[T, k] expert ids: top-k of log w + Gumbel (s = 0: uniform k-subsets)."""
    logw = zipf_logits(num_experts, s)
    out = []
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        u = torch.rand(n, num_experts, generator=gen).clamp_(1e-12, 1 - 1e-7)
        out.append(torch.topk(logw - torch.log(-torch.log(u)), k, dim=-1).indices)
    return torch.cat(out)


def rank_imbalance(loads: torch.Tensor, ranks: int, perm: torch.Tensor | None = None) -> float:
    """max / mean of token-expert pairs per rank (contiguous placement of ``perm``-relabelled experts)."""
    if perm is not None:
        loads = loads[perm]
    per_rank = torch.stack([part.sum() for part in torch.split(loads, rank_sizes(loads.numel(), ranks))]).double()
    return float(per_rank.max() / per_rank.mean())


def simulate(
    config: K3Config, zipf: tuple[float, ...], tokens: tuple[int, ...] = SIM_TOKENS, seed: int = 0
) -> list[dict]:
    """Per routing model and tokens-per-step: overflow at each capacity factor, padding, per-rank imbalance."""
    moe = config.moe
    e, k = moe.num_experts, moe.num_experts_per_token
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(e, generator=gen)
    rows = []
    for s in (0.0, *zipf):
        for t in tokens:
            loads = expert_loads(simulate_routes(t, e, k, s, gen), e)
            row = {
                "model": "uniform" if s == 0 else f"zipf s={s:g}",
                "s": s,
                "tokens": t,
                "max_load_over_mean": float(loads.max()) / (t * k / e),
            }
            for cf in CAPACITY_FACTORS:
                row[f"overflow_cf{cf:g}"] = float(drop_fraction(loads, k, t, cf))
            for m in PAD_MULTIPLES:
                padded = ((loads + m - 1) // m * m).sum()
                row[f"padding_{m}"] = float((padded - loads.sum()) / padded.clamp(min=1))
            for r in EP_SIZES:
                if r <= e:
                    row[f"imbalance_ep{r}"] = rank_imbalance(loads, r)
                    if s > 0:
                        row[f"imbalance_ep{r}_random_placement"] = rank_imbalance(loads, r, perm)
            rows.append(row)
    return rows


def router_frontier(config: K3Config, zipf: tuple[float, ...] = (0.5, 1.0), seed: int = 0) -> dict:
    """Everything section 5 reports (E, k from the config; < 10 s on 2 CPU cores for K3's 896 experts)."""
    moe = config.moe
    e, k = moe.num_experts, moe.num_experts_per_token
    exact = []
    for t in TOKENS_PER_STEP:
        row = {"tokens": t, "mean_load": t * k / e}
        for cf in CAPACITY_FACTORS:
            row[f"overflow_cf{cf:g}"] = uniform_overflow(t, e, k, cf)
        for m in PAD_MULTIPLES:
            row[f"padding_{m}"] = uniform_padding(t, e, k, m)
        exact.append(row)
    return {
        "num_experts": e,
        "k": k,
        "zipf": list(zipf),
        "seed": seed,
        "uniform_exact": exact,
        "all_to_all": [all_to_all(config, r) for r in EP_SIZES if r <= e],
        "simulated": simulate(config, zipf, seed=seed),
    }
