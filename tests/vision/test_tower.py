"""MoonViT-V2 tower: packing == separate encoding, position-grid interpolation, 2D RoPE, merge order, counts."""

import math

import pytest
import torch
from torch import nn

from k3.model.accounting import classify
from k3.config import get_preset
from k3.config.presets import VISION_PRESETS, with_vision
from k3.model.norm import RMSNorm
from k3.model.vision import (
    VisionTower,
    interpolate_pos_grid,
    merge_index,
    patch_positions,
    rope_2d,
    vision_param_counts,
)
from tests.helpers import rel


def randomise(tower: VisionTower, seed: int = 0) -> VisionTower:
    """O(1)-scale random weights everywhere (not the tiny init), so every path changes the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in tower.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(torch.randn(module.weight.shape, generator=g) / math.sqrt(module.in_features))
            elif isinstance(module, RMSNorm):
                module.weight.copy_(1 + 0.2 * torch.randn(module.weight.shape, generator=g))
        tower.encoder.pos_embed.copy_(torch.randn(tower.encoder.pos_embed.shape, generator=g))
    return tower


@pytest.fixture(scope="module")
def tiny_tower():
    torch.manual_seed(0)
    return randomise(VisionTower(with_vision(get_preset("tiny")))).eval()


def test_packed_images_equal_separate(tiny_tower):
    grids = [(4, 6), (10, 8), (2, 2), (18, 4)]  # different sizes and aspects; 18 rows > the 16 x 16 position grid
    torch.manual_seed(1)
    width = 3 * 14 * 14
    images = [torch.randn(h * w, width) for h, w in grids]
    with torch.no_grad():
        packed = tiny_tower(torch.cat(images), torch.tensor(grids))
        alone = torch.cat([tiny_tower(x, [hw]) for x, hw in zip(images, grids)])
        enc_packed = tiny_tower.encode(torch.cat(images), grids)
        enc_alone = torch.cat([tiny_tower.encode(x, [hw]) for x, hw in zip(images, grids)])
    assert packed.shape == (sum(h * w // 4 for h, w in grids), 64)
    assert rel(enc_packed, enc_alone) <= 1e-5
    assert rel(packed, alone) <= 1e-5
    # images do interact with their own patches: changing one patch changes only its own image's tokens
    bumped = [x.clone() for x in images]
    bumped[1][0] += 1.0
    with torch.no_grad():
        out = tiny_tower(torch.cat(bumped), grids)
    n0, n1 = 6, 6 + 20
    assert rel(out[:n0], packed[:n0]) <= 1e-6
    assert rel(out[n1:], packed[n1:]) <= 1e-6
    assert (out[n0:n1] - packed[n0:n1]).abs().amax(-1).min() > 0  # every token of image 1 moved


def test_bad_inputs_raise(tiny_tower):
    x = torch.randn(24, 588)
    with pytest.raises(ValueError, match="multiples of merge_size=2"):
        tiny_tower(x, [(3, 8)])
    with pytest.raises(ValueError, match="cover 20 patches but pixel_patches has 24"):
        tiny_tower(x, [(4, 4), (2, 2)])
    with pytest.raises(ValueError, match=r"must be \[N, 588\]"):
        tiny_tower(torch.randn(24, 100), [(4, 6)])


def test_pos_grid_at_native_size_is_the_raw_grid(tiny_tower):
    grid = tiny_tower.encoder.pos_embed.detach()  # [16, 16, 64], random
    g = grid.shape[0]
    assert torch.equal(interpolate_pos_grid(grid, g, g), grid.reshape(g * g, -1))
    packed = tiny_tower.encoder.position_embedding([(g, g), (2, 4)])
    assert torch.equal(packed[: g * g], grid.reshape(g * g, -1))
    # another size really resamples: a 2 x 4 grid is a blend, not a crop
    small = interpolate_pos_grid(grid, 2, 4)
    assert small.shape == (8, 64) and not torch.isclose(small[0], grid[0, 0]).all()


def test_rope_2d_depends_only_on_relative_offsets():
    torch.manual_seed(2)
    n, heads, dh = 20, 3, 32
    q, k = torch.randn(n, heads, dh, dtype=torch.float64), torch.randn(n, heads, dh, dtype=torch.float64)
    rows, cols = torch.randint(0, 24, (n,)), torch.randint(0, 24, (n,))

    def scores(rq, cq, rk, ck):
        return torch.einsum("ihd,jhd->hij", rope_2d(q, rq, cq), rope_2d(k, rk, ck))

    base = scores(rows, cols, rows, cols)
    shifted = scores(rows + 7, cols + 11, rows + 7, cols + 11)
    assert rel(shifted, base) <= 1e-5
    # not trivially invariant: moving only the queries, by rows or by columns, changes the scores differently
    by_row = scores(rows + 3, cols, rows, cols)
    by_col = scores(rows, cols + 3, rows, cols)
    assert rel(by_row, base) > 1e-2 and rel(by_col, base) > 1e-2 and rel(by_row, by_col) > 1e-2
    # the untouched norm: RoPE is a rotation
    assert rel(rope_2d(q, rows, cols).norm(dim=-1), q.norm(dim=-1)) <= 1e-6


def test_patch_positions_and_merge_order():
    rows, cols = patch_positions([(2, 3), (4, 2)])
    assert rows.tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3]
    assert cols.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 0, 1, 0, 1, 0, 1]
    h, w = 4, 6
    idx = merge_index([(h, w), (2, 2)], 2).view(-1, 4)
    expected = [
        [2 * r * w + 2 * c, 2 * r * w + 2 * c + 1, (2 * r + 1) * w + 2 * c, (2 * r + 1) * w + 2 * c + 1]
        for r in range(h // 2)
        for c in range(w // 2)
    ]
    assert idx[:6].tolist() == expected  # row-major over the merged 2 x 3 grid, 2x2 window row-major inside
    assert idx[6].tolist() == [24, 25, 26, 27]


@pytest.mark.parametrize("name", list(VISION_PRESETS))
def test_analytic_counts_equal_meta_build(name):
    cfg = with_vision(get_preset(name))
    with torch.device("meta"):
        tower = VisionTower(cfg)
    counts = vision_param_counts(cfg)
    assert counts["encoder"] == sum(p.numel() for p in tower.encoder.parameters())
    assert counts["projector"] == sum(p.numel() for p in tower.projector.parameters())
    holder = nn.Module()
    holder.vision_tower = tower
    assert {classify(n, cfg) for n, _ in holder.named_parameters()} == {"vision"}
    assert not any(n.endswith(".bias") for n, _ in tower.named_parameters())


def test_k3_encoder_is_about_401m():
    counts = vision_param_counts(get_preset("k3"))
    assert abs(counts["encoder"] / 401e6 - 1) <= 0.02, counts
    assert counts["encoder"] == 401_214_464
    # projector: Linear(4096, 4096) + Linear(4096, 7168) + RMSNorm(7168), reported separately
    assert counts["projector"] == 4096 * 4096 + 4096 * 7168 + 7168


def test_init_is_small_and_deterministic():
    cfg = with_vision(get_preset("tiny"))
    torch.manual_seed(3)
    a = VisionTower(cfg)
    torch.manual_seed(3)
    b = VisionTower(cfg)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
        if ".norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert 0 < p.std().item() < 3 * cfg.initializer_range, name
    with pytest.raises(ValueError, match="no vision tower"):
        VisionTower(get_preset("tiny"))
