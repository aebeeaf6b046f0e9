"""transformers' model class for a K3 checkpoint, copied into the checkpoint: it runs k3's own model.

``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` lands in
:meth:`KimiK3ForCausalLM.from_pretrained`, which loads the weights with k3's loader (its tensor names,
checksums, packed experts) rather than transformers'. ``forward`` takes ``input_ids`` and an optional
``attention_mask`` (left or right padding: the real tokens of each row are packed into one sequence each) and
returns the logits. ``generate`` works and recomputes the whole prefix at each step (no cache: correct in every
decoding mode, not fast; serve with ``k3 serve`` for speed). A multimodal checkpoint (either layout) runs as
K3ForConditionalGeneration on text alone: transformers passes no images here (k3 generate / k3 serve take them).
"""

import os

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

import k3
from k3.config.hf import from_hf_config
from k3.model.decoder import K3ForCausalLM
from k3.model.multimodal import K3ForConditionalGeneration

from .configuration_k3 import KimiK3Config

_HUB_KWARGS = (  # what AutoModel passes along for files on the Hub; a local directory needs none of it
    "cache_dir",
    "force_download",
    "local_files_only",
    "proxies",
    "token",
    "revision",
    "subfolder",
    "_from_auto",
    "trust_remote_code",
    "adapter_kwargs",
    "code_revision",
)


def _refuse(where: str, kwargs: dict, ignored: tuple[str, ...] = ()) -> None:
    """One ValueError naming the arguments k3's model does not take (None / False count as not given)."""
    bad = sorted(k for k, v in kwargs.items() if k not in ignored and v is not None and v is not False)
    if bad:
        raise ValueError(f"{where}: not supported by the K3 model: {', '.join(bad)}")


def _dtype(value):
    """None / "auto": the checkpoint's own dtype; else a torch dtype or its name."""
    if value is None or value == "auto":
        return None
    if isinstance(value, str):
        value = getattr(torch, value, None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"dtype={value!r} must be a floating torch dtype or 'auto'")
    return value


class KimiK3ForCausalLM(PreTrainedModel, GenerationMixin):
    """k3's K3ForCausalLM (K3ForConditionalGeneration for a checkpoint with a vision tower) as ``k3_model``."""

    config_class = KimiK3Config
    base_model_prefix = "k3_model"
    main_input_name = "input_ids"

    def __init__(self, config: KimiK3Config, k3_model: K3ForCausalLM | None = None):
        super().__init__(config)
        if k3_model is None:  # from a config alone (AutoModelForCausalLM.from_config): k3's initialisation
            cfg = from_hf_config(config.to_dict())
            k3_model = (K3ForConditionalGeneration if cfg.vision is not None else K3ForCausalLM)(cfg)
        self.k3_model = k3_model
        self.post_init()
        if self.generation_config is not None:
            self.generation_config.use_cache = False  # no transformers cache: each step sees the whole prefix

    def _init_weights(self, module):
        """Nothing: the weights are k3's (its initialisation, or a checkpoint's), not transformers' to reset."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, **kwargs):
        """Load a local checkpoint directory with k3's loader. ``dtype`` (or ``torch_dtype``): None / "auto"
        keeps the checkpoint's; ``device_map``: one device ("cpu", "cuda:0"; "auto" picks cuda when there is
        one) or k3's map of module prefix -> device. Returns the model in eval mode."""
        if model_args:
            raise ValueError("KimiK3ForCausalLM.from_pretrained takes no positional model arguments")
        path = str(pretrained_model_name_or_path)
        if kwargs.get("subfolder"):
            path = os.path.join(path, kwargs["subfolder"])
        if not os.path.isdir(path):
            raise ValueError(f"{path} is not a local directory: download the checkpoint and pass its directory")
        dtype, torch_dtype = kwargs.pop("dtype", None), kwargs.pop("torch_dtype", None)
        dtype = _dtype(dtype if dtype is not None else torch_dtype)
        device = kwargs.pop("device_map", None) or "cpu"
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        _refuse("from_pretrained", kwargs, _HUB_KWARGS)
        if config is None:
            config = cls.config_class.from_pretrained(path)
        return cls(config, k3.from_pretrained(path, dtype=dtype, device=device, packed="dequantize")).eval()

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Refused: k3.save_pretrained(model.k3_model, directory) writes a K3 checkpoint (it replaces the
        directory as a whole, atomically); transformers' writer would not use K3's tensor names."""
        raise ValueError(
            "write a K3 checkpoint with k3.save_pretrained(model.k3_model, directory) (it replaces the directory)"
        )

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        """The whole sequence so far at every step (there is no cache to extend)."""
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def forward(self, input_ids, attention_mask=None, return_dict=None, **kwargs):
        """input_ids [B, T], attention_mask [B, T] (1 = token; each row's tokens contiguous) -> logits [B, T, V]
        (zero at padding)."""
        _refuse("forward", kwargs, ("use_cache",))
        if attention_mask is None or bool(attention_mask.all()):
            logits = self.k3_model(input_ids).logits
        else:
            logits = self._padded_logits(input_ids, attention_mask.bool())
        return CausalLMOutput(logits=logits) if return_dict is not False else (logits,)

    def _padded_logits(self, input_ids, mask):
        """Each row's tokens packed as one sequence (cu_seqlens), run once, scattered back into [B, T, V]."""
        b, t = mask.shape
        pos = torch.arange(t, device=mask.device).expand(b, t)
        lens = mask.sum(1)
        first = torch.where(mask, pos, t).amin(1)
        last = torch.where(mask, pos, -1).amax(1)
        if bool((lens == 0).any()) or bool((last - first + 1 != lens).any()):
            raise ValueError("attention_mask: every row needs one contiguous run of tokens (left or right padding)")
        cu = torch.zeros(b + 1, dtype=torch.int64)
        cu[1:] = lens.cpu().cumsum(0)
        packed = self.k3_model(input_ids[mask][None], cu_seqlens=cu).logits[0]
        out = packed.new_zeros(b, t, packed.shape[-1])
        out[mask] = packed
        return out
