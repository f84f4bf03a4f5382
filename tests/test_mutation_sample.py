"""The mutant sample of tools/mutation_sample.py: its draw (sizes, repeatable) and its stratified estimate against
the textbook formula worked by hand, read from mutmut's result files written here."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("mutation_sample", ROOT / "tools" / "mutation_sample.py")
mutation_sample = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclass looks itself up
spec.loader.exec_module(mutation_sample)


def write_meta(folder: Path, module: str, codes: dict[str, int | None]) -> None:
    path = folder.joinpath(*module.split(".")).with_suffix(".py.meta")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"exit_code_by_key": codes}))


def test_the_draw_takes_a_fraction_of_each_module_at_least_the_minimum_and_the_same_for_the_same_seed():
    by_module = {"m.big": [f"m.big.f__mutmut_{i}" for i in range(500)], "m.small": ["m.small.f__mutmut_1"] * 1}
    first = mutation_sample.draw(by_module, 0.04, 8, seed=1)
    assert len(first["m.big"]) == 20 and set(first["m.big"]) <= set(by_module["m.big"])
    assert first["m.small"] == by_module["m.small"]  # fewer than the minimum: all of them
    assert first == mutation_sample.draw(by_module, 0.04, 8, seed=1)
    assert first != mutation_sample.draw(by_module, 0.04, 8, seed=2)


def test_a_modules_draw_is_the_same_drawn_alone_or_beside_modules_added_since():
    by_module = {f"m.{name}": [f"m.{name}.f__mutmut_{i}" for i in range(300)] for name in ("b", "d")}
    before = mutation_sample.draw(by_module, 0.04, 8, seed=48)
    added = {"m.a": [f"m.a.f__mutmut_{i}" for i in range(300)], "m.c": ["m.c.f__mutmut_1"]}
    after = mutation_sample.draw(by_module | added, 0.04, 8, seed=48)
    assert {module: after[module] for module in before} == before
    assert mutation_sample.draw({"m.d": by_module["m.d"]}, 0.04, 8, seed=48) == {"m.d": before["m.d"]}


def test_a_sample_file_is_read_by_module_and_names_its_code_no_longer_has():
    by_module = {"mmidx.a": ["mmidx.a.x_f__mutmut_1", "mmidx.a.x_f__mutmut_2"], "mmidx.b": ["mmidx.b.x_g__mutmut_1"]}
    text = ("# seed 48, drawn at abc123\nmmidx.b.x_g__mutmut_1\n\nmmidx.a.x_f__mutmut_2  # a survivor\n"
            "mmidx.a.x_gone__mutmut_3\n")
    assert mutation_sample.read_sample(text, by_module) == (
        {"mmidx.b": ["mmidx.b.x_g__mutmut_1"], "mmidx.a": ["mmidx.a.x_f__mutmut_2"]}, ["mmidx.a.x_gone__mutmut_3"])


def test_the_tally_weighs_each_module_by_its_mutants_and_leaves_equivalents_out(tmp_path):
    # module a: 100 mutants, 10 sampled: 8 killed, 1 equivalent, 1 survived; module b: 300, 20 sampled, all killed
    a = {f"a.f__mutmut_{i}": 0 for i in range(100)}
    sample_a = sorted(a)[:10]
    for name in sample_a[:8]:
        a[name] = 1
    b = {f"b.f__mutmut_{i}": 3 if i < 20 else None for i in range(300)}
    write_meta(tmp_path, "a", a)
    write_meta(tmp_path, "b", b)
    sample = {"a": sample_a, "b": [f"b.f__mutmut_{i}" for i in range(20)]}
    strata, _ = mutation_sample.tally(tmp_path, sample, {sample_a[8]})
    assert [(s.module, s.size, s.sampled, s.killed, s.equivalent) for s in strata] == [
        ("a", 100, 10, 8, 1), ("b", 300, 20, 20, 0)]
    ratio, half_width = mutation_sample.estimate(strata)
    # by hand: 1/4 × 8/9 + 3/4 × 1; variance (1/4)² × (1 − 10/100) × (8/9)(1/9) / 8, and 0 for b
    assert ratio == pytest.approx(0.25 * 8 / 9 + 0.75)
    assert half_width == pytest.approx(1.96 * math.sqrt(0.0625 * 0.9 * (8 / 81) / 8))


def test_the_tally_leaves_out_a_module_whose_sample_has_not_all_run_and_says_how_many(tmp_path):
    write_meta(tmp_path, "a", {"a.f__mutmut_1": 1, "a.f__mutmut_2": None})
    write_meta(tmp_path, "b", {"b.f__mutmut_1": 0})
    strata, not_run = mutation_sample.tally(tmp_path, {"a": ["a.f__mutmut_1", "a.f__mutmut_2"], "b": ["b.f__mutmut_1"]},
                                            set())
    assert [s.module for s in strata] == ["b"] and not_run == {"a": 1}


def test_only_the_mutants_under_an_equivalent_heading_count_as_equivalent():
    text = ("# Survivors\n\n## mutmut\n\n### Equivalent (no test can tell)\n\n- `mmidx.a.x_f__mutmut_1`: why\n\n"
            "### Survivors still to kill\n\n- `mmidx.a.x_f__mutmut_2`: what a test needs\n\n"
            "### Equivalent on the CPU\n\n- `mmidx.b.xǁCǁg__mutmut_3`: why\n")
    assert mutation_sample.equivalent_names(text) == {"mmidx.a.x_f__mutmut_1", "mmidx.b.xǁCǁg__mutmut_3"}


def test_the_results_mutmut_prints_stand_for_those_it_kept(tmp_path):
    write_meta(tmp_path, "a", {"a.f__mutmut_1": None, "a.f__mutmut_2": None, "a.f__mutmut_3": 1})
    printed = mutation_sample.printed_results("Mutant results\n--------------\n\N{PARTY POPPER} a.f__mutmut_1\n"
                                              "\N{ALARM CLOCK} a.f__mutmut_2\n")
    assert printed == {}  # module a is not under mmidx: names of the core only
    printed = mutation_sample.printed_results("\N{PARTY POPPER} mmidx.a.f__mutmut_1\n"
                                              "\N{ALARM CLOCK} mmidx.a.f__mutmut_2\n"
                                              "\N{SLIGHTLY FROWNING FACE} mmidx.a.f__mutmut_3\n")
    assert printed == {"mmidx.a.f__mutmut_1": 1, "mmidx.a.f__mutmut_2": 0, "mmidx.a.f__mutmut_3": 0}
    write_meta(tmp_path, "mmidx.a", {name: None for name in printed} | {"mmidx.a.f__mutmut_3": 1,
                                                                          "mmidx.a.f__mutmut_4": None})
    printed["mmidx.b.g__mutmut_1"] = 1  # another module's: not one of a's mutants
    [stratum], _ = mutation_sample.tally(tmp_path, {"mmidx.a": sorted(printed)[:3]}, set(), printed)
    assert (stratum.size, stratum.sampled, stratum.killed) == (4, 3, 1)  # the printed survivor wins over the kept kill
