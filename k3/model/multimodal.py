"""The multimodal K3: the text model plus a MoonViT-V2 ``vision_tower`` (docs/architecture.md#vision).

Text and images interleave in one sequence. A prompt holds, for image i, ``n_i = (h_i / 2)(w_i / 2)`` media
placeholder tokens (k3.vision.media.expand_placeholders, optionally wrapped in media begin / end tokens); the
tower encodes all images of a call as one packed sequence (per-image attention), and its n_i output rows
replace the placeholders' embeddings in order. Everything after the embedding is the text model unchanged:
packing, caches, chunked prefill. For generation the image is encoded once, before its prompt is prefilled;
its tokens then live in the cache like text (KDA state, MLA latents).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from k3.config import K3Config
from k3.model.decoder import K3ForCausalLM, K3Output
from k3.model.vision import VisionTower


class K3ForConditionalGeneration(K3ForCausalLM):
    """``model(input_ids [B, T], pixel_patches [N, 3*p*p] = None, grid_hws [I, 2] = None, **text kwargs)``."""

    def __init__(self, config: K3Config):
        if config.vision is None:
            raise ValueError(
                f"config {config.name!r} has no vision section: use K3ForCausalLM, or add one "
                "(k3.config.presets.with_vision)"
            )
        super().__init__(config)
        self.vision_tower = VisionTower(config)

    def encode_images(self, pixel_patches: Tensor, grid_hws: Tensor | Sequence[Sequence[int]]) -> Tensor:
        """Packed image patches (k3.vision.processor) -> [sum_i n_i, hidden_size] LM-width image tokens."""
        return self.vision_tower(pixel_patches, grid_hws)

    def forward(
        self,
        input_ids: Tensor,
        *args,
        pixel_patches: Tensor | None = None,
        grid_hws: Tensor | Sequence[Sequence[int]] | None = None,
        **kwargs,
    ) -> K3Output:
        """As :meth:`K3ForCausalLM.forward` (same positional arguments); images given as patches (keywords) are
        encoded here, or pass ``image_features`` already encoded, as the engine does during chunked prefill."""
        if pixel_patches is not None:
            if kwargs.get("image_features") is not None:
                raise ValueError("pass pixel_patches or image_features, not both")
            if grid_hws is None:
                raise ValueError("pixel_patches need grid_hws")
            kwargs["image_features"] = self.encode_images(pixel_patches, grid_hws)
        return super().forward(input_ids, *args, **kwargs)
