"""Vision inputs: the image processor (images -> packed patches + grids) and media-token expansion.
The tower itself is :class:`k3.model.vision.VisionTower`."""

from k3.vision.media import expand_placeholders, merged_tokens
from k3.vision.processor import ImageProcessor

__all__ = ["ImageProcessor", "expand_placeholders", "merged_tokens"]
