"""k3: an open PyTorch implementation of the Kimi K3 architecture (train, serve, audit)."""

import os

__version__ = "0.1.0"

# Triton keeps autotuning results in its disk cache only when asked, and reads the setting when a kernel module is
# imported. Set here, before any k3 kernel is, so that every entry point (the CLI, scripts, library use) shares one
# cache: without it each process re-runs the prefill and decode kernels' autotuners, minutes at start on a GPU.
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")


def from_pretrained(directory, dtype=None, device="cpu", verify=True, packed="auto"):
    """Load a checkpoint directory as ``K3ForCausalLM``, streamed, in its own dtype unless ``dtype`` is given;
    packed MXFP4 experts stay packed (inference) unless ``packed="dequantize"`` (to train; see
    :func:`k3.checkpoint.load.from_pretrained`)."""
    from k3.checkpoint.load import from_pretrained as _load

    return _load(directory, dtype=dtype, device=device, verify=verify, packed=packed)


def save_pretrained(model, directory, **kwargs):
    """Atomically write ``model`` as a checkpoint directory (see :func:`k3.checkpoint.format.save_pretrained`:
    ``fmt``, ``max_shard_bytes``, ``quantize="mxfp4"``, ``scale_mode``)."""
    from k3.checkpoint.format import save_pretrained as _save

    return _save(model, directory, **kwargs)
