"""Which GPU holds which routed experts of a MoE layer: replication of hot experts and load-balanced placement.

Inputs per layer: the experts' shares f [E] of the token-slots (k3.plan.loads), G GPUs in nodes, and ``slots``
expert places per GPU (G slots >= E). Steps:
1. Replica counts: every expert once; each spare slot goes to the expert whose per-replica share f_j / r_j is then
   the largest (a token of a replicated expert goes to one of its replicas, so each carries f_j / r_j).
2. Nodes, then GPUs (hierarchical, as DeepSeek's EPLB): replicas, heaviest first, go to the least-loaded node with a
   free place, a node without that expert first (a token then finds a replica in more nodes); inside each node,
   to the least-loaded GPU with a free place that does not hold the expert (largest-first list scheduling).
3. Local search over the whole cluster: move or swap single replicas between the most-loaded GPU and any other
   while that lowers the maximum, until no move does.
A GPU's load is the sum of its replicas' shares; the figure of merit is max / mean over GPUs (1 = balanced).
Unlike EPLB, every layer is placed from its own loads, and the plan prices the latent-width all-to-all.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

import numpy as np


@dataclass
class LayerPlacement:
    """gpu_experts[g]: the experts GPU g holds (one replica each); replicas[j]: how many GPUs hold expert j;
    gpu_load[g]: GPU g's share of the layer's token-slots (each replica carries f_j / replicas[j])."""

    gpu_experts: list[list[int]]
    replicas: list[int]
    gpu_load: list[float]

    @property
    def max_over_mean(self) -> float:
        mean = sum(self.gpu_load) / len(self.gpu_load)
        return max(self.gpu_load) / mean if mean > 0 else 1.0


def _check(num_experts: int, gpus: int, slots: int) -> None:
    if gpus * slots < num_experts:
        raise ValueError(f"{gpus} GPUs x {slots} expert slots hold {gpus * slots} experts, fewer than {num_experts}")


def min_slots(num_experts: int, gpus: int) -> int:
    """The fewest expert places per GPU that hold every expert once."""
    return -(-num_experts // gpus)


def contiguous(shares: np.ndarray, gpus: int) -> LayerPlacement:
    """Plain expert parallelism, the baseline: expert j on GPU j // ceil(E / G), no replicas."""
    e = len(shares)
    per = min_slots(e, gpus)
    experts = [list(range(g * per, min(e, (g + 1) * per))) for g in range(gpus)]
    return LayerPlacement(experts, [1] * e, [float(shares[x].sum()) if x else 0.0 for x in experts])


def replica_counts(shares: np.ndarray, total_slots: int, max_replicas: int) -> list[int]:
    """r_j >= 1 with sum r = min(total_slots, E max_replicas), spares going one at a time to the largest f_j / r_j
    (this minimises max_j f_j / r_j: greedy is optimal for it)."""
    e = len(shares)
    r = [1] * e
    heap = [(-float(f), j) for j, f in enumerate(shares)]
    heapq.heapify(heap)
    for _ in range(min(total_slots, e * max_replicas) - e):
        while True:
            _, j = heapq.heappop(heap)
            if r[j] < max_replicas:
                break
        r[j] += 1
        if r[j] < max_replicas:
            heapq.heappush(heap, (-float(shares[j]) / r[j], j))
    return r


def place(
    shares, gpus: int, gpus_per_node: int, slots: int, replicate: bool = True, search_steps: int | None = None
) -> LayerPlacement:
    """Place one layer's experts (see the module docstring). ``replicate=False`` fills spare slots with nothing.

    With replication, the replica counts that minimise the largest per-replica share need not pack best (a hot
    expert's third replica may leave no room to pair the others well): when the result is not balanced to 1%,
    budgets of fewer spare replicas (3/4, 1/2, 1/4 and none of them) are tried too and the best kept."""
    shares = np.asarray(shares, dtype=np.float64)
    e = len(shares)
    _check(e, gpus, slots)
    steps = search_steps if search_steps is not None else 4 * gpus
    if not replicate:
        return _place(shares, [1] * e, gpus, gpus_per_node, slots, steps)
    spare = gpus * slots - e
    best = _place(shares, replica_counts(shares, gpus * slots, gpus), gpus, gpus_per_node, slots, steps)
    if best.max_over_mean > 1.01:
        for budget in sorted({spare * 3 // 4, spare // 2, spare // 4, 0}, reverse=True):
            p = _place(shares, replica_counts(shares, e + budget, gpus), gpus, gpus_per_node, slots, steps)
            if max(p.gpu_load) < max(best.gpu_load) - 1e-12:
                best = p
    return best


def _place(shares: np.ndarray, r: list[int], gpus: int, gpus_per_node: int, slots: int, steps: int) -> LayerPlacement:
    """Steps 2 and 3 of the module docstring for replica counts ``r``."""
    e = len(shares)
    per_node = min(gpus, gpus_per_node)
    nodes = gpus // per_node
    items = sorted(((shares[j] / r[j], j) for j in range(e) for _ in range(r[j])), reverse=True)
    node_load, node_free = [0.0] * nodes, [per_node * slots] * nodes
    node_count: list[dict[int, int]] = [{} for _ in range(nodes)]  # replicas of each expert in the node
    node_items: list[list[tuple[float, int]]] = [[] for _ in range(nodes)]
    for load, j in items:
        free = [n for n in range(nodes) if node_free[n] and node_count[n].get(j, 0) < per_node]
        n = min(free, key=lambda n: (node_count[n].get(j, 0), node_load[n]))
        node_items[n].append((load, j))
        node_load[n] += load
        node_free[n] -= 1
        node_count[n][j] = node_count[n].get(j, 0) + 1
    experts: list[list[int]] = [[] for _ in range(gpus)]
    load = [0.0] * gpus
    for n in range(nodes):
        members = range(n * per_node, (n + 1) * per_node)
        for item_load, j in node_items[n]:  # already heaviest first
            g = min((g for g in members if len(experts[g]) < slots and j not in experts[g]), key=lambda g: load[g])
            experts[g].append(j)
            load[g] += item_load
    return _improve(LayerPlacement(experts, list(r), load), shares, slots, steps)


def _improve(p: LayerPlacement, shares: np.ndarray, slots: int, steps: int) -> LayerPlacement:
    """Local search: the best single move or swap involving the most-loaded GPU, while it lowers the maximum."""
    g_count = len(p.gpu_experts)
    ids = np.full((g_count, slots), -1, dtype=np.int64)
    for g, xs in enumerate(p.gpu_experts):
        ids[g, : len(xs)] = xs
    per_replica = shares / np.asarray(p.replicas, dtype=np.float64)
    for _ in range(steps):
        w = np.where(ids >= 0, per_replica[np.maximum(ids, 0)], 0.0)  # [G, S]
        load = w.sum(1)
        m = int(load.argmax())
        if load[m] <= load.mean() * (1 + 1e-4):  # balanced to 0.01%: nothing worth moving
            break
        a, ea = w[m][:, None, None], ids[m][:, None, None]  # [S, 1, 1]: what leaves m
        b, eb = w[None], ids[None]  # [1, G, S]: what comes back (an empty slot: a move)
        holds = (ids[:, :, None] == ids[m][None, None, :]).any(1)  # [G, S_m]: GPU h already holds m's item
        new_m = load[m] - a + b
        new_h = load[None, :, None] - b + a
        ok = (ea >= 0) & ~holds.T[:, :, None] & (b >= 0)  # m's replica is real, h does not hold its expert
        ok = ok & ((eb < 0) | ~np.isin(eb, ids[m][ids[m] >= 0]))  # what comes back is not on m already
        ok &= np.arange(g_count)[None, :, None] != m
        order = np.argsort(load)[::-1]  # the loads of every GPU but m and h: the 2nd largest, or the 3rd for h
        rest = np.zeros(g_count)
        if g_count > 2:
            rest[:] = load[order[1]]
            rest[order[1]] = load[order[2]]
        worst = np.maximum(np.maximum(new_m, new_h), rest[None, :, None])
        worst = np.where(ok, worst, np.inf)
        i, h, s = np.unravel_index(int(worst.argmin()), worst.shape)
        if not worst[i, h, s] < load[m] - 1e-12:
            break
        ids[m, i], ids[h, s] = ids[h, s], ids[m, i]
    experts = [[int(x) for x in row if x >= 0] for row in ids]
    return LayerPlacement(experts, p.replicas, [float(per_replica[xs].sum()) for xs in experts])


def brute_force(shares, gpus: int, slots: int, replicate: bool = True) -> float:
    """The smallest max GPU load over every replica count vector (each expert once up to every slot used; once
    each without ``replicate``) and every assignment (tiny cases only: tests)."""
    shares = np.asarray(shares, dtype=np.float64)
    e = len(shares)
    _check(e, gpus, slots)
    best = np.inf
    for r in itertools.product(range(1, (gpus if replicate else 1) + 1), repeat=e):
        if sum(r) > gpus * slots:
            continue
        items = [j for j in range(e) for _ in range(r[j])]
        for assign in itertools.product(range(gpus), repeat=len(items)):
            counts = np.bincount(assign, minlength=gpus)
            if (counts > slots).any():
                continue
            pairs = set(zip(assign, items))
            if len(pairs) < len(items):  # two replicas of one expert on one GPU
                continue
            load = np.zeros(gpus)
            for g, j in zip(assign, items):
                load[g] += shares[j] / r[j]
            best = min(best, load.max())
    return float(best)
