"""Image processor (loading, errors, sizing, patch layout) and media-placeholder expansion, end to end."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from k3.config import get_preset
from k3.config.presets import with_vision
from k3.model.vision import VisionTower
from k3.vision import ImageProcessor, expand_placeholders, merged_tokens


def png_bytes(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def noise_image(w: int, h: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}[mode]
    return Image.fromarray(rng.integers(0, 256, (h, w, channels), dtype=np.uint8), mode)


@pytest.fixture(scope="module")
def proc():
    return ImageProcessor()


# ---------------------------------------------------------------------- errors
def test_unreadable_inputs_raise_clear_value_errors(proc, tmp_path):
    with pytest.raises(ValueError, match="not an image format"):
        proc.load(b"definitely not an image" * 10)
    with pytest.raises(ValueError, match=r"empty \(0 bytes\)"):
        proc.load(b"")
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"image file .*empty\.png.* is empty"):
        proc.load(empty)
    with pytest.raises(ValueError, match="cannot read image file .*missing"):
        proc.load(tmp_path / "missing.png")
    with pytest.raises(ValueError, match="zero size"):
        proc.load(Image.new("RGB", (0, 10)))
    data = png_bytes(noise_image(64, 64))
    with pytest.raises(ValueError, match="cannot decode"):
        proc.load(data[: len(data) // 2])  # truncated
    with pytest.raises(TypeError, match="path, bytes or a PIL"):
        proc.load(123)


def test_hard_limits_refuse_instead_of_resizing(tmp_path):
    with pytest.raises(ValueError, match="20000 x 1, a side over max_side=16384"):
        ImageProcessor().load(png_bytes(Image.new("L", (20000, 1))))  # refused from the header, default limit
    data = png_bytes(Image.new("RGB", (300, 20)))
    with pytest.raises(ValueError, match="300 x 20, a side over max_side=200"):
        ImageProcessor(max_side=200).load(data)
    path = tmp_path / "a.png"
    path.write_bytes(data)
    with pytest.raises(ValueError, match="over max_bytes=50"):
        ImageProcessor(max_bytes=50).load(path)
    with pytest.raises(ValueError, match="max_pixels=100 must be >="):
        ImageProcessor(max_pixels=100)


def huge_png(side: int) -> bytes:
    """A valid one-bit black PNG of side x side pixels, compressed to a few KB and built without ever holding
    its pixels (Pillow would need them all to write it)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = bytes(1 + (side + 7) // 8)  # filter byte 0, then the packed bits
    z = zlib.compressobj(9)
    idat = b"".join(z.compress(row * 1000) for _ in range(side // 1000)) + z.compress(row * (side % 1000))
    idat += z.flush()
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)  # bit depth 1, greyscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_a_huge_image_is_refused_from_its_header_before_decoding(monkeypatch, tmp_path):
    """13000 x 13000 pixels in a few KB: decoded to RGB it would take half a GB of host memory before the resize.
    It is refused from the header alone: no pixel is decoded (Pillow's decoding entry point is never called)."""
    from PIL import ImageFile

    data = huge_png(13000)
    assert len(data) < 64 * 1024 and data[16:24] == (13000).to_bytes(4, "big") * 2  # IHDR width, height
    decoded = []
    real_load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: decoded.append(self.size) or real_load(self))
    path = tmp_path / "huge.png"
    path.write_bytes(data)
    for image in (data, path):
        with pytest.raises(ValueError, match="13000 x 13000 = 169000000 pixels, over max_decoded_pixels"):
            ImageProcessor().process([image])
    assert decoded == []
    assert ImageProcessor().load(huge_png(2000)).size == (2000, 2000)  # under the limit: decoded, and seen doing so
    assert decoded and set(decoded) == {(2000, 2000)}
    with pytest.raises(ValueError, match="over max_decoded_pixels=1000000"):
        ImageProcessor(max_decoded_pixels=1000 * 1000).load(huge_png(2000))


def test_process_names_the_bad_image(proc):
    with pytest.raises(ValueError, match="image 1: cannot decode"):
        proc.process([noise_image(28, 28), b"garbage bytes here"])
    with pytest.raises(ValueError, match="at least one image"):
        proc.process([])


# ---------------------------------------------------------------------- sizing
@pytest.mark.parametrize(
    "size", [(640, 480), (1000, 37), (17, 3000), (28, 28), (5000, 4000), (3584, 3584), (4000, 9), (1, 1)]
)
def test_target_size_keeps_aspect_and_rounds_to_28(proc, size):
    w, h = size
    nw, nh = proc.target_size(w, h)
    assert nw % 28 == 0 and nh % 28 == 0 and nw >= 28 and nh >= 28
    assert nw * nh <= proc.max_pixels
    scale = min(1.0, (proc.max_pixels / (w * h)) ** 0.5)
    for old, new in ((w, nw), (h, nh)):
        assert abs(new - old * scale) <= 28 or (old * scale < 28 and new == 28)
    if min(w, h) * scale >= 280:  # aspect within rounding (each side moves by < one unit of >= 10 units)
        assert abs((nw / nh) / (w / h) - 1) < 0.11


def test_resize_only_when_needed():
    proc = ImageProcessor(max_pixels=224 * 224)
    img = noise_image(224, 112)
    assert proc.resize(img) is img  # fits, sides already multiples of 28
    big = proc.resize(noise_image(640, 480))
    assert big.size == proc.target_size(640, 480) and big.width * big.height <= 224 * 224
    assert abs(big.width / big.height / (640 / 480) - 1) < 0.2
    x, grid = proc.preprocess(noise_image(100, 50))
    assert grid == (4, 8) and x.shape == (32, 588)  # 100 x 50 -> 112 x 56 pixels -> (h, w) = (4, 8) patches


def test_patch_layout_and_normalisation(proc):
    img = noise_image(56, 28, seed=4)
    patches, grid = proc.to_patches(img)
    assert grid == (2, 4) and patches.shape == (8, 3 * 14 * 14)
    pixels = torch.from_numpy(np.array(img)).float() / 255 * 2 - 1  # [28, 56, 3] in [-1, 1]
    r, c = 1, 2  # patch (row 1, col 2) is patch 1 * 4 + 2 of the row-major grid
    crop = pixels[14 * r : 14 * r + 14, 14 * c : 14 * c + 14].permute(2, 0, 1).reshape(-1)  # (c, y, x)
    assert torch.allclose(patches[r * 4 + c], crop, atol=1e-6)
    assert patches.min() >= -1 and patches.max() <= 1


def test_modes_and_transparency(proc):
    rgba = Image.new("RGBA", (28, 28), (10, 20, 30, 0))  # fully transparent: composited over white
    assert proc.load(rgba).getpixel((0, 0)) == (255, 255, 255)
    gray = Image.new("L", (28, 28), 128)
    assert proc.load(png_bytes(gray)).mode == "RGB"
    jpeg = proc.load(png_bytes(noise_image(40, 30), "JPEG"))
    assert jpeg.size == (40, 30) and jpeg.mode == "RGB"


def test_process_packs_images_in_order(proc, tmp_path):
    path = tmp_path / "b.png"
    noise_image(84, 56, seed=1).save(path)
    images = [noise_image(56, 28), path, png_bytes(noise_image(28, 112, seed=2))]
    patches, grids = proc.process(images)
    assert grids.tolist() == [[2, 4], [4, 6], [8, 2]] and grids.dtype == torch.int64
    assert patches.shape == (8 + 24 + 16, 588) and patches.dtype == torch.float32
    single, g = proc.process(images[0])
    assert torch.equal(single, patches[:8]) and g.tolist() == [[2, 4]]


# ---------------------------------------------------------------------- media tokens
def test_merged_tokens():
    assert merged_tokens((4, 6), 2) == 6 and merged_tokens(torch.tensor([256, 256]), 2) == 16384
    with pytest.raises(ValueError, match="multiples of merge=2"):
        merged_tokens((3, 4), 2)


def test_expand_placeholders():
    P, B, E = 9, 7, 8
    ids, pos = expand_placeholders([1, P, 2, 3, P], [2, 3], P, B, E)
    assert ids == [1, B, P, P, E, 2, 3, B, P, P, P, E]
    assert pos == [2, 3, 8, 9, 10]
    assert expand_placeholders([1, 2], [], P, B, E) == ([1, 2], [])
    with pytest.raises(ValueError, match=r"2 media placeholder token\(s\) \(id 9\) but 3 image\(s\)"):
        expand_placeholders([P, 1, P], [1, 1, 1], P, B, E)
    with pytest.raises(ValueError, match=r"0 media placeholder token\(s\) \(id 9\) but 1 image\(s\)"):
        expand_placeholders([1, 2], [4], P, B, E)
    with pytest.raises(ValueError, match="must differ"):
        expand_placeholders([P], [1], P, P, E)
    assert expand_placeholders([1, P], [2], P, None, None)[0] == [1, P, P]
    with pytest.raises(ValueError, match="both or neither"):
        expand_placeholders([P], [1], P, B, None)


def test_images_to_lm_tokens_end_to_end(proc):
    cfg = with_vision(get_preset("tiny"))
    torch.manual_seed(0)
    tower = VisionTower(cfg).eval()
    patches, grids = proc.process([noise_image(56, 28), noise_image(84, 84, seed=3)])
    with torch.no_grad():
        feats = tower(patches, grids)
    counts = [merged_tokens(g, cfg.vision.merge_size) for g in grids.tolist()]
    ids, pos = expand_placeholders(
        [5, cfg.vision.media_placeholder_token_id, 6, cfg.vision.media_placeholder_token_id],
        counts,
        cfg.vision.media_placeholder_token_id,
        3,
        4,
    )
    assert feats.shape == (len(pos), cfg.hidden_size) == (2 + 9, 64) and torch.isfinite(feats).all()
    assert all(ids[p] == cfg.vision.media_placeholder_token_id for p in pos)


def test_k3_preset_wraps_each_image_in_media_begin_and_end():
    """The k3 preset's ids (config only, no model): one placeholder + an image of n merged tokens becomes
    begin, pad x n, end, through expand_placeholders and through the engine's prepare."""
    from types import SimpleNamespace

    from k3.infer.engine import Engine

    v = get_preset("k3").vision
    assert (v.media_begin_token_id, v.media_placeholder_token_id, v.media_end_token_id) == (163602, 163605, 163604)
    n = merged_tokens((6, 4), v.merge_size)  # 84 x 56 pixels, 14-pixel patches, 2 x 2 merge
    assert n == 6
    ids, pos = expand_placeholders(
        [7, 163605, 8], [n], v.media_placeholder_token_id, v.media_begin_token_id, v.media_end_token_id
    )
    assert ids == [7, 163602] + [163605] * n + [163604, 8] and pos == list(range(2, 2 + n))
    prompt, media = Engine.prepare(SimpleNamespace(vision=v), [7, 163605, 8], [noise_image(56, 84)])
    assert prompt == ids and media.grids.tolist() == [[6, 4]]
