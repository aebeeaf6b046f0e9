from k3.config.config import (
    ATTN_RES_MODES,
    AttnResConfig,
    K3Config,
    KDAConfig,
    MLAConfig,
    MoEConfig,
    VisionConfig,
)
from k3.config.presets import PRESETS, get_preset

__all__ = [
    "ATTN_RES_MODES",
    "AttnResConfig",
    "K3Config",
    "KDAConfig",
    "MLAConfig",
    "MoEConfig",
    "VisionConfig",
    "PRESETS",
    "get_preset",
]
