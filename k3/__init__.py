"""k3: an open PyTorch implementation of the Kimi K3 architecture (train, serve, audit)."""

__version__ = "0.1.0"


def from_pretrained(directory, dtype=None, device="cpu", verify=True, packed="dequantize"):
    """Load a checkpoint directory as ``K3ForCausalLM`` (see :func:`k3.convert.checkpoint.from_pretrained`)."""
    import torch

    from k3.convert.checkpoint import from_pretrained as _load

    return _load(directory, dtype=dtype or torch.float32, device=device, verify=verify, packed=packed)
