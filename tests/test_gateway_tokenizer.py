"""Tokenizer, chat template, incremental detokenizer and stop strings against transformers' output."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from gateway.text.detokenizer import IncrementalDetokenizer
from gateway.text.stop_strings import StopStringMatcher
from gateway.text.tokenizer import ChatTemplateError, Tokenizer

TEXTS = [
    "Hello world",
    "  leading spaces and\ttabs\n\nnew lines",
    "日本語のテキスト",
    "émoji 🙂 mix ß ü",
    "The quick brown fox. Stop here!",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there!"}],
    [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "日本語?"},
    ],
]


@pytest.fixture(scope="module")
def pair(tok_dir):
    return Tokenizer(tok_dir), AutoTokenizer.from_pretrained(str(tok_dir))


def test_encode_decode_match_transformers(pair):
    ours, hf = pair
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text)
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
        ids = hf.encode(text)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    with_special = [hf.bos_token_id, *hf.encode("Hello"), hf.eos_token_id]
    assert ours.decode(with_special, skip_special_tokens=False) == hf.decode(with_special)
    assert ours.decode(with_special) == hf.decode(with_special, skip_special_tokens=True)
    assert ours.eos_token_id == hf.eos_token_id and ours.vocab_size == len(hf)


@pytest.mark.parametrize("trimmed", [True, False], ids=["trimming template", "keeping template"])
@pytest.mark.parametrize("final", ["It is ", "It is", "  It is\n", "{"])
def test_continue_final_message_cuts_where_transformers_does(tmp_path, trimmed, final):
    from tests.fake_backend import CHAT_TEMPLATE, make_test_tokenizer

    template = CHAT_TEMPLATE if trimmed else CHAT_TEMPLATE.replace(" | trim", "")
    directory = make_test_tokenizer(tmp_path, template)
    ours, hf = Tokenizer(directory), AutoTokenizer.from_pretrained(str(directory))
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": final}]
    text = ours.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert text == hf.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True, tokenize=False
    )
    assert text.endswith(final.strip() if trimmed else final)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(pair, add_generation_prompt):
    ours, hf = pair
    for messages in CONVERSATIONS:
        text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert text == hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        ids = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, return_dict=False)
        assert ours.encode(text, add_special_tokens=False) == list(ids)


def test_template_in_tokenizer_config_with_added_token_dicts(tmp_path, tok_dir):
    """Older checkpoints: template inside tokenizer_config.json, special tokens as AddedToken dicts."""
    for name in ("tokenizer.json",):
        (tmp_path / name).write_bytes((tok_dir / name).read_bytes())
    template = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{{ m['role'] }}#{{ loop.index0 }}: {{ m['content'] | tojson }}\n{% endfor %}"
        "{% if add_generation_prompt %}{{ eos_token }}[{{ ns.n }}]{% endif %}"
    )
    added = {
        "__type": "AddedToken",
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": True,
    }
    config = {
        "bos_token": {**added, "content": "<s>"},
        "eos_token": {**added, "content": "</s>"},
        "chat_template": [{"name": "default", "template": template}, {"name": "rag", "template": "x"}],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, hf = Tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    messages = CONVERSATIONS[1]
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )


def test_raise_exception_and_missing_template(pair, tmp_path, tok_dir):
    ours, _ = pair
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def _stream(tok, prompt_ids, ids, step):
    detok = IncrementalDetokenizer(tok, prompt_ids)
    deltas = [detok.add(ids[i : i + step]) for i in range(0, len(ids), step)]
    return deltas, detok.flush()


@pytest.mark.parametrize("step", [1, 2, 3])
def test_incremental_detokenizer_never_splits_a_character(pair, step):
    ours, hf = pair
    text = "Hello 日本語 and émoji 🙂 ß!"
    ids = hf.encode(text, add_special_tokens=False)
    # the premise: some character is spread over several byte-level tokens
    assert any("\ufffd" in hf.decode([t]) for t in ids)
    deltas, tail = _stream(ours, hf.encode("The fox"), ids, step)
    assert all("\ufffd" not in d for d in deltas)
    assert all(d.encode("utf-8").decode("utf-8") == d for d in deltas)
    assert "".join(deltas) + tail == hf.decode(ids) == text
    assert tail == ""


def test_detokenizer_flushes_an_unfinished_character(pair):
    ours, hf = pair
    ids = hf.encode("a日", add_special_tokens=False)
    cut = ids[:-1]  # the last byte of 日 never arrives
    deltas, tail = _stream(ours, [], cut, 1)
    assert "".join(deltas) + tail == hf.decode(cut)
    assert "\ufffd" not in "".join(deltas)


def test_detokenizer_holds_back_only_the_last_unfinished_character(pair):
    """A stream repeating a lone lead byte (random-weight models do) is broken text from its second
    token on: each token's delta comes when the next byte shows the one before can never complete, not
    all at the end."""
    ours, hf = pair
    lead = next(t for t in hf.encode("日", add_special_tokens=False) if hf.decode([t]) == "\ufffd")
    ids = [lead] * 6 + hf.encode("ok", add_special_tokens=False)
    deltas, tail = _stream(ours, hf.encode("The fox"), ids, 1)
    assert deltas[:6] == [""] + ["\ufffd"] * 5  # the newest lead byte may still get its continuation bytes
    assert "".join(deltas) + tail == hf.decode(ids) == "\ufffd" * 6 + "ok"
    held, tail = _stream(ours, [], ids[:3], 1)
    assert held == ["", "\ufffd", "\ufffd"] and tail == "\ufffd"  # the last one flushed at the end


def test_stop_matcher_holds_back_possible_prefixes():
    m = StopStringMatcher(["STOP", "xyz"])
    assert m.push("abc S") == ("abc ", False)  # "S" may start STOP
    assert m.push("T") == ("", False)
    assert m.push("Ox") == ("STO", False)  # "STOx" is no stop, but "x" may start xyz
    assert m.push("y") == ("", False)
    assert m.push("zzz") == ("", True)
    assert m.stopped


def test_stop_matcher_earliest_match_and_flush():
    m = StopStringMatcher(["cd", "b"])
    assert m.push("abcd") == ("a", True)
    m = StopStringMatcher(["END"])
    assert m.push("the EN") == ("the ", False)
    assert m.flush() == "EN"  # generation ended: the held text was real output
    assert StopStringMatcher([]).push("anything") == ("anything", False)
