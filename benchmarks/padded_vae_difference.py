"""How far per-image VAE encodings are from what BAGEL's trainer computes on the zero-padded batch.

BAGEL encodes ``padded_images`` (every image top-left, zeros to the batch's max size), so GroupNorm
statistics include the padding; mmidx precaches each image alone. This prints the relative difference
||padded - alone|| / ||alone|| of each image's latent (the crop of its own region) for a randomly
initialised conv + GroupNorm encoder (tests/support/encoders.py), on the pack shapes of BAGEL's t2i transform.
Run from the repository root: ``PYTHONPATH=.:tests python benchmarks/padded_vae_difference.py``.
"""

import argparse

import torch
from support import encoders

from mmidx.images.transform import ImageTransform


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="randomly initialised encoders to try")
    args = parser.parse_args()
    torch.manual_seed(0)
    transform = ImageTransform(max_image_size=1024, min_image_size=512, image_stride=16)
    sizes = [(1024, 768), (512, 512), (640, 960), (768, 512)]  # stored (width, height), in one pack
    shapes = [transform.output_shapes(w, h) for w, h in sizes]
    images = [torch.rand(3, int(h), int(w)) * 2 - 1 for w, h in shapes]
    height, width = max(i.shape[1] for i in images), max(i.shape[2] for i in images)
    padded = torch.zeros(len(images), 3, height, width)
    for slot, image in enumerate(images):
        padded[slot, :, : image.shape[1], : image.shape[2]] = image
    for seed in range(args.seeds):
        torch.manual_seed(seed)
        model = encoders.TinyVAE()  # seed 0: the tests' encoders.vae()
        with torch.no_grad():
            batch = model(padded)[0]
            differences = []
            for slot, image in enumerate(images):
                alone = model(image[None])[0][0]
                crop = batch[slot, :, : alone.shape[1], : alone.shape[2]]
                differences.append(float((crop - alone).norm() / alone.norm()))
        print(f"encoder seed {seed}: relative difference per image "
              f"{', '.join(f'{d:.2f}' for d in differences)} (min {min(differences):.2f}, max {max(differences):.2f})")


if __name__ == "__main__":
    main()
