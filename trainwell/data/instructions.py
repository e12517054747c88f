"""Instruction-tuning data: JSONL of prompt/response pairs or chats, tokenized with a response mask.

Keras-free (floor 0): the causal-LM recipe (`trainwell.recipes.causal_lm`) reads its
data here and hands in its tokenizer as a plain function.

Two line formats (one JSON object per line; blank lines are skipped):

- `{"prompt": "...", "response": "..."}`: the prompt, then the response, concatenated
  as written (no separator is added: end the prompt with the one you want, e.g.
  `"Question: ...\\nAnswer:"`);
- `{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}`: a chat,
  rendered with one of `CHAT_TEMPLATES`: `"plain"` (`"System: ...\\n"`, `"User: ...\\n"`,
  `"Assistant: ...\\n"`) or `"gemma"` (Gemma's `<start_of_turn>user` / `<start_of_turn>model`
  turns, each ended by `<end_of_turn>\\n`; a system turn's content opens the next user
  turn, followed by a blank line, as Gemma's own template does). **Every** assistant turn
  is a response (its content and the turn's end are trained on); everything else
  (system and user turns, the assistant turn's opening) is prompt. The prompt of a
  generation sample is everything before the last assistant turn's content.

An example is a tuple of `Segment`s, each text with a flag `response`. `tokenize`
turns examples into fixed-length token ids and per-token loss weights: 1 on response
tokens (and the end token after the last one), 0 on prompt and padding tokens.

Example:
>>> ex = parse_example({"prompt": "2+2=", "response": "4"}, "data.jsonl", 1)
>>> [(s.text, s.response) for s in ex]
[('2+2=', False), ('4', True)]
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from trainwell.data.base import DataError, DataNotFoundError, json_lines
from trainwell.validation import invalid_argument

#: The chat roles a `messages` line may use.
ROLES = ("system", "user", "assistant")
#: Per template, each role's `(opening, end)` around its content; `None`: the role's content
#: opens the next turn instead (Gemma has no system turn).
CHAT_TEMPLATES = {
    "plain": {"system": ("System: ", "\n"), "user": ("User: ", "\n"), "assistant": ("Assistant: ", "\n")},
    "gemma": {"system": None, "user": ("<start_of_turn>user\n", "<end_of_turn>\n"),
              "assistant": ("<start_of_turn>model\n", "<end_of_turn>\n")},
}


@dataclasses.dataclass(frozen=True)
class Segment:
    """A piece of an example's text; `response` pieces are what the loss counts.

    Example:
    >>> Segment("Hello", response=True).response
    True
    """

    text: str
    response: bool


def _short(value: Any, n: int = 60) -> Any:
    text = value if isinstance(value, str) else json.dumps(value)
    return value if len(text) <= n else text[: n - 3] + "..."


def _bad(where: str, field: str, expected: str, value: Any) -> DataError:
    return invalid_argument(field, expected, _short(value), what=f"{where}, field", error=DataError)


def _text(row: dict, key: str, where: str, response: bool = False) -> str:
    value = row.get(key)
    if not isinstance(value, str) or (response and not value.strip()):
        raise _bad(where, key, "expected a non-empty string" if response else "expected a string", value)
    return value


def _chat(messages: Any, where: str, template: str) -> tuple[Segment, ...]:
    if not isinstance(messages, list) or not messages:
        raise _bad(where, "messages", "expected a non-empty list of {\"role\", \"content\"} objects", messages)
    turns, segments, carried = CHAT_TEMPLATES[template], [], ""
    for i, m in enumerate(messages):
        at = f"{where}, message {i}"
        if not isinstance(m, dict):
            raise _bad(at, "message", "expected a {\"role\", \"content\"} object", m)
        role = m.get("role")
        if role not in ROLES:
            raise _bad(at, "role", f"expected one of {', '.join(map(repr, ROLES))}", role)
        content = _text(m, "content", at, response=role == "assistant")
        if turns[role] is None:
            carried += content + "\n\n"
            continue
        opening, end = turns[role]
        if role == "assistant":
            if carried:  # a system turn right before: it becomes a user turn of its own
                segments.append(Segment(turns["user"][0] + carried.rstrip("\n") + turns["user"][1], False))
            segments += [Segment(opening, False), Segment(content + end, True)]
        else:
            segments.append(Segment(opening + carried + content + end, False))
        carried = ""
    if not any(s.response for s in segments):
        raise _bad(where, "messages", "expected at least one assistant turn (the response)", [m.get("role") for m in messages])
    return tuple(segments)


def parse_example(row: Any, path: str, line: int, template: str = "plain") -> tuple[Segment, ...]:
    """One JSONL line's object as segments; anything else is a one-line `DataError`.

    Args:
        row: The parsed line.
        path: The file, for the message.
        line: The line number, for the message.
        template: A chat's template, a key of `CHAT_TEMPLATES`. Defaults to `"plain"`.

    Raises:
        trainwell.data.base.DataError: Not an object, no `prompt`/`response` or
            `messages`, an empty response, an unknown role.

    Example:
    >>> msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    >>> [s.text for s in parse_example({"messages": msgs}, "chat.jsonl", 1)]
    ['User: Hi\\n', 'Assistant: ', 'Hello\\n']
    """
    if template not in CHAT_TEMPLATES:
        raise invalid_argument("template", f"one of {', '.join(map(repr, CHAT_TEMPLATES))}", template)
    where = f"{path!r} line {line}"
    if not isinstance(row, dict):
        raise DataError(f"{where} is not a JSON object. Received: {_short(row)!r}")
    if "messages" in row:
        return _chat(row["messages"], where, template)
    if "prompt" not in row or "response" not in row:
        raise DataError(f"{where}: expected the fields \"prompt\" and \"response\", or \"messages\". "
                        f"Received: fields {sorted(row)}")
    return (Segment(_text(row, "prompt", where), False), Segment(_text(row, "response", where, response=True), True))


def read_jsonl(path: str | Path, template: str = "plain") -> list[tuple[Segment, ...]]:
    """Every example of an instruction JSONL file (see the module docstring for the formats).

    Args:
        path: The file.
        template: How chats are written, a key of `CHAT_TEMPLATES`. Defaults to `"plain"`.

    Raises:
        trainwell.data.base.DataNotFoundError: No such file.
        trainwell.data.base.DataError: Not UTF-8, a line that is not JSON, a bad example, no example.

    Example:
    >>> examples = read_jsonl("train.jsonl")  # doctest: +SKIP
    """
    path = Path(path)
    if not path.is_file():
        raise DataNotFoundError(f"Data file not found: {str(path)!r}")
    examples = []
    def bad_line(n: int, why: str, line: str) -> str:
        return (f"{str(path)!r} line {n} is not JSON ({why}); expected one JSON object per line. "
                f"Received: {_short(line)!r}")

    try:
        for n, row, _ in json_lines(path, bad_line):
            examples.append(parse_example(row, str(path), n, template))
    except UnicodeDecodeError as e:
        raise DataError(f"{str(path)!r} is not UTF-8 text. Received: byte 0x{e.object[e.start]:02x}") from None
    if not examples:
        raise DataError(f"{str(path)!r} holds no example. Received: an empty file")
    return examples


def prompt_and_reference(example: Sequence[Segment]) -> tuple[str, str]:
    """The text before the last response, and that response (a generation sample's input and reference).

    Example:
    >>> prompt_and_reference(parse_example({"prompt": "Q: 1+1? A:", "response": " 2"}, "d", 1))
    ('Q: 1+1? A:', ' 2')
    """
    last = max(i for i, s in enumerate(example) if s.response)
    return "".join(s.text for s in example[:last]), example[last].text


def tokenize(
    examples: Sequence[Sequence[Segment]],
    tokenize_fn: Callable[[list[str]], list[list[int]]],
    length: int,
    *,
    start_id: int | None,
    end_id: int | None,
    pad_id: int,
    truncate: bool = False,
    path: str = "the data",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token ids, loss weights and lengths of each example, `length` long (model inputs and targets together).

    A row is `[start] + segment tokens + [end]`, padded with `pad_id`; each segment is
    tokenized on its own, as a prompt is at generation. A weight is that of the token
    *as a target*: 1 on response tokens and the end token, 0 on the start token,
    prompt tokens and padding. The model reads `ids[:, :-1]` and predicts `ids[:, 1:]`
    weighted by `weights[:, 1:]`.

    Args:
        examples: From `read_jsonl`.
        tokenize_fn: Strings to lists of token ids (the preset's tokenizer).
        length: Tokens per row: the model's sequence length + 1.
        start_id: Token before every example, or `None`.
        end_id: Token after every example (trained on: the model learns to stop), or `None`.
        pad_id: Padding token.
        truncate: Cut an example that is too long (the prompt from its left, then the
            response from its right, keeping one response token) instead of refusing it.
            Defaults to `False`.
        path: The data's name in messages. Defaults to `"the data"`.

    Returns:
        `(ids, weights, lengths)`: int32 and float32 arrays of shape `(len(examples), length)`,
        and each row's real tokens (int32, the rest is padding).

    Raises:
        trainwell.data.base.DataError: An example longer than `length` with `truncate` off.

    Example:
    >>> ids, w, n = tokenize([parse_example({"prompt": "ab", "response": "c"}, "d", 1)],
    ...                   lambda xs: [[ord(ch) for ch in x] for x in xs], 6, start_id=1, end_id=2, pad_id=0)
    >>> ids.tolist(), w.tolist(), n.tolist()
    ([[1, 97, 98, 99, 2, 0]], [[0.0, 0.0, 0.0, 1.0, 1.0, 0.0]], [5])
    """
    flat = [s for ex in examples for s in ex]
    token_lists = tokenize_fn([s.text for s in flat]) if flat else []
    ids = np.full((len(examples), length), pad_id, dtype=np.int32)
    weights = np.zeros((len(examples), length), dtype=np.float32)
    lengths = np.zeros(len(examples), dtype=np.int32)
    pos = 0
    for row, ex in enumerate(examples):
        toks, wts = [], []
        if start_id is not None:
            toks.append(int(start_id))
            wts.append(0.0)
        for s in ex:
            t = [int(x) for x in token_lists[pos]]
            pos += 1
            toks += t
            wts += [float(s.response)] * len(t)
        if end_id is not None:
            toks.append(int(end_id))
            wts.append(1.0)
        if len(toks) > length:
            if not truncate:
                raise invalid_argument(
                    "tokens", f"expected at most sequence_length + 1 = {length} tokens (or truncate=true)",
                    len(toks), what=f"{path!r} example {row + 1},", error=DataError)
            toks, wts = _cut(toks, wts, length, start_id is not None)
        ids[row, : len(toks)] = toks
        weights[row, : len(wts)] = wts
        lengths[row] = len(toks)
        if not weights[row, 1:].any():
            raise DataError(f"{path!r} example {row + 1}: no response token is left to train on. "
                            f"Received: {len(toks)} tokens, all prompt")
    return ids, weights, lengths


def _cut(toks: list, wts: list, length: int, keep_first: bool) -> tuple[list, list]:
    """`toks` cut to `length`: prompt tokens from the left (after the start token), then from the right."""
    head = 1 if keep_first else 0
    excess = len(toks) - length
    first_response = wts.index(1.0)
    drop = min(excess, max(0, first_response - head))
    toks, wts = toks[:head] + toks[head + drop:], wts[:head] + wts[head + drop:]
    return toks[:length], wts[:length]
