"""An image whose patch grid exceeds the model's position table is refused when the pack index is built."""

import re

import pytest
from support.bagel_reference import resized_size
from support.packing import GEOMETRY, VAE, build_groups, config_of

from mmidx.index.pack_index import build_pack_index
from mmidx.read.dataset import MMIDXDataset


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    return build_groups(tmp_path_factory.mktemp("grids"))


def largest_latent_grids(prefix):
    """The largest VAE latent grid side of a dataset's images, by BAGEL's resize rule (the reference's), and the
    stored sizes (width x height) of the images whose grid has that side."""
    dataset = MMIDXDataset(prefix)
    grids = []
    for sample in range(len(dataset)):
        for image in dataset[sample].images:
            width, height = resized_size(image.width, image.height, VAE["max_image_size"], VAE["min_image_size"],
                                         VAE["image_stride"], 14 * 14 * 9 * 1024, 1)
            grids.append((max(width, height) // GEOMETRY["vae_image_downsample"], f"{image.width}x{image.height}"))
    side = max(grids)[0]
    return side, {stored for grid, stored in grids if grid == side}


def test_a_too_small_max_latent_size_names_the_dataset_the_image_and_the_value_needed(groups):
    t2i = {"t2i": groups["t2i"]}
    needed, stored = largest_latent_grids(groups["t2i"]["datasets"][0])
    with pytest.raises(ValueError) as error:
        build_pack_index(config_of(t2i, geometry={**GEOMETRY, "max_latent_size": needed - 1}))
    message = str(error.value)
    assert groups["t2i"]["datasets"][0] in message
    shown = re.search(r"image \d+ of sample \d+, (\d+x\d+) stored, becomes a \d+x\d+ grid of 16-pixel patches, "
                      "more than max_latent_size=", message)  # no source row: the samples were written directly
    assert shown and shown[1] in stored
    assert f"max_latent_size to at least {needed}" in message
    assert len(build_pack_index(config_of(t2i, geometry={**GEOMETRY, "max_latent_size": needed}))) > 0


def test_interpolated_position_ids_have_no_grid_limit(groups):
    geometry = {**GEOMETRY, "max_latent_size": 2, "interpolate_pos": True}
    assert len(build_pack_index(config_of({"t2i": groups["t2i"]}, geometry=geometry))) > 0


def test_a_too_small_vit_grid_is_refused_too(groups):
    with pytest.raises(ValueError, match="max_num_patch_per_side to at least"):
        build_pack_index(config_of({"edit": groups["edit"]}, geometry={**GEOMETRY, "max_num_patch_per_side": 3}))
