"""How a tokenizer is named: a folder, a tokenizer.json file, an id in the Hugging Face cache, an org/name id of the
hub. A name that is none of these fails at once (well under 5 s, hub reachable or not) in one line saying where it
looked on disk and whether the hub was asked; a tokenizer.json file loads as its folder does."""

import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import huggingface_hub.constants
import pytest
from support.sources import image_bytes, qwen_dir, tokenizer_dir, write_t2i_parquet

import mmidx
from mmidx.cli import main
from mmidx.read.dataset import MMIDXDataset
from mmidx.tokenizer import HUB_TIMEOUT, Tokenizer, TokenizerError

FAST = 5.0  # seconds: the most a name that resolves nowhere may take to fail
TEXTS = ["A cat sitting on a mat", " leading space", "ünïcödé 漢字 🙂", "a<|im_start|>b<|im_end|>",
         "<|vision_start|><|vision_end|>", "multi\nline\ttext"]


class Hub:
    """A stand-in for the Hugging Face hub on 127.0.0.1 that records every request: ``missing`` answers 404
    (RepoNotFound) as the hub does for an id it does not hold, ``silent`` accepts connections and never answers,
    ``refusing`` is a closed port."""

    def __init__(self, behaviour: str):
        self.requests: list[str] = []
        self._server = self._socket = None
        if behaviour == "missing":
            requests = self.requests

            class Handler(http.server.BaseHTTPRequestHandler):
                def do_GET(self):
                    requests.append(self.path)
                    self.send_response(404)
                    self.send_header("X-Error-Code", "RepoNotFound")
                    self.send_header("Content-Type", "application/json")
                    self.end_headers()
                    self.wfile.write(b'{"error": "Repository not found"}')

                do_HEAD = do_GET

                def log_message(self, *args):
                    pass

            self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
            threading.Thread(target=self._server.serve_forever, daemon=True).start()
            port = self._server.server_address[1]
        else:
            self._socket = socket.socket()
            self._socket.bind(("127.0.0.1", 0))
            port = self._socket.getsockname()[1]
            if behaviour == "silent":
                self._socket.listen(8)  # the kernel completes connections; nobody reads or answers
            else:
                self._socket.close()
        self.url = f"http://127.0.0.1:{port}"

    def close(self):
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._socket is not None:
            self._socket.close()


@pytest.fixture
def online(monkeypatch, tmp_path):
    """Hugging Face's hub settings as on a machine without HF_HUB_OFFLINE, an empty hub cache, and a stand-in hub:
    ``online(behaviour)`` points the hub address at a new :class:`Hub`."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    hubs = []

    def start(behaviour: str) -> Hub:
        hubs.append(Hub(behaviour))
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hubs[-1].url)
        return hubs[-1]

    yield start
    for hub in hubs:
        hub.close()


def refused(name: str) -> tuple[str, float]:
    """The message of loading the tokenizer ``name`` and the seconds it took to fail."""
    start = time.perf_counter()
    with pytest.raises(TokenizerError) as error:
        Tokenizer(name)
    return str(error.value), time.perf_counter() - start


@pytest.mark.parametrize("name", ["nowhere-tok", "Qwen2-7B"])
def test_a_bare_name_that_is_no_folder_fails_at_once_without_asking_the_hub(name, online, tmp_path, monkeypatch):
    hub = online("missing")
    monkeypatch.chdir(tmp_path)
    message, seconds = refused(name)
    assert seconds < FAST
    assert hub.requests == []
    assert "\n" not in message
    assert f"no folder or file {tmp_path / name}" in message
    assert f"no model {name} in the Hugging Face cache {tmp_path / 'hf-cache'}" in message
    assert "the hub was not asked (it is asked for an org/name id only)" in message
    assert "save_pretrained('Qwen2-7B')" in message


@pytest.mark.parametrize(("behaviour", "answer"), [
    ("missing", "has no model someone/nowhere-tok that this machine may read"),
    ("silent", f"did not answer within {HUB_TIMEOUT:g} s"),
    ("refusing", "did not answer (")])
def test_an_org_name_id_the_hub_does_not_hold_fails_at_once(behaviour, answer, online):
    hub = online(behaviour)
    message, seconds = refused("someone/nowhere-tok")
    assert seconds < FAST
    assert "\n" not in message
    assert f"no folder or file {Path.cwd() / 'someone' / 'nowhere-tok'}" in message
    assert f"and the hub ({hub.url}) {answer}" in message
    # asked once for the id (huggingface_hub may add a request of its own before it)
    assert hub.requests.count("/api/models/someone/nowhere-tok") == (behaviour == "missing")


def test_offline_the_hub_is_never_asked(online, monkeypatch):
    hub = online("missing")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    message, seconds = refused("someone/nowhere-tok")
    assert seconds < FAST
    assert hub.requests == []
    assert "the hub was not asked (HF_HUB_OFFLINE is set)" in message


@pytest.mark.parametrize("name", ["Qwen2-7B/", "./tok", "/no/such/tokenizer", "a/b/c"])
def test_a_name_that_can_only_be_a_path_is_looked_for_on_disk_only(name, online):
    hub = online("missing")
    message, seconds = refused(name)
    assert seconds < FAST
    assert hub.requests == []
    assert message.startswith(f"{name}: no folder or file {os.path.abspath(name)}; tokenizer is a folder")


def test_the_command_line_says_it_in_one_line_at_once(online, tmp_path, capsys):
    online("silent")
    (tmp_path / "docs.jsonl").write_text('{"text": "hello"}\n')
    start = time.perf_counter()
    code = main(["build", "--source", "text", "--input", str(tmp_path / "docs.jsonl"), "--tokenizer",
                 "someone/nowhere-tok", "--output", str(tmp_path / "ds"), "--quiet"])
    assert time.perf_counter() - start < FAST
    assert code == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("mmidx build: someone/nowhere-tok: no folder or file ")
    assert not list(tmp_path.glob("ds*"))


def test_a_tokenizer_json_file_loads_as_its_folder_does():
    folder = Tokenizer(qwen_dir())
    file = Tokenizer(os.path.join(qwen_dir(), "tokenizer.json"))
    assert file.encode_batch(TEXTS) == folder.encode_batch(TEXTS) == [folder.hf.encode(text) for text in TEXTS]
    assert file.vocab_size == folder.vocab_size
    special = {key: value for key, value in folder.special_tokens.items() if key != "eod"}
    assert {key: file.special_tokens[key] for key in special} == special
    assert file.identity["name_or_path"].endswith("tokenizer.json")


def test_a_tokenizer_json_file_builds_from_the_command_line_and_the_python_api(tmp_path, capsys):
    """The same tokens as a build with the tokenizer's folder, by ``mmidx build`` and by ``mmidx.write``."""
    tokenizer_json = os.path.join(tokenizer_dir(), "tokenizer.json")
    source = tmp_path / "in"
    source.mkdir()
    captions = [f"a red cat number {i}" for i in range(3)]
    write_t2i_parquet(source / "t2i.parquet", [image_bytes(32, 32, seed=i) for i in range(3)],
                      [{"0": caption} for caption in captions], 3)
    for tokenizer, output in [(tokenizer_dir(), "folder"), (tokenizer_json, "cli")]:
        assert main(["build", "--source", "t2i", "--input", str(source), "--tokenizer", tokenizer,
                     "--output", str(tmp_path / output), "--quiet"]) == 0, capsys.readouterr().err
    plan = [mmidx.Element("text", 0, enable_cfg=True), mmidx.Element("vae_image", 0, loss=True)]
    report = mmidx.write(lambda i: {"texts": [captions[i]], "images": [image_bytes(32, 32, seed=i)], "views": [plan]},
                         range(3), tmp_path / "api", tokenizer=tokenizer_json, progress=False)
    assert report.ok, report.data["message"]
    expected = [[list(text) for text in sample.texts] for sample in MMIDXDataset(tmp_path / "folder")]
    assert len(expected) == 3 and all(expected)
    for output in ("cli", "api"):
        dataset = MMIDXDataset(tmp_path / output)
        assert [[list(text) for text in sample.texts] for sample in dataset] == expected
        assert dataset.metadata["tokenizer"]["name_or_path"] == tokenizer_json


def test_a_file_that_is_not_a_tokenizer_json_is_one_clear_error(tmp_path):
    (tmp_path / "notes.txt").write_text("not json\n")
    message, _ = refused(str(tmp_path / "notes.txt"))
    assert message.startswith(f"cannot load a tokenizer from the file {str(tmp_path / 'notes.txt')!r}: ")
    assert "\n" not in message


def test_an_id_in_the_hugging_face_cache_loads_without_asking_the_hub(tmp_path):
    """An org/name id whose files are in the hub cache loads from there with the hub unreachable and HF_HUB_OFFLINE
    unset (in a child process: transformers reads the cache's location when imported)."""
    cache, revision = tmp_path / "hub", "0123456789abcdef0123456789abcdef01234567"
    snapshot = cache / "models--someone--tok" / "snapshots" / revision
    shutil.copytree(tokenizer_dir(), snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(revision)
    hub = Hub("missing")
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_ENDPOINT": hub.url, "MMIDX_CACHE_DIR": str(tmp_path / "m")}
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("TRANSFORMERS_OFFLINE", None)
    code = ("import json; from mmidx.tokenizer import Tokenizer; t = Tokenizer('someone/tok'); "
            "print(json.dumps([t.vocab_size, t.encode_batch(['a red cat'])]))")
    try:
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    finally:
        hub.close()
    assert result.returncode == 0, result.stderr
    folder = Tokenizer(tokenizer_dir())
    assert json.loads(result.stdout) == [folder.vocab_size, folder.encode_batch(["a red cat"])]
    assert hub.requests == []
