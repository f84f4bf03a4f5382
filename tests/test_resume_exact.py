"""Exactly the data the history says: what the loaders hand out across resumes, mixture edits (inside a global
batch too), world sizes and balanced steps is the pack stream of the run's mixture history, pack for pack; a
state refuses to continue another stream, in one line naming what differs."""

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.packing import GEOMETRY, build_groups

from mmidx.cli import main
from mmidx.config import DataConfig
from mmidx.index.history import MixtureHistory, resumed_history, takeover_pack
from mmidx.index.pack_costs import PackCosts
from mmidx.index.pack_index import build_pack_index
from mmidx.pack.builder import PackBuilder
from mmidx.read.dataset import MMIDXDataset
from mmidx.train.loader import PackDataset, PackLoader
from mmidx.train.state import LoaderStateError

PACKING = {"max_num_tokens": 400, "expected_num_tokens": 300, "max_num_tokens_per_sample": 400,
           "prefer_buffer_before": 100, "max_buffer_size": 4}
NUM_SAMPLES = 600


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    return build_groups(tmp_path_factory.mktemp("exact"))  # t2i (mandatory), edit, vlm


def config_of(groups, weights=(1.0, 1.0, 1.0), **more):
    weighted = {name: {**spec, "weight": w} for (name, spec), w in zip(groups.items(), weights, strict=True)}
    return DataConfig.from_dict({"groups": weighted, "geometry": GEOMETRY, "seed": 3,
                                 "packing": {**PACKING, **more.pop("packing", {})}, **more})


class ItemsBuilder:
    """A PackBuilder stand-in: the "batch" of pack k is (k, its items), what the loader handed out, cheaply."""

    datasets = ()

    def build(self, pack, items):
        return pack, tuple(items)


def train(index, world_size, global_batch_size, steps=None, state=None, *, balanced=False, builder=None):
    """Every rank's loader over ``index`` (resumed from ``state``) for ``steps`` micro-steps (None: to the end):
    ({pack: [what each time it was handed out]}, the state every rank saved after)."""
    trained, states = {}, []
    costs = PackCosts(index) if balanced else None  # each global batch priced after CFG dropout as dealt
    for rank in range(world_size):
        loader = PackLoader(PackDataset(index, builder or ItemsBuilder()), global_batch_size=global_batch_size,
                            rank=rank, world_size=world_size, pack_costs=costs)
        if state is not None:
            loader.load_state_dict(state)
        packs = iter(loader.sampler())  # the pack numbers of the batches it hands out, in order
        for _, batch in zip(range(len(loader) if steps is None else steps), loader, strict=False):
            pack = next(packs)
            if builder is None:  # what the dataset was asked to build
                assert batch[0] == pack
            trained.setdefault(pack, []).append(batch[1] if builder is None else batch.packed_text_ids.tolist())
        states.append(loader.state_dict())
    assert all(s == states[0] for s in states)  # the same on every rank
    return trained, states[0]


def assert_each_epoch_walked_once(index):
    """Over the whole stream each group delivers every sample taken // n or taken // n + 1 times, the latter
    exactly taken % n of them: no sample repeated or skipped within an epoch."""
    counts = [{} for _ in index.config.groups]
    for pack in range(len(index)):
        for item in index.items(pack):
            counts[item.group][item.dataset, item.sample] = counts[item.group].get((item.dataset, item.sample), 0) + 1
    assert index.stats["excluded"] == 0  # with these budgets every sample fits
    for group, config in enumerate(index.config.groups):
        n = sum(len(MMIDXDataset(prefix)) for prefix in config.datasets)
        delivered = np.array(list(counts[group].values()) + [0] * (n - len(counts[group])))
        taken = int(delivered.sum())
        assert set(np.unique(delivered)) <= {taken // n, taken // n + 1}, (group, delivered)
        assert int((delivered == taken // n + 1).sum()) == taken % n, (group, delivered)


def test_an_edit_saved_15_micro_steps_into_world_4_trains_step_7_as_the_history_index_holds_it(groups, tmp_path):
    """The issue's case: G = 8, world 4, contiguous shares; after 15 micro-steps each rank has trained the first
    pack of its share of global step 7 (packs 56, 58, 60, 62). The edited weights take over at pack 64, so the
    rest of step 7 (57, 59, 61, 63) are the old config's packs too, as the history's index holds them."""
    history = tmp_path / "mixture_history.json"
    old = config_of(groups)
    resumed_history(history, old, 0)
    index = build_pack_index(old, num_samples=NUM_SAMPLES, progress=False)
    first, state = train(index, 4, 8, steps=15, builder=PackBuilder(old))
    assert state["packs_consumed"] == 60 and sorted(first)[-4:] == [56, 58, 60, 62]
    edited = config_of(groups, weights=(6.0, 1.0, 0.2))
    recorded = resumed_history(history, edited, state)
    assert [k for k, _ in recorded.takeovers] == [0, 64]
    resumed = build_pack_index(recorded, num_samples=NUM_SAMPLES, progress=False)
    rest, _ = train(resumed, 4, 8, state=state, builder=PackBuilder(edited))
    assert sorted(rest)[:4] == [57, 59, 61, 63]

    cache = tmp_path / "cache"
    assert main(["index", "--history", str(history), "--num-samples", str(NUM_SAMPLES), "--cache-dir", str(cache)]) == 0
    said = build_pack_index(MixtureHistory.load(history), num_samples=NUM_SAMPLES, cache_dir=cache, progress=False)
    assert said.reused  # the command's index
    trained = {**first, **rest}
    assert sorted(trained) == list(range(len(said) // 8 * 8))  # every pack once, none outside the index
    builder = PackBuilder(recorded.config)
    step_7 = [pack for pack in range(56, 64) if trained[pack] == [builder.build(pack, said.items(pack)).packed_text_ids
                                                                   .tolist()]]
    assert step_7 == list(range(56, 64))  # 8 of 8
    assert all(trained[pack] == [builder.build(pack, said.items(pack)).packed_text_ids.tolist()] for pack in trained)
    unedited = build_pack_index(old, num_samples=NUM_SAMPLES, progress=False)
    assert [said.items(k) for k in range(64)] == [unedited.items(k) for k in range(64)]
    assert any(said.items(k) != unedited.items(k) for k in range(64, len(said)))  # and the edit took effect


@st.composite
def schedules(draw, num_groups=3):
    """A data YAML's schedule: 1-3 phases, limits in packs or tokens, weights of 0 or more (one positive)."""
    count = draw(st.integers(1, 3))
    limits = sorted(draw(st.lists(st.integers(5, 70), min_size=count - 1, max_size=count - 1, unique=True)))
    names = ["t2i", "edit", "vlm"]
    phases = []
    for number in range(count):
        weights = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 3.0]), min_size=num_groups, max_size=num_groups))
        if not any(weights):
            weights[draw(st.integers(0, num_groups - 1))] = 1.0
        phase = {"weights": dict(zip(names, weights, strict=True))}
        if number < count - 1:
            phase["until"] = {"tokens": limits[number] * 300} if draw(st.booleans()) else {"packs": limits[number]}
        phases.append(phase)
    return phases


def divisors(n):
    return [w for w in range(1, n + 1) if n % w == 0]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_what_the_loaders_trained_across_edits_is_the_history_index_pack_for_pack(groups, data):
    """Random schedules and packing policy, global batch and world size, balanced steps or not, one or two edits
    of the mixture at random checkpoints (inside a global batch too; another world size where the state allows
    it): every pack of the history's index up to the last whole global batch was handed out exactly once, with
    the index's items, and the stream walks each group's epochs once."""
    packing = {"policy": data.draw(st.sampled_from(["bagel", "tight"])), "window": data.draw(st.integers(2, 16))}
    config = config_of(groups, schedule=data.draw(schedules()), packing=packing)
    global_batch_size = data.draw(st.sampled_from([1, 2, 4, 8]))
    world_size = data.draw(st.sampled_from(divisors(global_batch_size)))
    balanced = data.draw(st.booleans())
    with tempfile.TemporaryDirectory() as folder:
        history = Path(folder) / "mixture_history.json"
        index = build_pack_index(resumed_history(history, config, 0), num_samples=NUM_SAMPLES, progress=False)
        trained, state = {}, None
        for _ in range(data.draw(st.integers(1, 2))):
            total = len(index) // global_batch_size * (global_batch_size // world_size)
            steps = data.draw(st.integers(0, total - state["packs_consumed"] // world_size if state else total))
            done, state = train(index, world_size, global_batch_size, steps, state, balanced=balanced)
            for pack, contents in done.items():
                trained.setdefault(pack, []).extend(contents)
            config = config_of(groups, schedule=data.draw(schedules()), packing=packing)
            index = build_pack_index(resumed_history(history, config, state), num_samples=NUM_SAMPLES, progress=False)
            if state["packs_consumed"] % global_batch_size == 0:  # at an optimizer step any world size resumes
                world_size = data.draw(st.sampled_from(divisors(global_batch_size)))
        done, _ = train(index, world_size, global_batch_size, None, state, balanced=balanced)
        for pack, contents in done.items():
            trained.setdefault(pack, []).extend(contents)
        said = build_pack_index(MixtureHistory.load(history), num_samples=NUM_SAMPLES, progress=False)
    assert sorted(trained) == list(range(len(said) // global_batch_size * global_batch_size))
    assert all(trained[pack] == [tuple(said.items(pack))] for pack in trained)
    assert_each_epoch_walked_once(said)


def test_a_balanced_state_inside_a_global_batch_is_refused_by_contiguous_shares(groups):
    index = build_pack_index(config_of(groups), num_samples=NUM_SAMPLES, progress=False)
    _, state = train(index, 2, 8, steps=1, balanced=True)
    assert state["batch_consumed"] is not None
    loader = PackLoader(PackDataset(index, ItemsBuilder()), global_batch_size=8, world_size=2)
    with pytest.raises(LoaderStateError, match=r"deals to other micro-steps \(balanced steps on or off") as error:
        loader.load_state_dict(state)
    assert "\n" not in str(error.value)
    _, boundary = train(index, 2, 8, steps=4, balanced=True)  # at an optimizer step the deal does not matter
    loader.load_state_dict(boundary)
    assert loader.steps_consumed == 4


@pytest.mark.parametrize(("changed", "differs", "fix"), [
    ({"seed": 8}, r"the seed \(3 → 8\) differs", "resume with the config, seed and datasets"),
    ({"packing": {"max_num_tokens": 500}}, r"the config \(groups, transforms, packing budgets or geometry\) differs",
     "resume with"),
    ({"weights": (1.0, 2.0, 1.0)}, r"the mixture \(weights or schedule\) of the packs consumed differs",
     r"record a change of weights or schedule in the run's mixture history"),
    ({"num_samples": 700}, r"the stream length \(num_samples\) \(600 → 700\) differs", "resume with"),
])
def test_a_state_of_another_stream_is_refused_in_one_line_naming_what_differs(groups, changed, differs, fix):
    index = build_pack_index(config_of(groups), num_samples=NUM_SAMPLES, progress=False)
    _, state = train(index, 1, 1, steps=5)
    changed = dict(changed)  # the parameter itself stays whole for a rerun in the same process (mutmut reruns)
    num_samples = changed.pop("num_samples", NUM_SAMPLES)
    other = build_pack_index(config_of(groups, **changed), num_samples=num_samples, progress=False)
    loader = PackLoader(PackDataset(other, ItemsBuilder()), global_batch_size=1)
    with pytest.raises(LoaderStateError, match=f"the state consumed 5 packs of another stream than this loader's "
                                               f"\\({differs}\\): {fix}") as error:
        loader.load_state_dict(state)
    assert "\n" not in str(error.value) and "strict=False to continue this stream at pack 5 anyway" in str(error.value)
    assert loader.steps_consumed == 0
    with pytest.warns(UserWarning, match=f"{differs}.*continuing this stream at pack 5 as strict=False asks"):
        loader.load_state_dict(state, strict=False)
    assert next(iter(loader))[0] == 5  # the user who means it continues the other stream at pack 5


def test_other_datasets_are_named_and_where_they_lie_is_not(groups, tmp_path):
    index = build_pack_index(config_of(groups), num_samples=NUM_SAMPLES, progress=False)
    _, state = train(index, 1, 1, steps=3)
    moved = {name: {**spec, "datasets": [str(tmp_path / "moved" / Path(d).name) for d in spec["datasets"]]}
             for name, spec in groups.items()}
    (tmp_path / "moved").mkdir()
    for spec in groups.values():
        for prefix in spec["datasets"]:
            for file in Path(prefix).parent.glob(Path(prefix).name + ".*"):
                (tmp_path / "moved" / file.name).write_bytes(file.read_bytes())
    same = build_pack_index(config_of(moved), num_samples=NUM_SAMPLES, progress=False)
    PackLoader(PackDataset(same, ItemsBuilder()), global_batch_size=1).load_state_dict(state)  # the same stream
    other = build_groups(tmp_path / "photos", photo=True)  # other images: other checksums, the same config
    index = build_pack_index(config_of(other), num_samples=NUM_SAMPLES, progress=False)
    with pytest.raises(LoaderStateError, match=r"\(the datasets' contents \(checksums\) differs\)"):
        PackLoader(PackDataset(index, ItemsBuilder()), global_batch_size=1).load_state_dict(state)


def test_a_state_without_its_stream_is_read_with_a_warning_and_nothing_consumed_is_not_checked(groups):
    index = build_pack_index(config_of(groups), num_samples=NUM_SAMPLES, progress=False)
    loader = PackLoader(PackDataset(index, ItemsBuilder()), global_batch_size=2, world_size=2)
    with pytest.warns(UserWarning, match="records no stream .* resuming at pack 4 without checking"):
        loader.load_state_dict({"packs_consumed": 4, "world_size": 2})  # as mmidx saved it before
    assert loader.steps_consumed == 2
    other = build_pack_index(config_of(groups, seed=9), num_samples=NUM_SAMPLES, progress=False)
    fresh = PackLoader(PackDataset(other, ItemsBuilder()), global_batch_size=1)
    fresh.load_state_dict(train(index, 1, 1, steps=0)[1])  # nothing consumed: any stream starts there
    assert fresh.steps_consumed == 0


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, as in a 1-GPU job
def test_a_dcp_checkpoint_inside_a_global_batch_loads_and_one_of_another_seed_is_refused(groups, tmp_path):
    index = build_pack_index(config_of(groups), num_samples=NUM_SAMPLES, progress=False)
    loader = PackLoader(PackDataset(index, ItemsBuilder()), global_batch_size=2)
    next(iter(loader))  # one pack into a global batch of two: batch_consumed is a hash, a new loader's None
    dcp.save({"data": loader}, checkpoint_id=tmp_path / "step-1")
    other = build_pack_index(config_of(groups, seed=8), num_samples=NUM_SAMPLES, progress=False)
    with pytest.raises(LoaderStateError, match=r"the seed \(3 → 8\) differs"):
        dcp.load({"data": PackLoader(PackDataset(other, ItemsBuilder()), global_batch_size=2)},
                 checkpoint_id=tmp_path / "step-1")
    resumed = PackLoader(PackDataset(index, ItemsBuilder()), global_batch_size=2)
    dcp.load({"data": resumed}, checkpoint_id=tmp_path / "step-1")
    assert resumed.state_dict() == loader.state_dict() and resumed.state_dict()["batch_consumed"] is not None
    assert next(iter(resumed))[0] == 1


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_an_older_dcp_checkpoint_loaded_partially_is_warned_and_one_inside_a_batch_refused(groups, tmp_path):
    """A checkpoint of an older mmidx (no stream, no deal) loaded with allow_partial_load=True leaves the loader's
    own stream and deal in the dict DCP loads into: it is warned as load_state_dict warns, and a count inside a
    global batch is refused unless strict=False (issue 56, item 9)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    index = build_pack_index(config_of(groups), num_samples=NUM_SAMPLES, progress=False)
    partial = DefaultLoadPlanner(allow_partial_load=True)
    for consumed in (2, 1):  # at an optimizer step; one pack into a global batch of two
        dcp.save({"data": {"packs_consumed": consumed, "world_size": 1, "global_batch_size": 2}},
                 checkpoint_id=tmp_path / f"old-{consumed}")
    loader = PackLoader(PackDataset(index, ItemsBuilder()), global_batch_size=2)
    with pytest.warns(UserWarning, match="records no stream"):
        dcp.load({"data": loader}, checkpoint_id=tmp_path / "old-2", planner=partial)
    assert loader.steps_consumed == 2
    with pytest.raises(LoaderStateError, match="records no deal"):
        dcp.load({"data": PackLoader(PackDataset(index, ItemsBuilder()), global_batch_size=2)},
                 checkpoint_id=tmp_path / "old-1", planner=partial)
    with pytest.warns(UserWarning, match="records no deal"):  # the same state by hand, strict=False: continued
        loader.load_state_dict({"packs_consumed": 1, "world_size": 1, "global_batch_size": 2}, strict=False)
    assert loader.steps_consumed == 1 and next(iter(loader))[0] == 1


def resumed_index(history, config, state, cache):
    """The pack index a loader resumed from ``state`` with ``config`` trains on, as trainer_loader makes it."""
    return build_pack_index(resumed_history(history, config, state), num_samples=NUM_SAMPLES, cache_dir=cache,
                            progress=False)


@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("world_size", [1, 2])
def test_a_state_saved_at_any_position_around_an_edit_resumes_as_the_uninterrupted_run(groups, tmp_path, world_size,
                                                                                       balanced):
    """G = 4. The weights are edited at a state saved at each position of global batch 4 (packs 16-20, its
    boundaries too), so they take over at pack 20 (16 at the boundary); the edited run is then saved at each
    position up to the end of the second global batch after the takeover, and resumed with the same data.yaml
    and history: every resume is accepted and trains the packs the uninterrupted run trains after that state,
    each once (inside the first global batch after the edit too, where the state's stream names the new
    mixture). A second edit at each of those states is accepted too, and takes over at the end of its batch.
    Each run trains to the end of the third global batch after the takeover (balanced steps price every pack
    they deal: the whole stream at every resume would take seconds). It catches what the random edits of the
    property test above find by chance: a state one micro-step into the first global batch after the takeover
    naming its stream before the batch's start (state_after's ``position > 0`` as ``> 1``) is refused."""
    batch, cache = 4, tmp_path / "cache"
    per_rank = batch // world_size
    old, edited = config_of(groups), config_of(groups, weights=(6.0, 1.0, 0.2))
    for edit_steps in range(4 * per_rank, 5 * per_rank + 1):
        history = tmp_path / f"history-{edit_steps}.json"
        _, edit_state = train(resumed_index(history, old, 0, cache), world_size, batch, edit_steps,
                                   balanced=balanced)
        index = resumed_index(history, edited, edit_state, cache)
        takeover = MixtureHistory.load(history).takeovers[-1][0]
        assert takeover == -(-edit_steps * world_size // batch) * batch
        total = (takeover + 3 * batch) // world_size - edit_steps  # micro-steps from the edit to the run's end
        whole, _ = train(index, world_size, batch, total, edit_state, balanced=balanced)
        assert any(index.items(k) != build_pack_index(old, num_samples=NUM_SAMPLES, cache_dir=cache,
                                                      progress=False).items(k) for k in whole)  # the edit is used
        for steps in range(1, (takeover + 2 * batch) // world_size - edit_steps + 1):
            part, state = train(index, world_size, batch, steps, edit_state, balanced=balanced)
            resumed = resumed_index(history, edited, state, cache)
            rest, _ = train(resumed, world_size, batch, total - steps, state, balanced=balanced)
            assert not part.keys() & rest.keys()
            assert {**part, **rest} == whole, (edit_steps, steps, state["packs_consumed"])
            assert [k for k, _ in MixtureHistory.load(history).takeovers] == [0, takeover]
            again = tmp_path / "edited-again.json"  # a second edit there: it takes over where the state's batch ends
            again.write_text(history.read_text())
            second = takeover_pack(state)
            index_again = resumed_index(again, config_of(groups, weights=(1.0, 3.0, 1.0)), state, cache)
            assert [k for k, _ in MixtureHistory.load(again).takeovers] == sorted({0, takeover, second})
            rest, _ = train(index_again, world_size, batch, total - steps, state, balanced=balanced)
            assert {k: v for k, v in rest.items() if k < second} == {k: v for k, v in whole.items()
                                                                      if k < second and k not in part}
            assert all(rest[k] == [tuple(index_again.items(k))] for k in rest)
            assert any(index_again.items(k) != index.items(k) for k in rest)
