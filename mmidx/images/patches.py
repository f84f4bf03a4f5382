"""ViT patches and BAGEL's position ids: ``patchify``, ``position_ids_extrapolate`` (NaViT-style ids
for the ViT), ``position_ids_interpolate`` (latent ids of the VAE grid).
"""

from __future__ import annotations

import torch


def patchify(image: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(C, H, W) → (H/p · W/p, p·p·C): patches in row-major order, each flattened as (p_row, p_col, C)."""
    channels, height, width = image.shape
    p = patch_size
    if height % p or width % p:
        raise ValueError(f"image of {height}x{width} does not divide into {p}x{p} patches; resize it first")
    patches = image.reshape(channels, height // p, p, width // p, p).permute(1, 3, 2, 4, 0)
    return patches.reshape(-1, p * p * channels)


def _grid(height: int, width: int, patch_size: int) -> tuple[int, int]:
    rows, cols = height // patch_size, width // patch_size
    if rows < 1 or cols < 1:
        raise ValueError(f"image of {height}x{width} is smaller than one {patch_size}x{patch_size} patch")
    return rows, cols


def position_ids_extrapolate(
    height: int, width: int, patch_size: int, max_num_patches_per_side: int
) -> torch.Tensor:
    """BAGEL's default position ids: ``row · max_num_patches_per_side + col`` per patch, int64.

    Refuses grids wider or taller than ``max_num_patches_per_side``: their ids would collide with
    the next row's and overrun the model's position table (e.g. 1024² VAE images need a
    ``max_latent_size`` of 64, not the default 32).
    """
    rows, cols = _grid(height, width, patch_size)
    if max(rows, cols) > max_num_patches_per_side:
        raise ValueError(f"a {rows}x{cols} patch grid does not fit max_num_patches_per_side="
                         f"{max_num_patches_per_side}; raise it (max_latent_size / max_num_patch_per_side)")
    return (torch.arange(rows)[:, None] * max_num_patches_per_side + torch.arange(cols)).flatten()


def position_ids_interpolate(
    height: int, width: int, patch_size: int, max_num_patches_per_side: int
) -> torch.Tensor:
    """BAGEL's interpolated position ids: each patch's fractional coordinate bucketed into the grid, int64.

    Uses the float32 ``torch.arange`` values and ``torch.bucketize(right=True)`` BAGEL uses, since
    those values (not exact fractions) decide patches that fall on a grid boundary.
    """
    rows, cols = _grid(height, width, patch_size)
    side = max_num_patches_per_side
    boundaries = torch.arange(1 / side, 1.0, 1 / side, dtype=torch.float32)

    def buckets(count: int) -> torch.Tensor:
        coords = torch.arange(0, 1 - 1e-6, 1 / count, dtype=torch.float32)
        return torch.bucketize(coords, boundaries, right=True)

    return (buckets(rows)[:, None] * side + buckets(cols)).flatten()
