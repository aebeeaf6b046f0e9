"""MoonViT-V2: the native-resolution vision encoder, 2x2 patch merge and MLP projector to the LM width
(docs/architecture.md#vision).

Data flow for a packed batch of images (N patches in all, image i has a patch grid of h_i x w_i, both even):

  pixel_patches [N, 3*p*p]         each row one p x p patch, flattened channel-major (c, y, x), row-major per image
  -> patch_embed (Linear, no bias)  [N, D]
  + pos_embed                       learnable [G, G, D] grid, bilinearly resized to each image's (h_i, w_i)
  -> num_layers x VisionBlock       pre-norm: x += attn(norm1(x)); x += mlp(norm2(x))
        attn: fused qkv -> 2D RoPE on q, k -> softmax attention inside each image only -> out proj
        mlp:  fc1 -> gelu-tanh -> fc2
  -> final RMSNorm                  [N, D]                                      (the "encoder": ~401M for K3)
  -> 2x2 merge                      [N/4, 4D]   the 4 neighbours (2r,2c) (2r,2c+1) (2r+1,2c) (2r+1,2c+1) concatenated
  -> projector                      Linear(4D, 4D) -> gelu-tanh -> Linear(4D, d) -> RMSNorm(d)      [N/4, d]

Merged tokens come image by image, row-major over each image's (h_i/2, w_i/2) grid. Images never see each
other: attention is block-diagonal over the packed sequence (``cu_seqlens`` from the grids), and the position
embedding and RoPE depend only on an image's own grid, so packing changes nothing but the batching.

2D RoPE: the head dim D_h is split in two halves, the first rotated by the patch row, the second by the patch
column; each half uses :func:`k3.model.rope.rotate_half_rope` (pairs (j, j + D_h/4), theta 10000), so a
q.k score depends on the (row, col) offset between two patches only. There are no biases anywhere and every
norm is an RMSNorm (eps ``config.rms_norm_eps``). Attached to a multimodal LM as ``vision_tower``, every
parameter name starts with "vision" and ``k3.model.accounting.classify`` counts it under the vision path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k3.config import K3Config, VisionConfig
from k3.model.rope import rotate_half_rope
from k3.model.norm import RMSNorm
from k3.ops.dtypes import upcast
from k3.ops.segments import Segments, as_segments

CHANNELS = 3  # RGB
ROPE_THETA = 10000.0


def _vision(config: K3Config) -> VisionConfig:
    if config.vision is None:
        raise ValueError(f"config {config.name!r} has no vision tower (config.vision is None)")
    return config.vision


def vision_param_counts(config: K3Config) -> dict[str, int]:
    """Parameters of the vision path, computed from the config alone (nothing is allocated).

    encoder: patch embedding + position grid + blocks (qkv, out, fc1, fc2, two norms each) + final norm.
    projector: the 2x2-merge MLP (two matrices) + its output RMSNorm to the LM width.
    """
    v = _vision(config)
    d, inner = v.hidden_size, v.num_heads * v.head_dim
    block = d * 3 * inner + inner * d + 2 * d * v.intermediate_size + 2 * d
    encoder = CHANNELS * v.patch_size**2 * d + v.pos_grid**2 * d + v.num_layers * block + d
    merged = v.merge_size**2 * d
    projector = merged * merged + merged * config.hidden_size + config.hidden_size
    return {"encoder": encoder, "projector": projector}


def gelu_tanh(x: Tensor) -> Tensor:
    """GELU with the tanh approximation, computed in fp32 and returned in x.dtype."""
    return F.gelu(upcast(x), approximate="tanh").to(x.dtype)


def patch_positions(grids: Sequence[tuple[int, int]], device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """Row and column index of every packed patch: grids [(h, w), ...] -> rows [N], cols [N] (int64)."""
    rows, cols = [], []
    for h, w in grids:
        idx = torch.arange(h * w, device=device)
        rows.append(idx // w)
        cols.append(idx % w)
    return torch.cat(rows), torch.cat(cols)


def rope_2d(x: Tensor, rows: Tensor, cols: Tensor, theta: float = ROPE_THETA) -> Tensor:
    """2D rotary embedding. x [N, H, Dh] (Dh divisible by 4), rows / cols [N] -> [N, H, Dh] in x.dtype.

    The first Dh/2 channels rotate with the row index, the last Dh/2 with the column index."""
    half = x.shape[-1] // 2
    return torch.cat(
        [rotate_half_rope(x[..., :half], rows, theta), rotate_half_rope(x[..., half:], cols, theta)], dim=-1
    )


def interpolate_pos_grid(grid: Tensor, h: int, w: int) -> Tensor:
    """Resize the learnable grid [G, G, D] to an image's patch grid: -> [h * w, D] row-major, in grid.dtype.

    Bilinear, align_corners=False (pixel centres), no antialiasing; at (h, w) == (G, G) it is the grid itself."""
    img = upcast(grid).permute(2, 0, 1).unsqueeze(0)  # [1, D, G, G]
    out = F.interpolate(img, size=(h, w), mode="bilinear", align_corners=False)
    return out[0].permute(1, 2, 0).reshape(h * w, -1).to(grid.dtype)


def bidirectional_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, cu_seqlens: Segments | Tensor) -> Tensor:
    """Non-causal softmax attention inside each segment of a packed sequence (one SDPA call per segment).

    q, k, v [N, H, Dh]; cu_seqlens [S+1] (segment s is rows cu[s]:cu[s+1]; Segments or a tensor,
    k3.ops.segments) -> o [N, H, Dh] in q.dtype."""
    out = torch.empty_like(q)
    cu = as_segments(cu_seqlens).host
    for a, b in zip(cu[:-1], cu[1:]):
        qh, kh, vh = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, L, Dh]
        out[a:b] = F.scaled_dot_product_attention(qh, kh, vh, scale=scale)[0].transpose(0, 1)
    return out


class VisionAttention(nn.Module):
    """Fused qkv -> 2D RoPE on q and k -> per-image attention -> out projection. x [N, D] -> [N, D]."""

    def __init__(self, v: VisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = v.num_heads, v.head_dim
        inner = v.num_heads * v.head_dim
        self.qkv = nn.Linear(v.hidden_size, 3 * inner, bias=False)
        self.proj = nn.Linear(inner, v.hidden_size, bias=False)

    def forward(self, x: Tensor, rows: Tensor, cols: Tensor, cu_seqlens: Segments) -> Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # each [N, H, Dh]
        q, k = rope_2d(q, rows, cols), rope_2d(k, rows, cols)
        o = bidirectional_attention(q, k, v, scale=self.head_dim**-0.5, cu_seqlens=cu_seqlens)
        return self.proj(o.reshape(n, -1))


class VisionMLP(nn.Module):
    """fc2(gelu_tanh(fc1(x))): x [N, D] -> [N, D] through the intermediate width."""

    def __init__(self, v: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(v.hidden_size, v.intermediate_size, bias=False)
        self.fc2 = nn.Linear(v.intermediate_size, v.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(gelu_tanh(self.fc1(x)))


class VisionBlock(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then + mlp(norm2(x)). x [N, D] -> [N, D]."""

    def __init__(self, v: VisionConfig, eps: float):
        super().__init__()
        self.norm1 = RMSNorm(v.hidden_size, eps=eps)
        self.attn = VisionAttention(v)
        self.norm2 = RMSNorm(v.hidden_size, eps=eps)
        self.mlp = VisionMLP(v)

    def forward(self, x: Tensor, rows: Tensor, cols: Tensor, cu_seqlens: Segments) -> Tensor:
        x = x + self.attn(self.norm1(x), rows, cols, cu_seqlens)
        return x + self.mlp(self.norm2(x))


class MoonViTEncoder(nn.Module):
    """Patch embedding + interpolated position grid + blocks + final norm (the ~401M "encoder" of
    docs/architecture.md#vision).

    forward(pixel_patches [N, 3*p*p], grids [(h, w), ...] host ints) -> [N, D]."""

    def __init__(self, v: VisionConfig, eps: float):
        super().__init__()
        self.patch_embed = nn.Linear(CHANNELS * v.patch_size**2, v.hidden_size, bias=False)
        self.pos_embed = nn.Parameter(torch.zeros(v.pos_grid, v.pos_grid, v.hidden_size))
        self.blocks = nn.ModuleList(VisionBlock(v, eps) for _ in range(v.num_layers))
        self.norm = RMSNorm(v.hidden_size, eps=eps)

    def position_embedding(self, grids: Sequence[tuple[int, int]]) -> Tensor:
        """The position grid resized to each image and packed: -> [N, D] (one resize per distinct grid)."""
        cache: dict[tuple[int, int], Tensor] = {}
        for hw in grids:
            if hw not in cache:
                cache[hw] = interpolate_pos_grid(self.pos_embed, *hw)
        return torch.cat([cache[hw] for hw in grids])

    def forward(self, pixel_patches: Tensor, grids: Sequence[tuple[int, int]]) -> Tensor:
        lengths = [h * w for h, w in grids]
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        cu_seqlens = Segments.from_host(cu, pixel_patches.device)
        rows, cols = patch_positions(grids, pixel_patches.device)
        x = self.patch_embed(pixel_patches.to(self.patch_embed.weight.dtype))  # [N, D]
        x = x + self.position_embedding(grids).to(x.dtype)
        for block in self.blocks:
            x = block(x, rows, cols, cu_seqlens)
        return self.norm(x)


def merge_index(grids: Sequence[tuple[int, int]], merge: int, device: torch.device | None = None) -> Tensor:
    """Gather index that groups each merge x merge window of row-major patches together: -> [N] int64.

    x[merge_index(...)].view(N / merge**2, merge**2 * D) puts, for image after image and merged cell (r, c) in
    row-major order, the patches (merge*r + i, merge*c + j) for i, j in row-major order side by side."""
    parts, offset = [], 0
    for h, w in grids:
        idx = torch.arange(h * w, device=device).view(h // merge, merge, w // merge, merge)
        parts.append(offset + idx.permute(0, 2, 1, 3).reshape(-1))
        offset += h * w
    return torch.cat(parts)


class VisionProjector(nn.Module):
    """2x2 merge then MLP to the LM width: x [N, D], grids -> [N / merge**2, d_text].

    Linear(m*m*D, m*m*D) -> gelu-tanh -> Linear(m*m*D, d_text) -> RMSNorm(d_text)."""

    def __init__(self, v: VisionConfig, text_hidden: int, eps: float):
        super().__init__()
        self.merge = v.merge_size
        merged = v.merge_size**2 * v.hidden_size
        self.fc1 = nn.Linear(merged, merged, bias=False)
        self.fc2 = nn.Linear(merged, text_hidden, bias=False)
        self.norm = RMSNorm(text_hidden, eps=eps, cast=False)  # its output is spliced into the text embeddings

    def forward(self, x: Tensor, grids: Sequence[tuple[int, int]]) -> Tensor:
        m2 = self.merge**2
        x = x[merge_index(grids, self.merge, x.device)].reshape(x.shape[0] // m2, m2 * x.shape[1])
        return self.norm(self.fc2(gelu_tanh(self.fc1(x))))


def check_grids(grid_hws: Tensor | Sequence[Sequence[int]], num_patches: int, merge: int) -> list[tuple[int, int]]:
    """Validate the per-image patch grids (read once to the host): each (h, w) positive and divisible by
    ``merge``, and sum(h * w) == num_patches. Returns [(h, w), ...]; raises one ValueError otherwise."""
    grids = grid_hws.tolist() if isinstance(grid_hws, Tensor) else [list(g) for g in grid_hws]
    if not grids or any(len(g) != 2 for g in grids):
        raise ValueError(f"grid_hws must be a non-empty [num_images, 2] list of (h, w), got {grids!r}")
    out = []
    for i, (h, w) in enumerate(grids):
        if isinstance(h, bool) or isinstance(w, bool) or not isinstance(h, int) or not isinstance(w, int):
            raise ValueError(f"grid_hws[{i}]=({h!r}, {w!r}) must be integers")
        if h <= 0 or w <= 0 or h % merge or w % merge:
            raise ValueError(f"grid_hws[{i}]=({h}, {w}) must be positive multiples of merge_size={merge}")
        out.append((h, w))
    total = sum(h * w for h, w in out)
    if total != num_patches:
        raise ValueError(f"grid_hws cover {total} patches but pixel_patches has {num_patches} rows")
    return out


class VisionTower(nn.Module):
    """MoonViT-V2 encoder + merge/projector; attach to a multimodal LM as ``vision_tower``.

    forward(pixel_patches [N, 3*p*p], grid_hws [num_images, 2] patch grids (h, w), each even)
      -> [sum_i (h_i/2) * (w_i/2), config.hidden_size], image by image, row-major over each merged grid.
    """

    def __init__(self, config: K3Config):
        super().__init__()
        v = _vision(config)
        self.vision_config = v
        self.initializer_range = config.initializer_range
        self.encoder = MoonViTEncoder(v, config.rms_norm_eps)
        self.projector = VisionProjector(v, config.hidden_size, config.rms_norm_eps)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, initializer_range) for every matrix and the position grid; ones for the norms."""
        std = self.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        nn.init.normal_(self.encoder.pos_embed, 0.0, std)

    def encode(self, pixel_patches: Tensor, grid_hws: Tensor | Sequence[Sequence[int]]) -> Tensor:
        """Encoder features before the merge: [N, 3*p*p] -> [N, D]."""
        grids = self._grids(pixel_patches, grid_hws)
        return self.encoder(pixel_patches, grids)

    def forward(self, pixel_patches: Tensor, grid_hws: Tensor | Sequence[Sequence[int]]) -> Tensor:
        grids = self._grids(pixel_patches, grid_hws)
        return self.projector(self.encoder(pixel_patches, grids), grids)

    def _grids(self, pixel_patches: Tensor, grid_hws: Tensor | Sequence[Sequence[int]]) -> list[tuple[int, int]]:
        v = self.vision_config
        width = CHANNELS * v.patch_size**2
        if pixel_patches.dim() != 2 or pixel_patches.shape[1] != width:
            raise ValueError(
                f"pixel_patches must be [N, {width}] (3 x {v.patch_size} x {v.patch_size} patches), "
                f"got shape {tuple(pixel_patches.shape)}"
            )
        return check_grids(grid_hws, pixel_patches.shape[0], v.merge_size)
