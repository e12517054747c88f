import json

import numpy as np
import pytest

from trainwell.data import instructions
from trainwell.data.base import DataError, DataNotFoundError


def chars(texts):  # a tokenizer: one token per character
    return [[ord(c) for c in t] for t in texts]


def ex(prompt, response):
    return instructions.parse_example({"prompt": prompt, "response": response}, "d.jsonl", 1)


def test_weights_are_one_on_response_and_end_tokens_only():
    ids, w, n = instructions.tokenize([ex("ab", "cd"), ex("", "e")], chars, 8, start_id=1, end_id=2, pad_id=0)
    assert ids.tolist() == [[1, 97, 98, 99, 100, 2, 0, 0], [1, 101, 2, 0, 0, 0, 0, 0]]
    assert w.tolist() == [[0, 0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0]]
    assert n.tolist() == [6, 3] and ids.dtype == np.int32 and w.dtype == np.float32
    ids, w, n = instructions.tokenize([ex("ab", "c")], chars, 4, start_id=None, end_id=None, pad_id=0)
    assert ids.tolist() == [[97, 98, 99, 0]] and w.tolist() == [[0, 0, 1, 0]] and n.tolist() == [3]


def test_too_long_refused_or_cut_from_the_prompts_left_then_the_responses_right():
    with pytest.raises(DataError, match=r"'d' example 2, `tokens`: expected at most .* = 6 tokens.*Received: tokens=8"):
        instructions.tokenize([ex("a", "b"), ex("abcde", "f")], chars, 6, start_id=1, end_id=2, pad_id=0, path="d")
    ids, w, _ = instructions.tokenize([ex("abcde", "f")], chars, 6, start_id=1, end_id=2, pad_id=0, truncate=True)
    assert ids.tolist() == [[1, 99, 100, 101, 102, 2]] and w.tolist() == [[0, 0, 0, 0, 1, 1]]
    ids, w, _ = instructions.tokenize([ex("ab", "cdefgh")], chars, 5, start_id=1, end_id=2, pad_id=0, truncate=True)
    assert ids.tolist() == [[1, 99, 100, 101, 102]] and w.tolist() == [[0, 1, 1, 1, 1]]  # no prompt left, response cut


def test_chat_every_assistant_turn_is_a_response():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
            {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"},
            {"role": "assistant", "content": "A2"}]
    segs = instructions.parse_example({"messages": msgs}, "c", 1)
    assert [(s.text, s.response) for s in segs] == [
        ("System: S\n", False), ("User: U1\n", False), ("Assistant: ", False), ("A1\n", True),
        ("User: U2\n", False), ("Assistant: ", False), ("A2\n", True)]
    assert instructions.prompt_and_reference(segs) == ("System: S\nUser: U1\nAssistant: A1\nUser: U2\nAssistant: ",
                                                       "A2\n")


def test_gemma_template_turns_and_its_system_prompt_in_the_first_user_turn():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
            {"role": "assistant", "content": "A"}]
    segs = instructions.parse_example({"messages": msgs}, "c", 1, template="gemma")
    assert [(s.text, s.response) for s in segs] == [
        ("<start_of_turn>user\nS\n\nU<end_of_turn>\n", False), ("<start_of_turn>model\n", False),
        ("A<end_of_turn>\n", True)]
    alone = instructions.parse_example({"messages": [msgs[0], msgs[2]]}, "c", 1, template="gemma")
    assert alone[0].text == "<start_of_turn>user\nS<end_of_turn>\n"  # a system turn is not lost
    with pytest.raises(ValueError, match="Received: template='llama'"):
        instructions.parse_example({"messages": msgs}, "c", 1, template="llama")


def test_read_jsonl_one_line_errors(tmp_path):
    with pytest.raises(DataNotFoundError, match="Data file not found"):
        instructions.read_jsonl(tmp_path / "none.jsonl")
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="holds no example. Received: an empty file"):
        instructions.read_jsonl(tmp_path / "e.jsonl")
    (tmp_path / "b.bin").write_bytes(b'{"prompt": "\xff"}\n')
    with pytest.raises(DataError, match="is not UTF-8 text. Received: byte 0xff"):
        instructions.read_jsonl(tmp_path / "b.bin")
    rows = [{"prompt": "p", "response": "r"}, {"messages": [{"role": "assistant", "content": ""}]}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DataError, match="line 2, message 0, field `content`: expected a non-empty string"):
        instructions.read_jsonl(tmp_path / "d.jsonl")
