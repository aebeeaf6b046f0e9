"""k3: an open PyTorch implementation of the Kimi K3 architecture (train, serve, audit)."""

__version__ = "0.1.0"
