"""A data YAML's ``schedule:`` (mmidx.config.schedule): each phase parsed into a PhaseConfig, every malformed entry
refused in one line that names the phase and what to write instead, and the schedule checked against the groups."""

import math

import pytest

from mmidx.config.schedule import PhaseConfig, check_schedule, parse_schedule


def refused(call, message):
    """``call()`` raises ValueError whose text is exactly ``message``."""
    with pytest.raises(ValueError) as error:
        call()
    assert str(error.value) == message


def test_a_phase_holds_its_weights_as_names_and_floats_and_a_missing_group_weighs_0():
    phase = PhaseConfig(((1, 2), ("edit", 0)), until_packs=10)
    assert phase.weights == (("1", 2.0), ("edit", 0.0))
    assert all(type(name) is str and type(weight) is float for name, weight in phase.weights)
    assert phase.weight_of("1") == 2.0 and phase.weight_of("edit") == 0.0 and phase.weight_of("vlm") == 0.0
    assert (phase.until_packs, phase.until_tokens) == (10, None)


@pytest.mark.parametrize("weight", [-1.0, -1e-9, math.inf, math.nan])
def test_a_weight_below_0_or_not_finite_is_refused(weight):
    refused(lambda: PhaseConfig((("t2i", 1.0), ("edit", weight))),
            f"schedule: weight of 'edit' must be finite and >= 0, got {float(weight)}")


def test_a_phase_of_zero_weights_only_is_refused_and_one_positive_weight_is_enough():
    refused(lambda: PhaseConfig((("t2i", 0.0), ("edit", 0.0))),
            "schedule: a phase needs at least one group of positive weight")
    assert PhaseConfig((("t2i", 0.0), ("edit", 1e-9))).weight_of("edit") == 1e-9


@pytest.mark.parametrize("key", ["until_packs", "until_tokens"])
@pytest.mark.parametrize("value", [True, False, 0, -3, 1.5])
def test_a_limit_that_is_not_a_positive_integer_is_refused(key, value):
    refused(lambda: PhaseConfig((("t2i", 1.0),), **{key: value}),
            f"schedule: until {key[6:]} must be a positive integer, got {value!r}")


@pytest.mark.parametrize("key", ["until_packs", "until_tokens"])
def test_a_limit_of_1_or_a_whole_float_is_accepted(key):
    assert getattr(PhaseConfig((("t2i", 1.0),), **{key: 1}), key) == 1
    assert getattr(PhaseConfig((("t2i", 1.0),), **{key: 4.0}), key) == 4


def test_a_schedule_parses_into_its_phases_in_order():
    phases = parse_schedule([{"until": {"packs": 5}, "weights": {"t2i": 1, "vlm": 2}},
                             {"until": {"tokens": 900}, "weights": {"vlm": 1}},
                             {"weights": {"t2i": 3}}])
    assert phases == (PhaseConfig((("t2i", 1.0), ("vlm", 2.0)), until_packs=5),
                      PhaseConfig((("vlm", 1.0),), until_tokens=900), PhaseConfig((("t2i", 3.0),)))
    assert parse_schedule(None) == ()


ENTRY = ("schedule phase 1: needs weights: {group: weight} and, except the last, until: {packs: N} or "
         "{tokens: N}; no other keys")


@pytest.mark.parametrize("entries, message", [
    ([], "schedule must be a non-empty list of phases, each {until: {packs: N}, weights: {...}}"),
    ({"weights": {"t2i": 1}}, "schedule must be a non-empty list of phases, each {until: {packs: N}, weights: {...}}"),
    ([{"weights": {"t2i": 1}}, "weights"], ENTRY),
    ([{"weights": {"t2i": 1}}, {"until": {"packs": 3}}], ENTRY),
    ([{"weights": {"t2i": 1}}, {"weights": {"t2i": 1}, "after": {"packs": 3}}], ENTRY),
    ([{"weights": {"t2i": 1}}, {"until": 3, "weights": {"t2i": 1}}],
     "schedule phase 1: until must be {packs: N} or {tokens: N}, got 3"),
    ([{"weights": {"t2i": 1}}, {"until": {"packs": 3, "tokens": 9}, "weights": {"t2i": 1}}],
     "schedule phase 1: until must be {packs: N} or {tokens: N}, got {'packs': 3, 'tokens': 9}"),
    ([{"weights": {"t2i": 1}}, {"until": {"samples": 3}, "weights": {"t2i": 1}}],
     "schedule phase 1: until must be {packs: N} or {tokens: N}, got {'samples': 3}"),
    ([{"weights": {"t2i": 1}}, {"weights": [["t2i", 1]]}],
     "schedule phase 1: weights must map group names to weights"),
    ([{"weights": {"t2i": 1}}, {"weights": {"t2i": -2}}],
     "schedule phase 1: weight of 't2i' must be finite and >= 0, got -2.0"),
    ([{"weights": {"t2i": 1}}, {"weights": {"t2i": "lots"}}],
     "schedule phase 1: could not convert string to float: 'lots'"),
    ([{"weights": {"t2i": 1}}, {"until": {"packs": 0}, "weights": {"t2i": 1}}],
     "schedule phase 1: until packs must be a positive integer, got 0"),
])
def test_a_malformed_schedule_is_refused_in_one_line_naming_the_phase(entries, message):
    refused(lambda: parse_schedule(entries), message)


NAMES = ["t2i", "edit", "vlm"]


def phases(*limits):
    return tuple(PhaseConfig((("t2i", 1.0),), **limit) for limit in limits)


def test_a_schedule_of_known_groups_with_growing_limits_and_an_open_last_phase_is_accepted():
    check_schedule(phases({"until_packs": 1}, {"until_tokens": 5}, {"until_packs": 2}, {}), NAMES)
    check_schedule(phases({}), NAMES)


@pytest.mark.parametrize("schedule, message", [
    ((PhaseConfig((("t2i", 1.0), ("video", 1.0), ("audio", 0.0)), until_packs=3), PhaseConfig((("t2i", 1.0),))),
     "schedule phase 0: unknown groups ['audio', 'video']; the groups are ['t2i', 'edit', 'vlm']"),
    (phases({"until_packs": 3}, {"until_packs": 5}),
     "schedule phase 1: the last phase is open-ended; drop its until"),
    (phases({"until_tokens": 3}),
     "schedule phase 0: the last phase is open-ended; drop its until"),
    (phases({"until_packs": 3}, {}, {}),
     "schedule phase 1: every phase but the last needs until: {packs: N} or {tokens: N}"),
    (phases({"until_packs": 3}, {"until_tokens": 10}, {"until_packs": 3}, {}),
     "schedule: until packs must grow from phase to phase (counted from the run's start), got [3, 3]"),
    (phases({"until_tokens": 30}, {"until_tokens": 10}, {}),
     "schedule: until tokens must grow from phase to phase (counted from the run's start), got [30, 10]"),
])
def test_a_schedule_the_groups_cannot_run_is_refused_in_one_line(schedule, message):
    refused(lambda: check_schedule(schedule, NAMES), message)

