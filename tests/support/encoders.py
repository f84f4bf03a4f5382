"""Small deterministic torch encoders for the precache tests (``--encoder support.encoders:vae``; tests/ on PYTHONPATH).

``MMIDX_TEST_KILL_AT_CALL=N`` makes the N-th call (from 1) kill its own process with SIGKILL: a
``kill -9`` at a deterministic point of a precache run.
"""

import os
import signal

import torch

CALLS = [0]


def _maybe_die() -> None:
    CALLS[0] += 1
    if CALLS[0] == int(os.environ.get("MMIDX_TEST_KILL_AT_CALL", "0")):
        os.kill(os.getpid(), signal.SIGKILL)


class TinyVAE(torch.nn.Module):
    """Conv (stride 8) + GroupNorm + a 1x1 conv to (mean, logvar) of 4 channels: a VAE encoder's shape."""

    def __init__(self):
        super().__init__()
        self.down = torch.nn.Conv2d(3, 8, kernel_size=8, stride=8)
        self.norm = torch.nn.GroupNorm(2, 8)
        self.out = torch.nn.Conv2d(8, 8, kernel_size=1)

    def forward(self, images):
        _maybe_die()
        mean, logvar = self.out(torch.nn.functional.silu(self.norm(self.down(images)))).chunk(2, dim=1)
        return mean, logvar.clamp(-6, 2)


class TinyText(torch.nn.Module):
    """Token ids (B, L) → (B, L, 6): an embedding and a linear layer."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(1000, 6)
        self.mix = torch.nn.Linear(6, 6)

    def forward(self, ids):
        _maybe_die()
        return self.mix(self.embed(ids))


class TinyViT(torch.nn.Module):
    """A frozen ViT's patch embedding: a conv with kernel = stride = the patch size, (B, 3, H, W) → (B, 8, H/p, W/p)."""

    def __init__(self, patch=14):
        super().__init__()
        self.embed = torch.nn.Conv2d(3, 8, kernel_size=patch, stride=patch)

    def forward(self, images):
        _maybe_die()
        return self.embed(images)


def vae():
    torch.manual_seed(0)
    return TinyVAE()


def vae_mean():
    """A callable returning one tensor (stored as is)."""
    model = vae()
    return lambda images: model(images)[0]


def vit():
    torch.manual_seed(2)
    return TinyViT()


def text():
    torch.manual_seed(1)
    return TinyText()


class StringText(torch.nn.Module):
    """A text encoder with a tokenizer of its own (as T5 or CLIP): strings → characters (ids ord(c) % 1000),
    padded to the batch's longest, → ((B, L, dim) embeddings, (B, L) mask). The seed's ``encode`` method."""

    def __init__(self, dim=6, max_length=64):
        super().__init__()
        torch.manual_seed(3)
        self.embed = torch.nn.Embedding(1000, dim)
        self.mix = torch.nn.Linear(dim, dim)
        self.max_length = max_length

    def encode(self, texts):
        _maybe_die()
        ids = [[ord(c) % 1000 for c in text[: self.max_length]] or [0] for text in texts]
        length = max(len(row) for row in ids)
        padded = torch.tensor([row + [0] * (length - len(row)) for row in ids])
        mask = torch.tensor([[1] * len(row) + [0] * (length - len(row)) for row in ids])
        return self.mix(self.embed(padded)), mask
