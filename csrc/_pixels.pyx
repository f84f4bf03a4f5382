"""Normalise uint8 RGB pixels into float32 batch buffers in one pass (VAE CHW slots, ViT patch rows).

Each output value is ``table[channel, pixel]``: the caller's 256-entry table per channel holds
exactly what torchvision's ``ToTensor`` + ``Normalize`` compute for each level, so the result is
bit-identical for any mean and std, and every output value is written once (a cast, a divide and
a subtract would each pass over the buffer). Pixels may be any strided (H, W, 3) view, such as
Pillow's 4-byte RGB rows exported without a copy.
"""

from libc.stdint cimport uint8_t


def normalize_to_chw(const uint8_t[:, :, :] pixels, float[:, :, :] out, const float[:, ::1] table):
    """out[c, y, x] = table[c, pixels[y, x, c]] for an (H, W, 3) image into a (3, H, W) view."""
    cdef Py_ssize_t height = pixels.shape[0], width = pixels.shape[1], y, x, c
    if pixels.shape[2] != 3 or out.shape[0] != 3 or out.shape[1] != height or out.shape[2] != width:
        raise ValueError(f"shapes do not match: pixels {tuple(pixels.shape)[:3]}, out {tuple(out.shape)[:3]}")
    if table.shape[0] != 3 or table.shape[1] != 256:
        raise ValueError("table must be (3, 256) float32")
    with nogil:
        for c in range(3):
            for y in range(height):
                for x in range(width):
                    out[c, y, x] = table[c, pixels[y, x, c]]


def normalize_to_patches(const uint8_t[:, :, :] pixels, float[:, ::1] out, const float[:, ::1] table,
                         Py_ssize_t patch):
    """BAGEL's ``patchify`` of the normalised image into rows of ``out``: one row per patch
    (row-major), each patch flattened as (patch row, patch column, channel)."""
    cdef Py_ssize_t height = pixels.shape[0], width = pixels.shape[1]
    cdef Py_ssize_t rows = height // patch, columns = width // patch
    cdef Py_ssize_t r, q, pr, pc, c, k, y, x
    if pixels.shape[2] != 3 or height % patch or width % patch:
        raise ValueError(f"an image of {height}x{width} does not divide into {patch}x{patch} patches")
    if out.shape[0] != rows * columns or out.shape[1] != patch * patch * 3:
        raise ValueError(f"out must be ({rows * columns}, {patch * patch * 3}), got {tuple(out.shape)[:2]}")
    if table.shape[0] != 3 or table.shape[1] != 256:
        raise ValueError("table must be (3, 256) float32")
    with nogil:
        for r in range(rows):
            for q in range(columns):
                k = 0
                for pr in range(patch):
                    y = r * patch + pr
                    for pc in range(patch):
                        x = q * patch + pc
                        for c in range(3):
                            out[r * columns + q, k] = table[c, pixels[y, x, c]]
                            k += 1
