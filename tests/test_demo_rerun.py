"""``mmidx demo`` runs again in its own folder (the README's quick start runs it after the install did): the same
summary, its corpus reused when unchanged and generated again (its datasets rebuilt) when not, and it never writes
into a folder it did not make nor deletes a file it did not generate."""

import dataclasses
import hashlib
import json
import re
from pathlib import Path

from mmidx.cli import main
from mmidx.toolkit.demo import RECORD, claim_folder, corpus_unchanged, generate_corpus
from mmidx.toolkit.synthetic import CorpusSpec

TINY = CorpusSpec(image_size=32, t2i_files=1, t2i_rows=2, edit_files=1, edit_rows=1, edit_images=2, vlm_lines=3,
                  vlm_images=3, row_group=2)


def demo(workdir: Path, capsys) -> tuple[int, list[str], str]:
    """``mmidx demo --quick --workdir WORKDIR``: exit status, printed lines, and the summary with its timings
    (``1.2 s``, ``45 ms``, ``1,234 tokens/s``) masked."""
    code = main(["demo", "--quick", "--workdir", str(workdir)])
    lines = capsys.readouterr().out.splitlines()
    summary = next((index for index, line in enumerate(lines) if line.startswith("mmidx demo in ")), len(lines))
    return code, lines, re.sub(r"\d[\d,.]* (s|ms|tokens/s)\b", "#", "\n".join(lines[summary:]))


def modified_times(folder: Path) -> dict[str, int]:
    """Each file's modification time, but data.yaml's (a config build writes it anew, with the same content)."""
    return {path.relative_to(folder).as_posix(): path.stat().st_mtime_ns
            for path in sorted(folder.rglob("*")) if path.is_file() and path.name != "data.yaml"}


def test_the_demo_runs_again_in_its_folder_with_the_same_summary(tmp_path, capsys):
    workdir = tmp_path / "mmidx-demo"
    code, lines, summary = demo(workdir, capsys)
    assert code == 0 and lines[0] == "[1/7] generating a BAGEL-format corpus..."
    assert "all datasets OK" in summary
    raw, datasets = modified_times(workdir / "raw"), modified_times(workdir / "datasets")

    # unchanged: the corpus and the datasets are reused, not one file rewritten
    code, lines, again = demo(workdir, capsys)
    assert code == 0 and again == summary
    assert lines[0] == "[1/7] reusing the BAGEL-format corpus of the last run (unchanged)..."
    assert modified_times(workdir / "raw") == raw and modified_times(workdir / "datasets") == datasets

    # a corpus file edited: the corpus is generated again (that file's bytes restored) and the datasets rebuilt
    jsonl = workdir / "raw" / "vlm" / "sft.jsonl"
    original = jsonl.read_bytes()
    jsonl.write_bytes(original + b"\n")
    code, lines, again = demo(workdir, capsys)
    assert code == 0 and again == summary, "\n".join(lines)
    assert lines[0] == "[1/7] generating a BAGEL-format corpus..."
    assert jsonl.read_bytes() == original
    rebuilt = modified_times(workdir / "datasets")
    assert rebuilt.keys() == datasets.keys() and rebuilt["vlm_sft/llava_ov.meta.json"] != \
        datasets["vlm_sft/llava_ov.meta.json"]


def test_the_demo_refuses_a_folder_it_did_not_make_and_writes_nothing(tmp_path, capsys):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("my notes")
    assert main(["demo", "--quick", "--workdir", str(folder)]) == 1
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"mmidx demo: {folder} holds files and no {RECORD}, so mmidx demo did not "
                                         "make it (or a demo older than its record did): give a new or empty folder "
                                         "as --workdir; the demo never writes into a folder of yours"]
    assert captured.out == ""
    assert [path.name for path in folder.iterdir()] == ["notes.txt"]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_corpus_of_another_spec_replaces_only_the_files_the_demo_generated(tmp_path):
    workdir, outside = tmp_path / "demo", tmp_path / "outside.txt"
    outside.write_text("not the demo's")
    assert claim_folder(workdir) is None
    generate_corpus(workdir, TINY, None)
    record = claim_folder(workdir)
    assert corpus_unchanged(workdir, TINY, record)
    assert record["files"] == {f"raw/{path.relative_to(workdir / 'raw').as_posix()}": sha256(path)
                               for path in sorted((workdir / "raw").rglob("*")) if path.is_file()}
    assert {"raw/vlm/images/img_2.jpg", "raw/tokenizer/tokenizer.json", "raw/meta.json"} <= set(record["files"])
    # files of the user's beside the demo's, and a record edited to point out of the folder
    for name in ("mine.txt", "raw/mine.txt", "raw/vlm/images/mine.jpg"):
        (workdir / name).write_text("the user's")
    record["files"]["raw/../../outside.txt"] = "0" * 64
    (workdir / RECORD).write_text(json.dumps(record))

    smaller = dataclasses.replace(TINY, vlm_images=1)
    assert not corpus_unchanged(workdir, smaller, record)
    generate_corpus(workdir, smaller, record)
    images = sorted(path.name for path in (workdir / "raw" / "vlm" / "images").iterdir())
    assert images == ["img_0.jpg", "mine.jpg"]  # img_1 and img_2 were the last corpus's: gone
    assert all((workdir / name).read_text() == "the user's" for name in ("mine.txt", "raw/mine.txt"))
    assert outside.read_text() == "not the demo's"
    record = claim_folder(workdir)
    assert record["spec"] == dataclasses.asdict(smaller) and corpus_unchanged(workdir, smaller, record)
    assert "raw/vlm/images/img_1.jpg" not in record["files"] and "raw/mine.txt" not in record["files"]


def test_a_demo_killed_before_its_corpus_was_recorded_runs_again(tmp_path):
    """The record is written first (an empty one): a folder a killed demo left is still the demo's."""
    workdir = tmp_path / "demo"
    claim_folder(workdir)
    (workdir / "raw").mkdir()
    (workdir / "raw" / "half-written.parquet").write_bytes(b"PAR1")
    record = claim_folder(workdir)
    assert record == {"format": 1, "spec": None, "files": {}}
    assert not corpus_unchanged(workdir, TINY, record)
    generate_corpus(workdir, TINY, record)
    assert corpus_unchanged(workdir, TINY, claim_folder(workdir))
