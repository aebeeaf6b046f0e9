"""Checkpoints on disk (docs/architecture.md#checkpoints): what is written, how it is read back and verified.

- ``format``: the HF layout (config.json, safetensors shards and their index, ``k3_checksums.json``), saving,
  verifying, reading config.json, resolving a run directory to its latest checkpoint;
- ``load`` and ``stream``: ``from_pretrained``, the streamed loader, and its parallel, hashed shard reader;
- ``names``: tensor names between our state dict and the files (K3 release, Kimi-Linear, transformers);
- ``hf_code``: the transformers code a K3 checkpoint carries;
- ``adapters``: LoRA adapter checkpoints, apart from their base model;
- ``dcp``: a multi-process run's sharded torch.distributed.checkpoint;
- ``run``: a training run's step directories, ``latest`` pointer, trainer state and run lock.

Writes go through k3.fs (atomic directories and files); ``k3 convert`` (k3.convert) is built on this package.
"""
