"""Multi-process training on torch.distributed, applied to a built single-device model (the model code never
imports this package): a DeviceMesh over data, expert and context parallelism (mesh.py), FSDP2 for the dense
parameters, expert parallelism with a latent all-to-all, KDA / MLA context parallelism, distributed QB and
per-head Muon, torch.distributed.checkpoint with resharding. Works with gloo on CPUs and nccl on GPUs."""
