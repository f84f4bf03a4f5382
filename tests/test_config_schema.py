"""The data config's checks (mmidx.config and mmidx.config.schema): a mapping's unknown keys are named, whatever
their type, beside the known ones; a pack budget that no sample could fit is refused."""

import re

import pytest

from mmidx.config import PackingConfig
from mmidx.config.schema import checked_mapping


def test_unknown_keys_of_any_type_are_named_in_order_beside_the_known_ones():
    # YAML reads `1:` as an integer key: it is named as it reads, not a TypeError from sorting it with strings
    with pytest.raises(ValueError, match=re.escape("packing: unknown keys 1, window_size; the known ones are "
                                                   "window, policy")):
        checked_mapping("packing", {"window": 4, "window_size": 4, 1: "x"}, ("window", "policy"))


def test_one_unknown_key_is_named_alone():
    with pytest.raises(ValueError, match=re.escape("dropout: unknown key vitt; the known ones are text, vit, vae")):
        checked_mapping("dropout", {"vitt": 0.1}, ("text", "vit", "vae"))


@pytest.mark.parametrize("per_sample", [0, 36865])
def test_a_per_sample_budget_of_0_or_over_the_pack_is_refused(per_sample):
    with pytest.raises(ValueError, match=re.escape(f"need 0 < max_num_tokens_per_sample ({per_sample}) <= "
                                                   "max_num_tokens (36864): a sample must fit a pack")):
        PackingConfig(max_num_tokens_per_sample=per_sample)
