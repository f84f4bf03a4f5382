"""Accelerator utilisation (mmidx bench --au): the accounting, exact on scripted loaders in virtual time; the dry run
against a real run of two gloo ranks; the demand's throughput and calibration file; the command's report."""

import json
import threading

import numpy as np
import pytest
import yaml
from support.packs import write_data_config

from mmidx.cli import main
from mmidx.config import DataConfig
from mmidx.index.accelerator import MODELS, DemandError, demand, read_calibration, write_calibration
from mmidx.index.cost import QWEN2_1_5B, QWEN2_7B
from mmidx.toolkit.au import Received, WorkerClocks, dry_run, rank_packs, run_steps, summarize
from mmidx.toolkit.au_bench import bench_au, format_au
from mmidx.train.shares import GlobalBatchSampler


class VirtualWorld:
    """Ranks in threads, each with its own virtual clock: a scripted loader advances it by each batch's delay, a
    sleep by the time asked (plus an overshoot), and the all-reduce sets every rank's clock to the last arrival's,
    as a real barrier does. Nothing is timed on a real clock, so every figure is exact."""

    def __init__(self, ranks: int, overshoot: list[float]):
        self.clocks, self.overshoot = [0.0] * ranks, overshoot
        self.arrived, self.votes = [0.0] * ranks, [0] * ranks
        self.barrier = threading.Barrier(ranks)

    def run(self, scripts: list[list[tuple[float, Received]]], *, warmup: int, steps: int, deadline: float = 1e9):
        """Each rank: ``warmup`` steps, then ``steps`` measured (seconds = FLOPs); returns its measured steps."""
        measured, stopped = [None] * len(scripts), [None] * len(scripts)

        def rank(r: int) -> None:
            def batches():
                for delay, batch in scripts[r]:
                    self.clocks[r] += delay
                    yield batch

            def sleep(seconds: float) -> None:
                self.clocks[r] += seconds + self.overshoot[r]

            def all_reduce(vote: int) -> int:
                self.arrived[r], self.votes[r] = self.clocks[r], vote
                self.barrier.wait()
                leave, answer = max(self.arrived), max(self.votes)
                self.barrier.wait()  # everyone has read before anyone arrives at the next one
                self.clocks[r] = leave
                return answer

            options = {"all_reduce": all_reduce, "deadline": deadline, "clock": lambda: self.clocks[r],
                       "sleep": sleep}
            feed = batches()
            _, early = run_steps(feed, warmup, float, **options)
            measured[r], stopped[r] = run_steps(feed, 0 if early else steps, float, **options)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(scripts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        return measured, stopped


def test_the_accounting_is_exact_on_a_scripted_loader_with_known_delays():
    # a warm-up step that takes 100 s, then three measured steps. Worked by hand (seconds = FLOPs):
    # step 1: rank 0 waits 1 for its batch, computes 2 (ready 1, done 3); rank 1 computes 1 + 0.5 overshoot (1.5);
    #         all leave at 3: waits 0 and 1.5
    # step 2: from 3, rank 0 done at 5, rank 1 at 3 + 4.5 = 7.5: waits 2.5 and 0
    # step 3: from 7.5, rank 0 waits 3 (ready 10.5) and is done at 12.5, rank 1 at 7.5 + 2.5 = 10: waits 0 and 2.5
    # rank 0: stall 4, compute 6, wait 2.5, wall 12.5 (au 0.48); rank 1: compute 7, slept 8.5, wait 4 (au 0.56)
    warm = (100.0, Received(999, 50.0, 9.0, None, None))
    scripts = [[warm, (1.0, Received(100, 2.0, 0.25, None, None)), (0.0, Received(200, 2.0, 0.25, 0.5, 0.25)),
                (3.0, Received(300, 2.0, 0.25, 1.0, 0.75))],
               [warm, (0.0, Received(400, 1.0, 0.25, 1.5, 1.0)), (0.0, Received(500, 4.0, 0.25, 0.5, 0.5)),
                (0.0, Received(600, 2.0, 0.25, 0.5, 0.5))]]
    measured, stopped = VirtualWorld(2, overshoot=[0.0, 0.5]).run(scripts, warmup=1, steps=3)
    assert stopped == [False, False]
    assert [[s.stall_s for s in rank] for rank in measured] == [[1.0, 0.0, 3.0], [0.0, 0.0, 0.0]]
    assert [[s.wait_s for s in rank] for rank in measured] == [[0.0, 2.5, 0.0], [1.5, 0.0, 2.5]]
    report = summarize(measured, max_num_tokens=1000)
    assert report["au_per_rank"] == [6 / 12.5, 7 / 12.5]
    assert report["au"] == pytest.approx(0.52, abs=1e-15)
    assert (report["wall_s"], report["compute_s"], report["data_stall_s"]) == (12.5, 6.5, 2.0)
    assert (report["balance_wait_s"], report["other_s"], report["steps"]) == (3.25, 0.75, 3)
    assert report["fill"] == 2100 / 6000
    # the first pack's worker CPU is unknown (it holds the worker's start)
    assert report["cpu_s_per_pack"] == {"workers": 0.8, "build": 0.6, "trainer": 0.25, "total": 1.05}
    assert report["packs_per_s_per_accelerator"] == pytest.approx(6 / 13, abs=1e-15)
    assert report["cores_per_accelerator"] == pytest.approx(1.05 * 6 / 13, abs=1e-15)


def test_ranks_stop_together_when_one_passes_its_deadline_or_runs_out_of_batches():
    batch = Received(10, 1.0, 0.0, 0.0)
    late = [[(0.0, batch)] * 5, [(0.0, batch), (50.0, batch)] + [(0.0, batch)] * 3]
    measured, stopped = VirtualWorld(2, overshoot=[0.0, 0.0]).run(late, warmup=0, steps=5, deadline=20.0)
    assert stopped == [True, True] and [len(rank) for rank in measured] == [2, 2]  # step 2 passed it: kept; all stop
    short = [[(0.0, batch)] * 5, [(0.0, batch)] * 2]  # rank 1 runs out at step 3: every rank drops it and stops
    measured, stopped = VirtualWorld(2, overshoot=[0.0, 0.0]).run(short, warmup=0, steps=5)
    assert stopped == [True, True] and [len(rank) for rank in measured] == [2, 2]


def test_worker_clocks_give_each_pack_the_cpu_since_the_same_workers_last_one():
    clocks = WorkerClocks()
    assert clocks.cost(None) == (0.0, 0.0)  # built in the rank's process: its trainer CPU holds it
    assert clocks.cost((0, 10.0, 4.0)) == (None, None)  # a worker's first pack: its start is in it
    assert clocks.cost((1, 3.0, 2.0)) == (None, None)
    assert clocks.cost((0, 10.5, 4.25)) == (0.5, 0.25) and clocks.cost((1, 4.0, 2.5)) == (1.0, 0.5)
    worker, process, thread = WorkerClocks.stamp(7)
    assert worker == 7 and process >= thread >= 0


def test_a_dry_run_waits_for_the_dearest_pack_of_each_micro_step():
    compute = np.array([[2.0, 1.0], [2.0, 4.0], [2.0, 2.0]])  # [step, rank]
    report = dry_run(compute, np.full((3, 2), 500), compute, max_num_tokens=1000)
    assert report["au_per_rank"] == [6 / 8, 7 / 8] and report["au"] == 0.8125
    assert (report["wall_s"], report["data_stall_s"], report["balance_wait_s"], report["fill"]) == (8.0, 0.0, 1.5, 0.5)
    assert report["cpu_s_per_pack"]["workers"] is None and report["cores_per_accelerator"] is None


def test_rank_packs_are_the_loaders_own_samplers_packs():
    costs = np.random.default_rng(3).random(64)
    packs = rank_packs(64, 16, 4, first_step=3, steps=6, pack_costs=costs)
    for rank in range(4):
        sampler = GlobalBatchSampler(64, global_batch_size=16, rank=rank, world_size=4, pack_costs=costs)
        assert packs[:, rank].tolist() == list(sampler)[3:9]
    assert sorted(rank_packs(64, 16, 4, 0, 16).ravel().tolist()) == list(range(64))  # every pack once


def test_tokens_per_second_mean_the_configs_average_pack():
    accelerator = demand("qwen2-7b", 2.0e10, tokens_per_s=1000.0)
    # a pack of the mean cost per token and 3,000 tokens takes 3 s; twice the FLOPs, twice the time
    assert accelerator.seconds(3000 * 2.0e10) == pytest.approx(3.0) and accelerator.geometry == QWEN2_7B
    default = demand("qwen2-7b", 2.0e10, attention="flex")
    assert default.tokens_per_s == 5615.0 and "torchtitan#1884" in default.source
    assert demand("qwen2-7b", 2.0e10, attention="sdpa").tokens_per_s == 9600.0
    small = demand("qwen2-1.5b", 1.0e10, attention="sdpa")
    ratio = QWEN2_7B.linear_flops_per_token / QWEN2_1_5B.linear_flops_per_token
    assert small.tokens_per_s == pytest.approx(9600 * ratio) and 4.9 < ratio < 5.0
    assert MODELS["qwen2-1.5b"].geometry == QWEN2_1_5B
    with pytest.raises(DemandError, match="unknown model"):
        demand("llama", 1e10)


def test_a_calibration_file_round_trips_and_is_refused_for_another_layer(tmp_path):
    path = tmp_path / "calibration.json"
    write_calibration(path, 2.5e-15, QWEN2_7B, attention="flex", device="NVIDIA H100", packs=150)
    fields = read_calibration(path, QWEN2_7B)
    assert fields["seconds_per_flop"] == 2.5e-15 and fields["device"] == "NVIDIA H100"
    accelerator = demand("qwen2-7b", 4e10, calibration=path)
    assert accelerator.seconds_per_flop == 2.5e-15 and accelerator.tokens_per_s == pytest.approx(1 / (2.5e-15 * 4e10))
    with pytest.raises(DemandError, match="measured on a layer of"):
        demand("qwen2-1.5b", 4e10, calibration=path)
    text = json.loads(path.read_text())
    for field, value, message in (("format", "x", "not a calibration file"), ("version", 2, "version 2"),
                                  ("seconds_per_flop", -1, "positive"), ("seconds_per_flop", True, "positive"),
                                  ("attention", "ring", "attention")):
        path.write_text(json.dumps({**text, field: value}))
        with pytest.raises(DemandError, match=message):
            read_calibration(path, QWEN2_7B)
    path.write_text("{")
    with pytest.raises(DemandError, match="not JSON"):
        read_calibration(path, QWEN2_7B)


@pytest.fixture(scope="module")
def small_config(tmp_path_factory):
    """The small t2i + vlm stream of the loader tests, CFG dropout 0.3: the dry run prices each pack after dropout as
    the loader builds it, so a real run's modelled compute is the dry run's, step for step."""
    return write_data_config(tmp_path_factory.mktemp("au"))


def test_the_dry_run_agrees_with_a_real_run_of_two_gloo_ranks(small_config):
    # packs of ~150 tokens after CFG dropout at 80 tokens/s: micro-steps of ~2 s, which one worker per rank feeds
    # easily; long enough that a loaded machine's scheduling delays (tens of ms when it runs 8 jobs on 2 cores) stay
    # small beside them
    options = {"world_size": 2, "model": "qwen2-1.5b", "tokens_per_s": 80.0, "runs": 2, "steps": 3, "warmup": 1}
    config = DataConfig.from_yaml(small_config)
    real = bench_au(config, workers=1, **options)
    dry = bench_au(config, dry=True, **options)
    for measured, modelled in zip(real["runs"], dry["runs"], strict=True):
        assert measured["steps"] == modelled["steps"] == 3
        # the same packs on the same ranks: the modelled compute is the dry run's to the last bit of rounding
        assert measured["compute_s"] == pytest.approx(modelled["compute_s"], rel=1e-12)
        assert measured["fill"] == pytest.approx(modelled["fill"], rel=1e-12)
        # a real rank can only lose time: each micro-step lasts at least as long as its dearest pack
        assert measured["dry_au"] == measured["balance_au"] == modelled["au"]
        assert measured["au"] <= modelled["au"] + 1e-9 and measured["au"] > modelled["au"] - 0.06, measured
        parts = measured["compute_s"] + measured["data_stall_s"] + measured["balance_wait_s"] + measured["other_s"]
        assert parts == pytest.approx(measured["wall_s"], rel=1e-9)
        cpu = measured["cpu_s_per_pack"]
        assert cpu["workers"] >= cpu["build"] > 0 and cpu["trainer"] > 0
    assert real["au"] <= dry["au"] + 1e-9 and real["au"] > dry["au"] - 0.06


def test_an_impossible_demand_gives_a_low_au_without_a_hang(small_config, capsys):
    assert main(["bench", str(small_config), "--au", "--world-size", "2", "--workers", "1", "--runs", "1",
                 "--steps", "3", "--warmup", "1", "--tokens-per-s", "1e9", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("au", "data_stall_s", "balance_wait_s", "fill", "cpu_s_per_pack", "cores_per_accelerator"):
        assert key in result, key
    assert result["au"] < 0.5 and not result["passes"] and result["runs"][0]["steps"] == 3
    assert "au" in format_au(result) and "does not pass" in format_au(result)


def test_a_dry_run_takes_its_demand_from_a_calibration_file(small_config, tmp_path, capsys):
    calibration = tmp_path / "calibration.json"
    write_calibration(calibration, 3e-15, QWEN2_7B, attention="flex", device="NVIDIA H100")
    assert main(["bench", str(small_config), "--au", "--dry", "--world-size", "4", "--runs", "1", "--calibration",
                 str(calibration), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["demand"]["seconds_per_flop"] == 3e-15 and str(calibration) in result["demand"]["source"]
    run = result["runs"][0]
    assert run["compute_s"] == pytest.approx(run["wall_s"] - run["balance_wait_s"]) and run["data_stall_s"] == 0


def test_the_tight_policy_wastes_less_accelerator_time_at_scale_than_bagels(small_config, tmp_path):
    spec = yaml.safe_load(small_config.read_text())
    results = {}
    for policy in ("bagel", "tight"):
        spec["packing"]["policy"] = policy
        path = small_config.parent / f"{policy}.yaml"
        path.write_text(yaml.safe_dump(spec))
        results[policy] = bench_au(DataConfig.from_yaml(path), dry=True, world_size=16, runs=1, steps=4,
                                   cache_dir=tmp_path)
    assert results["tight"]["au"] > results["bagel"]["au"] and results["tight"]["fill"] > results["bagel"]["fill"]


def test_a_dry_run_shows_its_progress_and_deals_each_global_batch_once(small_config, capsys, monkeypatch):
    """Issue 55, item 5: a dry run at a large world size says on stderr how far it is, and its cost is linear in the
    world size: each global batch is dealt once for all ranks, not once per rank."""
    deals = []
    original = GlobalBatchSampler.deal
    monkeypatch.setattr(GlobalBatchSampler, "deal", lambda self, batch: deals.append(batch) or original(self, batch))
    assert main(["bench", str(small_config), "--au", "--dry", "--world-size", "64", "--runs", "2", "--steps", "8",
                 "--warmup", "0"]) == 0
    err = capsys.readouterr().err
    assert "pack index:" in err and "dry run 1/2: au" in err and "dry run 2/2: au" in err
    assert len(deals) == 16  # 2 runs × 8 micro-steps, one global batch each (8 per rank): one deal per step


@pytest.mark.parametrize(("options", "status", "message"), [
    (["--masks", "none"], 2, "--masks flex or dense"),
    (["--workers", "1,2"], 2, "one worker count"),
    (["--tokens-per-s", "5", "--calibration", "x.json"], 2, "not both"),
    (["--world-size", "3", "--global-batch-size", "4"], 1, "--global-batch-size (4) must be a multiple of"),
    (["--calibration", "/nonexistent/calibration.json"], 1, "/nonexistent/calibration.json"),
])
def test_bad_au_options_are_one_line(small_config, capsys, options, status, message):
    try:
        code = main(["bench", str(small_config), "--au", "--dry", *options])
    except SystemExit as exit:  # argparse's usage errors
        code = exit.code
    error = capsys.readouterr().err
    assert code == status and message in error and "Traceback" not in error
    assert len(error.strip().splitlines()) == 1 or error.splitlines()[0].startswith("usage:")
