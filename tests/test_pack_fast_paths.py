"""The per-sample fast paths of pack building give exactly what their straightforward forms give.

``sample_randomness`` (:mod:`mmidx.index.dropout`) sets the state of a reused Philox generator instead of
constructing one per sample: its draws must equal a freshly constructed
``Philox(key=seed, counter=[0, 0, position, pack])``'s.
``element_problem`` accepts one sample's sound plan records in Python ints: on sound and corrupted
records alike it must answer what its vectorised form (per-record counts) answers.
"""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from mmidx import format as fmt
from mmidx.index.dropout import sample_randomness
from mmidx.read.invariants import element_problem


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**63, 2**64 - 1, 2**64, 2**100 + 7, 2**128 - 1])
def test_sample_randomness_equals_a_freshly_constructed_philox(seed):
    for pack, position, count in ((0, 0, 1), (9, 3, 5), (2**62, 31, 40), (5, 2**63 - 1, 3), (7, 2, 0)):
        generator = np.random.Generator(np.random.Philox(key=seed, counter=[0, 0, position, pack]))
        uniforms, normals = sample_randomness(seed, pack, position, count)
        assert np.array_equal(uniforms, generator.random(count))
        assert np.array_equal(normals, generator.standard_normal(count))


def test_sample_randomness_in_new_threads_draws_what_the_main_thread_draws():
    """Each thread reuses a generator of its own (made on its first draw): a pack built by a thread pool draws
    the same as one built in the main thread."""
    asks = [(seed, pack, position, 4) for seed in (0, 7) for pack in (0, 3) for position in (0, 2)]
    here = [sample_randomness(*ask) for ask in asks]
    with ThreadPoolExecutor(4) as pool:
        there = list(pool.map(lambda ask: sample_randomness(*ask), asks))
    for (uniforms, normals), (their_uniforms, their_normals) in zip(here, there, strict=True):
        assert np.array_equal(uniforms, their_uniforms) and np.array_equal(normals, their_normals)


def test_sample_randomness_refuses_keys_philox_refuses():
    for seed in (-1, 2**128):
        with pytest.raises(ValueError, match="key"):
            sample_randomness(seed, 0, 0, 1)


@pytest.mark.parametrize("pack, position", [(0, -1), (-1, 0), (0, 2**63), (2**63, 0), (0, 2**64 - 1), (0, 2**64)])
def test_sample_randomness_refuses_positions_and_packs_out_of_range(pack, position):
    """-1 would alias 2**64 - 1 and 2**63 would wrap onto 0 (issue 56, item 10): refused as sample_uniforms does."""
    with pytest.raises(ValueError, match=r"\[0, 2\*\*63\)"):
        sample_randomness(7, pack, position, 2)


def _records(rng, count):
    records = np.zeros(count, fmt.ELEMENT_DTYPE)
    records["kind"] = rng.integers(0, len(fmt.KIND_NAMES), count)
    records["flags"] = rng.integers(0, fmt.KNOWN_FLAGS + 1, count)
    records["img_num"] = rng.integers(1, 4, count)
    records["special_token_label"] = -1
    records["payload"] = rng.integers(0, 3, count)
    return records


def test_element_problem_of_one_sample_answers_as_its_vectorised_form():
    rng = np.random.default_rng(0)
    corruptions = [("kind", 3), ("kind", 255), ("flags", 1 << 6), ("flags", 255), ("img_num", 0),
                   ("payload", -1), ("payload", 3), ("payload", 2**31 - 1)]
    answers = set()
    for trial in range(400):
        count = int(rng.integers(1, 9)) if trial < 390 else 70  # a long view takes the vectorised path itself
        records = _records(rng, count)
        if trial % 2:
            field, value = corruptions[trial // 2 % len(corruptions)]
            records[field][rng.integers(0, count)] = value
        texts, images = int(rng.integers(0, 4)), int(rng.integers(0, 4))
        expected = element_problem(records, np.full(count, texts), np.full(count, images))
        assert element_problem(records, texts, images) == expected
        answers.add(expected if expected is None else expected.split(" ")[0])
    assert None in answers and len(answers) >= 4  # sound views and several kinds of corruption were compared


def test_pack_pixels_decode_each_stored_image_once_and_let_it_go_after_its_last_use(monkeypatch):
    from types import SimpleNamespace

    from mmidx.images.transform import BAGEL_VAE_TRANSFORM
    from mmidx.pack import pixels

    decoded = []

    def decode(data):  # a stand-in decoder: counts calls, gives distinct pixels per image
        decoded.append(data)
        return np.full((2, 3, 3), data[0], np.uint8)

    monkeypatch.setattr(pixels, "decode_rgb_pixels", decode)
    images = {payload: SimpleNamespace(data=bytes([payload]), width=3, height=2) for payload in (0, 1)}
    sample = SimpleNamespace(image=images.__getitem__, dataset=SimpleNamespace(prefix="p"))

    def job(payload):
        return pixels._ImageJob((0, 0, 7, payload), sample, BAGEL_VAE_TRANSFORM, 1, 2, 3)

    jobs = [job(0), job(1), job(0)]  # image 0 used twice (an edit pack's VAE and ViT element), image 1 once
    pack_pixels = pixels._Pixels(jobs)
    seen = [int(pack_pixels(each)[0, 0, 0]) for each in jobs]
    assert seen == [0, 1, 0]
    assert decoded == [b"\x00", b"\x01"]  # image 0 decoded once for both of its uses
    assert pack_pixels.decoded == {}  # nothing held once every use is done
