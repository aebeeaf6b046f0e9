"""Image processor for the MoonViT-V2 tower: images -> packed patches + per-image patch grids.

For each image (a path, encoded bytes, or a ``PIL.Image.Image``):

1. Load. Encoded inputs are checked before any pixel is decoded: an empty file or byte string, one larger than
   ``max_bytes``, data Pillow cannot identify, and a header whose width or height exceeds ``max_side`` or whose
   width x height exceeds ``max_decoded_pixels`` (decompression-bomb guards: a few KB of PNG can declare
   13000 x 13000 pixels, half a GB once decoded to RGB; Pillow's own ``DecompressionBombError`` is reported the
   same way) all raise one ``ValueError`` naming the image. So does a decoding failure (truncated data) and a
   zero-sized image. The EXIF orientation is applied, animations contribute their first frame, transparency is
   composited over white, and the result is converted to RGB.
2. Size. Large images within those limits are *resized, not rejected*: only when width x height exceeds
   ``max_pixels`` (default 3584 x 3584, the largest input of docs/architecture.md#vision) are both sides scaled by
   sqrt(max_pixels / (width x height)), keeping the aspect ratio. Then each side is rounded to the nearest
   multiple of ``unit = patch_size x merge_size`` (28), at least one unit, so the patch grid splits into whole 2x2
   merge windows; if rounding up pushed the area over the budget, both sides are rounded down instead. The image
   is resampled (bicubic, which Pillow antialiases when shrinking) only if this changes its size.
3. Normalise: x / 255, then (x - mean) / std with mean = std = 0.5 per channel, i.e. values in [-1, 1].
4. Patchify: [3, H, W] -> [(H / p) * (W / p), 3 * p * p], patches in row-major order over the (H / p, W / p)
   grid, each flattened channel-major (c, y, x): the layout ``k3.model.vision.VisionTower`` expects.

``process(images)`` concatenates the patches of all images into one packed sequence and returns the grids
[num_images, 2] = (H / p, W / p) per image alongside.
"""

from __future__ import annotations

import io
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torch import Tensor

from k3.config import VisionConfig

ImageInput = Union[str, os.PathLike, bytes, bytearray, memoryview, Image.Image]
_SINGLE = (str, os.PathLike, bytes, bytearray, memoryview, Image.Image)


def _describe(image: ImageInput) -> str:
    if isinstance(image, (str, os.PathLike)):
        return f"image file {os.fspath(image)!r}"
    if isinstance(image, (bytes, bytearray, memoryview)):
        return f"image bytes ({_nbytes(image)} bytes)"
    return "PIL image"


def _nbytes(data: bytes | bytearray | memoryview) -> int:
    return data.nbytes if isinstance(data, memoryview) else len(data)


@dataclass
class ImageProcessor:
    """Turns images into MoonViT patches. Defaults follow docs/architecture.md#vision (patch 14, merge 2, inputs up to
    3584^2)."""

    patch_size: int = 14
    merge_size: int = 2
    max_pixels: int = 3584 * 3584  # resize budget (width x height after resizing)
    max_side: int = 16384  # hard limit on the decoded width / height: larger is refused, not resized
    max_decoded_pixels: int = 8192 * 8192  # hard limit on width x height, checked from the header before decoding
    max_bytes: int = 128 * 2**20  # hard limit on an encoded file / byte string
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def __post_init__(self) -> None:
        for name in ("patch_size", "merge_size", "max_pixels", "max_side", "max_decoded_pixels", "max_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.max_pixels < self.unit**2:
            raise ValueError(f"max_pixels={self.max_pixels} must be >= (patch_size * merge_size)^2 = {self.unit**2}")
        if self.max_side < self.unit:
            raise ValueError(f"max_side={self.max_side} must be >= patch_size * merge_size = {self.unit}")
        for name in ("mean", "std"):
            value = tuple(getattr(self, name))
            if len(value) != 3 or not all(math.isfinite(x) for x in value):
                raise ValueError(f"{name}={value!r} must be three finite numbers (R, G, B)")
            setattr(self, name, value)
        if min(self.std) <= 0:
            raise ValueError(f"std={self.std!r} must be positive")

    @classmethod
    def from_config(cls, vision: VisionConfig, **overrides) -> "ImageProcessor":
        """A processor matching a tower's patch and merge sizes (other fields from ``overrides``)."""
        return cls(patch_size=vision.patch_size, merge_size=vision.merge_size, **overrides)

    @property
    def unit(self) -> int:
        """Side granularity in pixels: one merge window of patches (28 for patch 14, merge 2)."""
        return self.patch_size * self.merge_size

    # ------------------------------------------------------------------ loading
    def load(self, image: ImageInput) -> Image.Image:
        """Decode and check one image (see the module docstring, step 1) -> an RGB ``PIL.Image.Image``."""
        what = _describe(image)
        if isinstance(image, Image.Image):
            return self._decode(image, what)
        if not isinstance(image, (str, os.PathLike, bytes, bytearray, memoryview)):
            raise TypeError(f"an image must be a path, bytes or a PIL.Image.Image, got {type(image).__name__}")
        with self._open(image, what) as img:  # closes the file once the RGB copy exists
            return self._decode(img, what)

    def _decode(self, img: Image.Image, what: str) -> Image.Image:
        """Size checks, decode (first frame), EXIF orientation, RGB -> a new image (``img`` is left as is)."""
        self._check_size(img.width, img.height, what)
        try:
            if getattr(img, "n_frames", 1) > 1:
                img.seek(0)
            img.load()
            rgb = self._to_rgb(ImageOps.exif_transpose(img))
        except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as e:
            raise ValueError(f"cannot decode {what}: {e}") from None
        return rgb.copy() if rgb is img else rgb

    def _open(self, image: str | os.PathLike | bytes | bytearray | memoryview, what: str) -> Image.Image:
        if isinstance(image, (str, os.PathLike)):
            try:
                size = os.path.getsize(image)
            except OSError as e:
                raise ValueError(f"cannot read {what}: {e.strerror or e}") from None
            source = image
        else:
            size, source = _nbytes(image), io.BytesIO(bytes(image))
        if size == 0:
            raise ValueError(f"{what} is empty (0 bytes)")
        if size > self.max_bytes:
            raise ValueError(f"{what} is {size} bytes, over max_bytes={self.max_bytes}")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our max_side decides
                return Image.open(source)  # lazy: reads the header only
        except UnidentifiedImageError:
            raise ValueError(f"cannot decode {what}: not an image format Pillow recognises") from None
        except Image.DecompressionBombError as e:
            raise ValueError(f"refusing {what}: {e}") from None
        except OSError as e:
            raise ValueError(f"cannot read {what}: {e.strerror or e}") from None

    def _check_size(self, width: int, height: int, what: str) -> None:
        if width <= 0 or height <= 0:
            raise ValueError(f"{what} has zero size ({width} x {height})")
        if max(width, height) > self.max_side:
            raise ValueError(
                f"{what} is {width} x {height}, a side over max_side={self.max_side} "
                "(refused as a possible decompression bomb)"
            )
        if width * height > self.max_decoded_pixels:
            raise ValueError(
                f"{what} is {width} x {height} = {width * height} pixels, over max_decoded_pixels="
                f"{self.max_decoded_pixels} (refused before decoding; send a smaller image)"
            )

    @staticmethod
    def _to_rgb(img: Image.Image) -> Image.Image:
        """RGB copy; transparent pixels are composited over white rather than keeping their hidden colour."""
        if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
            rgba = img.convert("RGBA")
            img = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
        return img if img.mode == "RGB" else img.convert("RGB")

    # ------------------------------------------------------------------ sizing
    def target_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) after the budget resize and rounding to multiples of ``unit`` (step 2)."""
        if width <= 0 or height <= 0:
            raise ValueError(f"image size must be positive, got {width} x {height}")
        scale = min(1.0, math.sqrt(self.max_pixels / (width * height)))
        w, h = width * scale, height * scale
        u = self.unit
        nw, nh = max(u, round(w / u) * u), max(u, round(h / u) * u)
        if nw * nh > self.max_pixels:
            nw, nh = max(u, math.floor(w / u) * u), max(u, math.floor(h / u) * u)
        return nw, nh

    def resize(self, img: Image.Image) -> Image.Image:
        """The image at :meth:`target_size` (bicubic), or itself when the size is already right."""
        size = self.target_size(img.width, img.height)
        return img if size == img.size else img.resize(size, Image.Resampling.BICUBIC)

    # ------------------------------------------------------------------ tensors
    def to_patches(self, img: Image.Image, dtype: torch.dtype = torch.float32) -> tuple[Tensor, tuple[int, int]]:
        """A sized RGB image (sides multiples of ``unit``) -> (patches [gh * gw, 3 * p * p], (gh, gw))."""
        w, h = img.size
        p = self.patch_size
        if img.mode != "RGB" or w % self.unit or h % self.unit:
            raise ValueError(
                f"to_patches needs an RGB image with sides multiple of {self.unit}, got {img.mode} "
                f"{w} x {h} (use resize() first)"
            )
        x = torch.from_numpy(np.array(img, dtype=np.uint8)).to(torch.float32).div_(255.0)  # [H, W, 3]
        mean, std = torch.tensor(self.mean), torch.tensor(self.std)
        x = ((x - mean) / std).permute(2, 0, 1)  # [3, H, W]
        gh, gw = h // p, w // p
        patches = x.reshape(3, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh * gw, 3 * p * p)
        return patches.to(dtype).contiguous(), (gh, gw)

    def preprocess(self, image: ImageInput, dtype: torch.dtype = torch.float32) -> tuple[Tensor, tuple[int, int]]:
        """One image, all four steps -> (patches [gh * gw, 3 * p * p], (gh, gw))."""
        return self.to_patches(self.resize(self.load(image)), dtype)

    def process(
        self, images: ImageInput | Sequence[ImageInput], dtype: torch.dtype = torch.float32
    ) -> tuple[Tensor, Tensor]:
        """Images -> (pixel_patches [sum gh * gw, 3 * p * p] packed image after image, grid_hws [num_images, 2]
        int64 patch grids (gh, gw), both even). A single image may be passed without a list."""
        if isinstance(images, _SINGLE):
            images = [images]
        images = list(images)
        if not images:
            raise ValueError("process() needs at least one image")
        patches, grids = [], []
        for i, image in enumerate(images):
            try:
                x, grid = self.preprocess(image, dtype)
            except ValueError as e:
                raise ValueError(f"image {i}: {e}") from None
            patches.append(x)
            grids.append(grid)
        return torch.cat(patches), torch.tensor(grids, dtype=torch.int64)
