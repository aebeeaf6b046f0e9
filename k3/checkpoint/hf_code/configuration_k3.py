"""transformers' config classes for a K3 checkpoint (``model_type: kimi_k3``), copied into the checkpoint.

They keep config.json's keys as they are; k3.config.hf reads them into k3's own config (one ValueError for a
config k3 cannot run). The multimodal release wrapper's ``text_config`` becomes a :class:`KimiK3TextConfig`, the
sub-config transformers looks the text model's settings up in (``get_text_config``: generation reads its token
ids there); ``to_dict`` gives it back as a dict (transformers' defaults added), which k3.config.hf reads alike.
"""

from transformers import PretrainedConfig


class KimiK3TextConfig(PretrainedConfig):
    """The ``text_config`` of the multimodal ``kimi_k3`` wrapper (the release names it ``kimi_linear``)."""

    model_type = "kimi_linear"


class KimiK3Config(PretrainedConfig):
    """config.json of a K3 text model (or of the multimodal ``kimi_k3`` wrapper), every key an attribute."""

    model_type = "kimi_k3"

    def __init__(self, text_config=None, **kwargs):
        if isinstance(text_config, dict):
            text_config = KimiK3TextConfig(**text_config)
        if text_config is not None:
            kwargs["text_config"] = text_config
        super().__init__(**kwargs)
