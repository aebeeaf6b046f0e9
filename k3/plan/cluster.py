"""What a placement runs on: GPUs, their memory and rates, and the fabric between them.

Every rate carries where it comes from: ``measured`` (a results file of ours, named) or ``assumed`` (a vendor
figure or a guess, said so). The planner prints the sources beside its numbers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


def check_positive_ints(obj, *names: str) -> None:
    """One ValueError, named as its command-line flag, for the first of ``names`` on ``obj`` that is not an int >= 1
    (a bool is not an int here)."""
    for name in names:
        v = getattr(obj, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"--{name.replace('_', '-')}={v!r} must be a positive integer")


@dataclass(frozen=True)
class Cluster:
    """``gpus`` GPUs in nodes of ``gpus_per_node``. Rates per GPU: HBM bandwidth (bytes/s a kernel streams), dense
    bf16 matmul rate (FLOP/s), the all-to-all bandwidth one GPU gets to peers in its node and to other nodes
    (bytes/s each way), and the latency of one all-to-all inside a node and across nodes (s)."""

    gpus: int
    gpus_per_node: int = 8
    hbm_gib: float = 139.8
    hbm_bytes_per_s: float = 4.21e12
    bf16_flops: float = 790e12
    intra_bytes_per_s: float = 450e9
    inter_bytes_per_s: float = 50e9
    intra_latency_s: float = 10e-6
    inter_latency_s: float = 25e-6
    sources: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        check_positive_ints(self, "gpus", "gpus_per_node")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(
                f"--gpus={self.gpus} must be a multiple of --gpus-per-node={self.gpus_per_node} (whole nodes)"
            )
        for name in ("hbm_gib", "hbm_bytes_per_s", "bf16_flops", "intra_bytes_per_s", "inter_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be positive")
        for name in ("intra_latency_s", "inter_latency_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 0")

    @property
    def per_node(self) -> int:
        """GPUs in one node (all of them when the cluster is smaller than a node)."""
        return min(self.gpus, self.gpus_per_node)

    @property
    def nodes(self) -> int:
        return self.gpus // self.per_node

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gib * 2**30

    def replace(self, **changes) -> "Cluster":
        return dataclasses.replace(self, **changes)


H200_SOURCES = {
    "hbm_gib": "measured: the memory torch reports on the H200 we run on (139.8 GiB of the 141 GB sold)",
    "hbm_bytes_per_s": "measured: device-to-device copy bandwidth, 4.21 TB/s (benchmarks/results/decode-targets.json)",
    "bf16_flops": "measured: dense bf16 matmul rate on one H200, 790 TFLOP/s (k3.bench.model.PEAK)",
    "intra_bytes_per_s": "assumed: NVLink 4, 450 GB/s each way per GPU (vendor figure)",
    "inter_bytes_per_s": "assumed: one 400 Gb/s NIC per GPU, 50 GB/s each way (vendor figure)",
    "intra_latency_s": "assumed: 10 us per all-to-all inside a node",
    "inter_latency_s": "assumed: 25 us per all-to-all across nodes",
}

PROFILES = {
    "h200-8x-nvlink": dict(gpus=8, gpus_per_node=8),
    "h200-64x-ib": dict(gpus=64, gpus_per_node=8),
    "h200-128x-ib": dict(gpus=128, gpus_per_node=8),
}


def cluster(profile: str | None = None, **overrides) -> Cluster:
    """A cluster of H200 nodes: a named profile (:data:`PROFILES`) with ``overrides`` (None values ignored)."""
    base: dict = {}
    if profile is not None:
        if profile not in PROFILES:
            raise ValueError(f"unknown cluster profile {profile!r}; choose from {', '.join(PROFILES)}")
        base = dict(PROFILES[profile])
    base.update({k: v for k, v in overrides.items() if v is not None})
    if "gpus" not in base:
        raise ValueError("give --gpus N or a --profile")
    sources = {k: ("given" if k in overrides and overrides[k] is not None else v) for k, v in H200_SOURCES.items()}
    return Cluster(**base, sources=sources)
