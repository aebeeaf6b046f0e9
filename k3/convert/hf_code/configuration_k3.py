"""transformers' config class for a K3 checkpoint (``model_type: kimi_k3``), copied into the checkpoint.

It keeps config.json's keys as they are; k3.config.hf reads them into k3's own config (one ValueError for a
config k3 cannot run).
"""

from transformers import PretrainedConfig


class KimiK3Config(PretrainedConfig):
    """config.json of a K3 text model (or of the multimodal ``kimi_k3`` wrapper), every key an attribute."""

    model_type = "kimi_k3"
