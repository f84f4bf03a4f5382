"""A run whose mixture is edited at a checkpoint: the old config up to the packs consumed, the new weights
after, recorded in a history that ``mmidx index --history`` rebuilds pack for pack; schedules in the data
YAML, their one-line errors, and duplicate datasets."""

import json

import numpy as np
import pytest
import yaml
from support.packing import GEOMETRY, SPECIAL, build_groups

from mmidx.cli import main
from mmidx.config import DataConfig
from mmidx.index.history import HistoryError, MixtureHistory
from mmidx.index.mixture import mixture_report
from mmidx.index.pack_index import build_pack_index
from mmidx.pack.builder import PackBuilder
from mmidx.toolkit.view.pages import mixture_section
from mmidx.train.bagel import LOADER_STATE_NAME, trainer_loader

PACKING = {"max_num_tokens": 400, "expected_num_tokens": 300, "max_num_tokens_per_sample": 400,
           "prefer_buffer_before": 100, "max_buffer_size": 4}


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    return build_groups(tmp_path_factory.mktemp("mixture"))  # t2i is mandatory


def write(path, groups, **more):
    path.write_text(yaml.safe_dump({"groups": groups, "geometry": GEOMETRY, "seed": 3, **more}))
    return path


def loader(config_file, history, rank, world_size, data_status=None, **packing):
    return trainer_loader(config_file, local_rank=rank, world_size=world_size, data_status=data_status,
                          special_tokens=SPECIAL, num_samples=3000, history=history, **{**PACKING, **packing})


def take(config_file, history, world_size, steps, data_status=None):
    """{pack number: packed_text_ids} of ``steps`` micro-steps of every rank, and rank 0's data_status."""
    seen, status = {}, None
    for rank in range(world_size):
        batches = loader(config_file, history, rank, world_size, data_status)
        start = 0 if data_status is None else data_status[LOADER_STATE_NAME][0]["packs_consumed"]
        for step, batch in zip(range(steps), batches, strict=False):
            seen[start + step * world_size + rank] = batch.packed_text_ids.tolist()
            if rank == 0:
                status = {item["dataset_name"]: {item["worker_id"]: item["data_indexes"]}
                          for item in batch.batch_data_indexes if item["dataset_name"] == LOADER_STATE_NAME}
    return seen, status


def test_an_edit_at_a_checkpoint_resumes_at_another_world_size_as_the_recorded_history_says(groups, tmp_path,
                                                                                              capsys):
    config_file, history = write(tmp_path / "data.yaml", groups), tmp_path / "mixture_history.json"
    first, status = take(config_file, history, world_size=4, steps=25)
    assert status[LOADER_STATE_NAME][0]["packs_consumed"] == 100
    anneal = {name: {**spec, "weight": w} for (name, spec), w in zip(groups.items(), (1.0, 0.2, 6.0), strict=True)}
    write(config_file, anneal)  # the same data.yaml, its weights edited
    second, _ = take(config_file, history, world_size=2, steps=20, data_status=status)
    assert sorted(second) == list(range(100, 140))

    recorded = MixtureHistory.load(history)
    assert [k for k, _ in recorded.takeovers] == [0, 100]
    main(["index", "--history", str(history), "--num-samples", "3000", "--cache-dir", str(tmp_path / "cache")])
    index = build_pack_index(recorded, num_samples=3000, cache_dir=tmp_path / "cache", progress=False)
    assert index.reused  # the command built it: the same cache entry
    builder = PackBuilder(recorded.config)
    for pack, text_ids in {**first, **second}.items():  # every pack the run consumed, both sides of the edit
        assert builder.build(pack, index.items(pack)).packed_text_ids.tolist() == text_ids, pack
    unedited = build_pack_index(recorded.takeovers[0][1], num_samples=3000, progress=False)
    prefix = int(unedited.arrays["pack_offsets"][100])
    np.testing.assert_array_equal(index.arrays["pack_offsets"][:101], unedited.arrays["pack_offsets"][:101])
    np.testing.assert_array_equal(index.arrays["samples"][:prefix], unedited.arrays["samples"][:prefix])
    assert any(index.items(k) != unedited.items(k) for k in range(100, 140))  # and the edit took effect

    capsys.readouterr()
    assert main(["index", "--history", str(history), "--num-samples", "3000", "--mixture", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [p["packs"][0] for p in report["phases"]] == [0, 100]
    after = report["phases"][1]["groups"]
    assert after["vlm"]["weight"] == pytest.approx(6.0 / 7.2)
    assert after["vlm"]["share"] == pytest.approx(after["vlm"]["weight"], abs=0.01)
    for name, epochs in report["epochs"].items():
        assert epochs["completed"] == len(epochs["ended_at_pack"]) == epochs["taken"] // epochs["samples"], name
        assert epochs["ended_at_pack"] == sorted(epochs["ended_at_pack"])
    drawn = mixture_section(report)  # mmidx view's drawing: a line per group, a dashed line where phase 1 starts
    assert drawn.count("<polyline") == 3 and drawn.count("stroke-dasharray") == 1
    assert "phase 1 from pack 100</title>" in drawn
    assert main(["index", "--history", str(history), "--num-samples", "3000", "--mixture"]) == 0
    text = capsys.readouterr().out
    assert "phase 1: packs [100, " in text and "epochs completed" in text

    with pytest.raises(HistoryError, match=r"changes packing, which made the 100 packs already consumed; change only"):
        loader(config_file, history, 0, 2, status, max_num_tokens=500)
    dropped = {name: spec for name, spec in anneal.items() if name != "edit"}
    with pytest.raises(HistoryError, match="changes the groups"):
        loader(write(tmp_path / "dropped.yaml", dropped), history, 0, 2, status)
    assert main(["index", "--history", str(tmp_path / "data.yaml")]) == 1  # not a history: one line
    assert "not a mixture history" in capsys.readouterr().err


def test_a_group_added_after_the_others_at_a_checkpoint_leaves_the_packs_consumed_alone(groups, tmp_path):
    """A group added at pack 40 had weight 0 before: its samples are numbered after the others' and no group's
    permutation depends on the groups after it, so the first 40 packs are the old config's, sample for
    sample; the default stream length stays the first config's."""
    packing = {"packing": PACKING, "geometry": GEOMETRY, "seed": 3}
    old = DataConfig.from_dict({"groups": {k: groups[k] for k in ("edit", "t2i")}, **packing})
    new = DataConfig.from_dict({"groups": {k: groups[k] for k in ("edit", "t2i", "vlm")}, **packing})
    history = MixtureHistory.of(old).take_over(new, 40)
    assert [k for k, _ in history.takeovers] == [0, 40]
    unedited = build_pack_index(old, num_samples=3000, progress=False)
    index = build_pack_index(history, num_samples=3000, progress=False)
    assert [index.items(k) for k in range(40)] == [unedited.items(k) for k in range(40)]
    assert any(item.group == 2 for k in range(40, len(index)) for item in index.items(k))  # it took effect
    assert build_pack_index(history, progress=False).stats["samples"] == 3 + 4  # edit's and t2i's samples
    inserted = DataConfig.from_dict({"groups": {k: groups[k] for k in ("edit", "vlm", "t2i")}, **packing})
    with pytest.raises(HistoryError, match=r"changes the groups .* add new ones after them"):
        MixtureHistory.of(old).take_over(inserted, 40)
    history.save(tmp_path / "history.json")  # a history file edited by hand is checked as well
    text = (tmp_path / "history.json").read_text()
    (tmp_path / "history.json").write_text(text.replace('"seed": 3', '"seed": 4', 1))
    with pytest.raises(HistoryError, match=r"history.json: the edited config changes seed, which made the 40 packs"):
        MixtureHistory.load(tmp_path / "history.json")


def test_the_issue_schedule_parses_and_round_trips(groups, tmp_path):
    schedule = [{"until": {"packs": 1000}, "weights": {"t2i": 1.0, "vlm": 1.0}},
                {"until": {"tokens": 2_000_000_000}, "weights": {"t2i": 1.0, "vlm": 3.0, "edit": 0}},
                {"weights": {"edit": 1.0}}]
    config = DataConfig.from_yaml(write(tmp_path / "s.yaml", groups, schedule=schedule))
    assert [g.name for g in config.groups] == ["edit", "t2i", "vlm"]  # safe_dump sorted them
    assert config.phase_weights() == [([0.0, 1.0, 1.0], 1000, None), ([0.0, 1.0, 3.0], None, 2_000_000_000),
                                      ([1.0, 0.0, 0.0], None, None)]
    assert DataConfig.from_dict(config.to_dict()) == config
    plain = DataConfig.from_yaml(write(tmp_path / "p.yaml", groups))
    assert "schedule" not in plain.describe() and "allow_duplicates" not in plain.describe()  # cache keys as before


@pytest.mark.parametrize(("schedule", "message"), [
    ([{"weights": {"t2i": 1.0}}, {"weights": {"vlm": 1.0}}], "phase 0: every phase but the last needs until"),
    ([{"until": {"packs": 5}, "weights": {"t2i": 1.0}}], "phase 0: the last phase is open-ended"),
    ([{"until": {"steps": 5}, "weights": {"t2i": 1.0}}, {"weights": {"t2i": 1}}], r"until must be \{packs: N\}"),
    ([{"weights": {"nope": 1.0}}], r"unknown groups \['nope'\]"),
    ([{"weights": {"t2i": 0}}], "at least one group of positive weight"),
    ([{"weights": {"t2i": -1}}], "must be finite and >= 0"),
    ([{"until": {"packs": 0}, "weights": {"t2i": 1}}, {"weights": {"t2i": 1}}], "positive integer"),
    ([{"until": {"packs": 9}, "weights": {"t2i": 1}}, {"until": {"packs": 9}, "weights": {"t2i": 1}},
      {"weights": {"t2i": 1}}], "must grow"),
    ([{"weights": {"t2i": 1}, "until": {"packs": 9}, "note": 1}, {"weights": {"t2i": 1}}], "no other keys"),
    ([], "non-empty list"),
])
def test_a_bad_schedule_is_one_line_saying_what_is_wrong(groups, schedule, message):
    with pytest.raises(ValueError, match=message) as error:
        DataConfig.from_dict({"groups": groups, "schedule": schedule})
    assert "\n" not in str(error.value)


def test_a_dataset_twice_is_refused_unless_allowed(groups):
    twice = {**groups, "again": {**groups["vlm"]}}
    with pytest.raises(ValueError, match=r"same checksum as .*allow_duplicates: true"):
        build_pack_index(DataConfig.from_dict({"groups": twice, "geometry": GEOMETRY}), progress=False)
    index = build_pack_index(DataConfig.from_dict({"groups": twice, "geometry": GEOMETRY, "allow_duplicates": True}),
                             progress=False)
    assert len(index) > 0


@pytest.mark.parametrize("names", [None, ("edit", "vlm")])  # edit and vlm: one view a sample, no views kept
def test_the_report_of_a_plain_index_is_one_phase_of_the_groups_weights(groups, names):
    chosen = groups if names is None else {name: groups[name] for name in names}
    config = DataConfig.from_dict({"groups": chosen, "geometry": GEOMETRY, "packing": PACKING})
    index = build_pack_index(config, num_samples=500, progress=False)
    assert ("views" in index.arrays) == (names is None)
    assert "mixture" not in index.stats  # a plain index's stats are what they always were
    report = mixture_report(index)
    (phase,) = report["phases"]
    assert phase["packs"] == [0, len(index)]
    assert sum(g["tokens"] for g in phase["groups"].values()) == index.stats["tokens"]
    assert [g["samples"] for g in phase["groups"].values()] == list(index.stats["groups"].values())
    assert all(g["weight"] == pytest.approx(1 / len(chosen)) for g in phase["groups"].values())


def test_a_schedule_of_one_phase_blends_by_its_weights_not_the_groups_weight_keys(groups):
    """As the groups of those weights without a schedule do, pack for pack (a history's index, which always
    runs the phased stream, then keeps the packs before its takeovers)."""
    weights = {"t2i": 0.5, "edit": 0.5, "vlm": 1.0}
    scheduled = DataConfig.from_dict({"groups": groups, "geometry": GEOMETRY, "packing": PACKING,
                                      "schedule": [{"weights": weights}]})
    weighted = {name: {**spec, "weight": weights[name]} for name, spec in groups.items()}
    weighted = DataConfig.from_dict({"groups": weighted, "geometry": GEOMETRY, "packing": PACKING})
    index = build_pack_index(scheduled, num_samples=600, progress=False)
    expected = build_pack_index(weighted, num_samples=600, progress=False)
    assert index.stats["groups"] == expected.stats["groups"] == {"t2i": 150, "edit": 150, "vlm": 300}
    assert [index.items(k) for k in range(len(index))] == [expected.items(k) for k in range(len(expected))]
    (phase,) = mixture_report(index)["phases"]  # and the report weighs them so
    assert [group["weight"] for group in phase["groups"].values()] == [0.25, 0.25, 0.5]
