"""chat --chat-config: seed 002's special tokens, jq loss-masking patterns and message construction."""

import json
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.sources import WORDS, build, qwen_dir, tokenizer_dir, write_jsonl

from mmidx.cli import main
from mmidx.sources import SourceContext, SourceOptions, get_source
from mmidx.sources.chat_config import checked_chat_config, default_chat_config
from mmidx.tokenizer import BAGEL_SPECIAL_TOKENS, Tokenizer

# The seed's example row and config (shared/seeds/002, "Fine-tuning Datasets"), as written there.
SEED_ROW = {"id": 0, "conversations": [
    {"from": "human", "value": "What is up?"},
    {"from": "gpt", "value": "Hello! How can I help you today?"},
    {"from": "human", "value": "Who are you?"},
    {"from": "gpt", "value": "You can call me Vicuna, and I was trained by Large Model Systems Organization (LMSYS) "
                             "researchers as a language model."},
    {"from": "human", "value": "Goodbye"},
    {"from": "gpt", "value": "Goodbye! If you have any more questions in the future, don't hesitate to ask."}],
    "instruction": "Role: Vicuna, trained by Large Model Systems Organization (LMSYS) researchers",
    "role": "Vicuna, trained by Large Model Systems Organization (LMSYS) researchers"}
SEED_CONFIG = """
special_tokens:
    bos_token: <s>
    eos_token: </s>
loss_masking_jq_patterns:
    - .conversations | select(.from == "human")
    - .instruction
    - .role
message_construction: [role, instruction, conversations]
"""
MESSAGES_ROW = {"system": "Answer briefly.", "messages": [
    {"role": "user", "content": "What is the weather?"},
    {"role": "assistant", "content": "Let me look it up."},
    {"role": "tool", "content": "sunny, 21 C"},
    {"role": "assistant", "content": "Sunny and 21 degrees."}]}
MESSAGES_CONFIG = {"special_tokens": {"eos_token": "<|im_end|>"}, "message_construction": ["system", "messages"],
                   "loss_masking_jq_patterns": [".system", '.messages | select(.role != "assistant")'],
                   "eos_after": "loss_part"}


def _plan(sample):
    return [(sample.text(e["payload"]).tolist(), e["loss"]) for e in sample.sequence_plan(0)]


def _qwen_with_bagel_tokens():
    """Qwen2's tokenizer as BAGEL loads it (its four special tokens added), straight from transformers."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(qwen_dir())
    hf.add_tokens([token for token in BAGEL_SPECIAL_TOKENS if token not in hf.get_vocab()])
    return hf


def test_the_seeds_row_and_config_give_the_expected_token_ids_and_loss_mask(tmp_path):
    config = tmp_path / "chat.yaml"
    config.write_text(SEED_CONFIG)
    path = write_jsonl(tmp_path / "chat.jsonl", [SEED_ROW])
    options = checked_chat_config(yaml.safe_load(SEED_CONFIG))
    dataset, report = build("chat", [path], tmp_path / "out", tokenizer=qwen_dir(), chat_config=options)
    assert report.ok and len(dataset) == 1
    hf = _qwen_with_bagel_tokens()
    assert len(hf.encode("<s>")) > 1 and len(hf.encode("</s>")) > 1  # Qwen2 splits both in text...
    bos, eos = hf.convert_tokens_to_ids("<s>"), hf.convert_tokens_to_ids("</s>")  # ...but its vocabulary has them
    assert bos < len(hf) and eos < len(hf)
    enc = hf.encode
    turns = SEED_ROW["conversations"]
    expected = [([bos, *enc(SEED_ROW["role"]), eos], 0), ([*enc(SEED_ROW["instruction"]), eos], 0)]
    expected += [([*enc(turn["value"]), eos], int(turn["from"] == "gpt")) for turn in turns]
    assert _plan(dataset[0]) == expected
    identity = dataset.tokenizer
    assert identity["added_tokens"] == {"<s>": bos, "</s>": eos} and identity["vocab_size"] == len(hf)
    assert dataset.metadata["build"]["options"]["chat_config"] == options


def test_a_second_schema_works_through_a_config_alone(tmp_path):
    path = write_jsonl(tmp_path / "messages.jsonl", [MESSAGES_ROW])
    dataset, report = build("chat", [path], tmp_path / "out", tokenizer=qwen_dir(), chat_config=MESSAGES_CONFIG)
    assert report.ok
    hf = _qwen_with_bagel_tokens()
    end = hf.convert_tokens_to_ids("<|im_end|>")  # already a single id: nothing is added
    turns = MESSAGES_ROW["messages"]
    expected = [(hf.encode(MESSAGES_ROW["system"]), 0)]
    expected += [(hf.encode(turn["content"]) + [end] * (turn["role"] == "assistant"), int(turn["role"] == "assistant"))
                 for turn in turns]
    assert _plan(dataset[0]) == expected
    assert dataset.tokenizer["added_tokens"] == {"<|im_end|>": end} and dataset.tokenizer["vocab_size"] == len(hf)


def test_turn_variables_keep_loss_on_the_last_answer_only(tmp_path):
    config = {**MESSAGES_CONFIG, "special_tokens": {}, "loss_masking_jq_patterns": [
        ".system", '.messages | select(.role != "assistant" or $turn < $turns - 1)']}
    path = write_jsonl(tmp_path / "messages.jsonl", [MESSAGES_ROW])
    dataset, _ = build("chat", [path], tmp_path / "out", chat_config=checked_chat_config(config))
    assert [loss for _, loss in _plan(dataset[0])] == [0, 0, 0, 0, 1]


@pytest.mark.parametrize(("eos_after", "ends"), [("part", [1, 1, 1]), ("loss_part", [0, 1, 0]), ("sample", [0, 0, 1])])
def test_eos_after_places_the_eos_token(tmp_path, eos_after, ends):
    row = {"conversations": [{"from": "human", "value": "cat"}, {"from": "gpt", "value": "dog"},
                             {"from": "human", "value": "red"}]}
    config = {"special_tokens": {"bos_token": "<|im_start|>", "eos_token": "<|endoftext|>"},
              "message_construction": ["conversations"], "eos_after": eos_after,
              "loss_masking_jq_patterns": ['.conversations | select(.from == "human")']}
    path = write_jsonl(tmp_path / "chat.jsonl", [row])
    dataset, _ = build("chat", [path], tmp_path / "out", chat_config=checked_chat_config(config))
    hf = Tokenizer(tokenizer_dir()).hf  # both are special tokens of the test tokenizer already
    eos, bos = hf.convert_tokens_to_ids("<|endoftext|>"), hf.convert_tokens_to_ids("<|im_start|>")
    plan = _plan(dataset[0])
    assert plan[0][0][0] == bos and all(bos not in tokens for tokens, _ in plan[1:])
    assert [int(tokens[-1] == eos) for tokens, _ in plan] == ends


def test_the_default_config_is_todays_chat_build_byte_for_byte(tmp_path):
    rows = [SEED_ROW, {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "user", "value": "Hi"},
                                         {"from": "assistant", "value": "Hello."}, {"from": "gpt", "value": ""}]},
            {"conversations": [{"from": "human", "value": "same"}, {"from": "gpt", "value": "same"}], "role": "same"}]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    today, _ = build("chat", [path], tmp_path / "today", extra_keys=("role", "instruction"))
    configured, _ = build("chat", [path], tmp_path / "configured",
                          chat_config=checked_chat_config(default_chat_config(("role", "instruction"))))
    for suffix in (".bin", ".idx", ".plan", ".images"):
        files = [Path(f"{prefix}{suffix}") for prefix in (today.prefix, configured.prefix)]
        assert files[0].exists() == files[1].exists()
        if files[0].exists():
            assert files[0].read_bytes() == files[1].read_bytes(), suffix
    assert "chat_config" not in today.metadata["build"]["options"]  # a build without one records what it always did


CONTEXT = SourceContext(Tokenizer(tokenizer_dir()), SourceOptions())
ROLES = ("system", "user", "assistant", "tool")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turns=st.lists(st.tuples(st.sampled_from(ROLES), st.lists(st.sampled_from(WORDS), max_size=4)),
                      min_size=1, max_size=8),
       masked=st.sets(st.sampled_from(ROLES)), system=st.none() | st.lists(st.sampled_from(WORDS), max_size=3))
def test_loss_is_on_exactly_the_parts_no_pattern_selects(turns, masked, system):
    row = {"messages": [{"role": role, "content": " ".join(words)} for role, words in turns]}
    if system is not None:
        row["system"] = " ".join(system)
    config = checked_chat_config({"message_construction": ["system", "messages"], "loss_masking_jq_patterns": [
        ".system", *(f".messages | select(.role == {json.dumps(role)})" for role in sorted(masked))]})
    parts = ([(row["system"], False)] if system is not None else [])
    parts += [(turn["content"], turn["role"] not in masked) for turn in row["messages"]]
    kept = [(CONTEXT.tokenizer.encode(text), loss) for text, loss in parts if text]
    chat = get_source("chat")
    context = SourceContext(CONTEXT.tokenizer, SourceOptions(chat_config=config))
    if not any(loss for _, loss in kept):
        with pytest.raises(Exception, match="no_loss_turn"):
            chat._sample(0, row, context)
        return
    sample = chat._sample(0, row, context)
    plan = [(sample.texts[element.payload], int(element.loss)) for element in sample.views[0]]
    assert plan == [(tokens, int(loss)) for tokens, loss in kept]


def _build_cli(folder: Path, monkeypatch, capsys, *options: str) -> tuple[int, str]:
    """``mmidx build --source chat`` of ``folder/chat.jsonl`` run in ``folder``: (exit status, stderr)."""
    monkeypatch.chdir(folder)
    try:
        status = main(["build", "--source", "chat", "--input", "chat.jsonl", "--output", "out", "--tokenizer",
                       tokenizer_dir(), "--quiet", *options])
    except SystemExit as exit:
        status = exit.code
    return status, capsys.readouterr().err


@pytest.mark.parametrize(("config", "message"), [
    ({**yaml.safe_load(SEED_CONFIG), "loss_masking": []}, "unknown key 'loss_masking'"),
    ({**yaml.safe_load(SEED_CONFIG), "loss_masking_jq_patterns": [".conversations | select(.from =="]},
     "is not valid jq"),
    ({**yaml.safe_load(SEED_CONFIG), "message_construction": ["role", "instructions", "conversations"]},
     "no row of the first 1,000 has 'instructions'"),
    ({**yaml.safe_load(SEED_CONFIG), "special_tokens": {"bos_token": " <s>"}}, "without spaces at its ends"),
    ({**yaml.safe_load(SEED_CONFIG), "eos_after": "turn"}, "eos_after is one of part, loss_part, sample"),
])
def test_a_bad_config_is_one_line_before_anything_is_built(tmp_path, monkeypatch, capsys, config, message):
    (tmp_path / "chat.yaml").write_text(yaml.safe_dump(config))
    write_jsonl(tmp_path / "chat.jsonl", [SEED_ROW])
    status, errors = _build_cli(tmp_path, monkeypatch, capsys, "--chat-config", "chat.yaml")
    assert status in (1, 2) and message in errors, errors
    assert [line for line in errors.splitlines() if message in line] == [errors.strip().splitlines()[-1]]
    assert not [path for path in tmp_path.glob("out*") if not path.name.endswith(".lock")]


def test_chat_config_and_extra_keys_are_refused_together(tmp_path, monkeypatch, capsys):
    (tmp_path / "chat.yaml").write_text(SEED_CONFIG)
    write_jsonl(tmp_path / "chat.jsonl", [SEED_ROW])
    status, errors = _build_cli(tmp_path, monkeypatch, capsys, "--chat-config", "chat.yaml", "--extra-keys", "role")
    assert status == 2 and "list the keys in the chat config's message_construction" in errors


def test_mmidx_sample_marks_which_text_carries_loss(tmp_path):
    from mmidx.toolkit.sample import LOSS_MARK, MASKED_MARK, describe_sample, format_sample

    path = write_jsonl(tmp_path / "chat.jsonl", [SEED_ROW])
    config = checked_chat_config(yaml.safe_load(SEED_CONFIG))
    build("chat", [path], tmp_path / "out", tokenizer=qwen_dir(), chat_config=config)
    lines = format_sample(describe_sample(tmp_path / "out", 0)).splitlines()
    texts = [line.strip() for line in lines if line.strip()[:1] in (LOSS_MARK, MASKED_MARK)]
    assert texts[0] == f"{MASKED_MARK} <s>{SEED_ROW['role']}</s>"
    assert texts[2] == f"{MASKED_MARK} {SEED_ROW['conversations'][0]['value']}</s>"
    assert texts[3] == f"{LOSS_MARK} {SEED_ROW['conversations'][1]['value']}</s>"
    assert [text[0] for text in texts] == [MASKED_MARK] * 3 + [LOSS_MARK, MASKED_MARK, LOSS_MARK, MASKED_MARK,
                                                                LOSS_MARK]


def test_without_the_jq_package_a_config_says_which_extra_to_install(monkeypatch):
    from mmidx.sources import chat_config

    monkeypatch.setitem(__import__("sys").modules, "jq", None)
    chat_config._program.cache_clear()
    with pytest.raises(chat_config.ChatConfigError, match=r'pip install "mmidx\[chat\]"'):
        checked_chat_config(yaml.safe_load(SEED_CONFIG))
    chat_config._program.cache_clear()
