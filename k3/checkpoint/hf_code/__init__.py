"""The transformers code a K3 checkpoint carries (``configuration_k3.py``, ``modeling_k3.py``).

``save_pretrained`` copies these files into every checkpoint whose config.json says ``model_type: kimi_k3`` (the
multimodal release wrapper too) and points its ``auto_map`` at them, so
``transformers.AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` runs k3's model. They import k3,
which must be installed where the checkpoint is used.
"""

from pathlib import Path

FILES = ("configuration_k3.py", "modeling_k3.py")
AUTO_MAP = {
    "AutoConfig": "configuration_k3.KimiK3Config",
    "AutoModelForCausalLM": "modeling_k3.KimiK3ForCausalLM",
}


def source(name: str) -> Path:
    """The path of one of ``FILES`` in this package."""
    return Path(__file__).with_name(name)
