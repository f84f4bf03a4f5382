"""tools/check_bagel.py reports what differs, counts only the README's deliberate differences apart, and feeds BAGEL's
pack_sequence mmidx's draws element by element.

The comparison against BAGEL's own code needs a BAGEL checkout, which is never part of this repository: set
``MMIDX_BAGEL_SRC`` (and ``MMIDX_BAGEL_SITE`` for its extra packages on a CPU torch) to run the last two tests;
without them they are skipped and say so.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import check_bagel

BAGEL_SRC, BAGEL_SITE = os.environ.get("MMIDX_BAGEL_SRC"), os.environ.get("MMIDX_BAGEL_SITE")
needs_bagel = pytest.mark.skipif(not BAGEL_SRC, reason="set MMIDX_BAGEL_SRC to a ByteDance-Seed/Bagel checkout "
                                                       "(and MMIDX_BAGEL_SITE to its extra packages)")


def test_a_changed_value_is_reported_with_its_count_and_first_position():
    theirs = torch.zeros(2, 3)
    ours = theirs.clone()
    ours[1, 2] = 0.5
    detail = check_bagel.difference("padded_images", ours, theirs)
    assert detail is not None and "1 of 6 values differ" in detail and "(1, 2)" in detail
    assert check_bagel.difference("padded_images", theirs.clone(), theirs) is None


def test_equal_values_of_another_dtype_are_a_mismatch():
    detail = check_bagel.difference("packed_position_ids", torch.arange(4, dtype=torch.int32), torch.arange(4))
    assert detail is not None and "torch.int32" in detail


def test_minus_infinity_timesteps_compare_equal():
    theirs = torch.tensor([float("-inf"), 0.25, float("-inf")])
    assert check_bagel.difference("packed_timesteps", theirs.clone(), theirs) is None


def test_one_different_dense_mask_is_named_by_its_sample():
    masks = [torch.zeros(2, 2), torch.zeros(3, 3)]
    changed = [masks[0].clone(), masks[1].clone()]
    changed[1][0, 2] = float("-inf")
    assert check_bagel.difference("nested_attention_masks", changed, masks).startswith("item 1:")


def test_lists_of_pairs_compare_whether_tuples_or_lists():
    assert check_bagel.difference("patchified_vae_latent_shapes", [[32, 32]], [(32, 32)]) is None
    assert check_bagel.difference("patchified_vae_latent_shapes", [[32, 16]], [(32, 32)]) is not None


def test_only_the_documented_empty_mse_loss_indexes_is_counted_as_deliberate():
    tally = check_bagel.Tally()
    tally.check("t2i pack 0 flex", "mse_loss_indexes", torch.tensor([], dtype=torch.int64), torch.tensor([]))
    tally.check("t2i pack 0 flex", "mse_loss_indexes", torch.tensor([1, 2]), torch.tensor([1.0, 2.0]))
    tally.check("t2i pack 0 flex", "ce_loss_indexes", torch.tensor([], dtype=torch.int64), torch.tensor([]))
    assert tally.comparisons == 3 and sum(tally.deliberate.values()) == 1
    assert [line.split(":")[0] for line in tally.mismatches] == ["t2i pack 0 flex mse_loss_indexes",
                                                                 "t2i pack 0 flex ce_loss_indexes"]


def test_plans_compare_with_bagels_defaults_for_the_keys_it_leaves_out():
    ours = [{"type": "text", "enable_cfg": 1, "loss": 0, "special_token_loss": 0, "special_token_label": None,
             "split_start": True, "split_end": True, "img_num": 1, "payload": 0}]
    theirs = [{"type": "text", "enable_cfg": 1, "loss": 0, "special_token_loss": 0, "special_token_label": None}]
    assert check_bagel.compare_plans(ours, theirs) is None
    assert "enable_cfg" in check_bagel.compare_plans(ours, [dict(theirs[0], enable_cfg=0)])
    assert "2 in BAGEL's" in check_bagel.compare_plans(ours, theirs * 2)


def test_pack_sequences_draws_answer_mmidxs_draws_of_the_element_it_is_at():
    module = types.SimpleNamespace(random="random module", np="numpy module")
    plan = check_bagel.IndexedPlan([{"enable_cfg": 1}, {"enable_cfg": 0}, {"enable_cfg": 1}])
    seen = []
    with check_bagel.mmidx_draws(module, plan, [0.1, 0.2, 0.3], [1.0, 2.0, 3.0]):
        for item in plan:  # pack_sequence's loop: draws only where it needs one
            if item["enable_cfg"]:
                seen.append((module.random.random(), module.np.random.randn()))
    assert seen == [(0.1, 1.0), (0.3, 3.0)]
    assert (module.random, module.np) == ("random module", "numpy module")


@pytest.fixture(scope="module")
def bagel_corpus(tmp_path_factory):
    check_bagel.import_bagel(BAGEL_SRC, BAGEL_SITE)
    return check_bagel.prepare(tmp_path_factory.mktemp("check_bagel"))


@needs_bagel
@pytest.mark.parametrize("mode", ["mix"])
def test_mmidx_packs_equal_bagels_own_on_the_generated_corpus(bagel_corpus, mode):
    tally = check_bagel.Tally()
    assert check_bagel.check_mode(mode, *bagel_corpus, packs=1, tally=tally) == 1
    assert tally.batches == 2 and tally.plans > 0
    assert tally.mismatches == []


@needs_bagel
def test_bagel_given_other_draws_than_mmidxs_is_reported(bagel_corpus, monkeypatch):
    draws = check_bagel.sample_randomness
    monkeypatch.setattr(check_bagel, "sample_randomness", lambda seed, pack, position, count:
                        draws(seed, pack + 1, position, count))
    tally = check_bagel.Tally()
    check_bagel.check_mode("edit", *bagel_corpus, packs=1, tally=tally)
    assert any("packed_timesteps" in line for line in tally.mismatches)
