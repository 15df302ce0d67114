"""Chat data for supervised fine-tuning: JSONL conversations -> token ids, a loss mask, packed rows.

Each line of a chat file is one conversation, in the OpenAI / HF format that TRL reads:

    {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": "..."}, ...]}
    {"prompt": "...", "completion": "..."}                  a user turn, then an assistant turn
    {"prompt": [message, ...], "completion": [message, ...]}

A conversation is rendered with the model's chat template exactly as `arlm chat` renders a prompt
(`arlm.llm.render_chat`) and tokenized as one text. Only what the model will be asked to generate
is learned: each assistant turn from its content through its end-of-turn token, the token that
generation stops on (`<|im_end|>` for SmolLM2), as TRL's `assistant_only_loss` and nanochat's SFT
do. Everything else (system and user turns, the template's role headers, what the template writes
after the end-of-turn token) is context. In the prompt/completion form only the completion's
assistant turns are learned (TRL's `completion_only_loss`).

Assistant turns are found by rendering the conversation prefix by prefix: the tokens of
messages[:i] followed by the generation prompt must begin the tokens of messages[:i + 1], and what
the latter adds is turn i. A template that rewrites earlier turns (one that drops their reasoning,
say), or a tokenizer that merges tokens across a turn's edge, breaks that; such a conversation is
reported, never learned with a guessed mask.
"""

from __future__ import annotations

import json
from bisect import bisect_left, insort
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from ..llm import PromptError, render_chat, template_tokens
from ..tokenizer import Tokenizer, valid_text

ROLES = ("system", "user", "assistant", "tool")


class BadConversation(ValueError):
    """A chat file's line that cannot be trained on; the message says why (without file:line)."""


@dataclass
class Conversation:
    messages: list[dict]
    learn_from: int = 0  # assistant turns at this index or later are learned (a completion's first)


@dataclass
class EncodedConversation:
    ids: np.ndarray  # [n] int64 token ids, as `arlm chat` would tokenize the rendered conversation
    learned: np.ndarray  # [n] bool: the token is a target the loss learns (an assistant token)


def _messages(value: object, what: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise BadConversation(f'"{what}" must be a non-empty list of messages')
    for n, m in enumerate(value, 1):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise BadConversation(f'message {n} of "{what}" is not an object with "role" and "content"')
        if m["role"] not in ROLES:
            raise BadConversation(f'message {n} of "{what}" has an unknown role {m["role"]!r} '
                                  f'(one of {", ".join(ROLES)})')
        if not isinstance(m["content"], str):
            raise BadConversation(f'message {n} of "{what}" has content that is not a string')
    return [{**m, "content": valid_text(m["content"])} for m in value]


def parse_conversation(line: str) -> Conversation:
    """One JSONL line in any of the module docstring's forms."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise BadConversation(f"not JSON ({e.msg}: column {e.colno})") from None
    except RecursionError:  # (json's C decoder: arrays or objects nested past the recursion limit)
        raise BadConversation("not a conversation: JSON nested too deeply") from None
    if not isinstance(obj, dict):
        raise BadConversation('not a JSON object with "messages", or "prompt" and "completion"')
    if "messages" in obj:
        conv = Conversation(_messages(obj["messages"], "messages"))
    elif "prompt" in obj and "completion" in obj:
        prompt, completion = obj["prompt"], obj["completion"]
        if isinstance(prompt, str) != isinstance(completion, str):
            raise BadConversation('"prompt" and "completion" must both be strings or both be message lists')
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
            completion = [{"role": "assistant", "content": completion}]
        prompt, completion = _messages(prompt, "prompt"), _messages(completion, "completion")
        conv = Conversation(prompt + completion, learn_from=len(prompt))
    else:
        raise BadConversation('no "messages", nor "prompt" and "completion"')
    if not any(m["role"] == "assistant" for m in conv.messages[conv.learn_from:]):
        raise BadConversation("no assistant turn to learn" + (" in the completion" if conv.learn_from else ""))
    return conv


@dataclass
class ChatEncoder:
    """Conversations -> (ids, learned) through a chat template and the model's tokenizer."""

    template: str
    tokenizer: Tokenizer

    def __post_init__(self) -> None:
        self.specials = template_tokens(self.tokenizer)  # bos_token, eos_token: as `arlm chat` renders

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return render_chat(self.template, messages, add_generation_prompt, **self.specials)

    def encode(self, conv: Conversation) -> EncodedConversation:
        turns = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant" and i >= conv.learn_from]
        try:
            texts = [self.render(conv.messages, False)]
            for i in turns:  # what precedes turn i (its header included), then the conversation through it
                texts += [self.render(conv.messages[:i], True), self.render(conv.messages[: i + 1], False)]
        except PromptError as e:
            raise BadConversation(str(e)) from None
        tok = self.tokenizer
        encoded = [e.ids for e in tok.backend.encode_batch_fast(texts, add_special_tokens=False)]
        bos = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []  # as Tokenizer.encode adds it
        ids = np.asarray(bos + encoded[0], dtype=np.int64)
        learned = np.zeros(len(ids), dtype=bool)
        stops = np.asarray(tok.eos_ids, dtype=np.int64)
        for n, i in enumerate(turns):
            head, through = bos + encoded[1 + 2 * n], bos + encoded[2 + 2 * n]
            if not (through[: len(head)] == head and ids[: len(through)].tolist() == through):
                raise BadConversation(f"the chat template and tokenizer do not render this conversation prefix by "
                                      f"prefix (at message {i + 1}), so its assistant turn cannot be told apart")
            turn = np.arange(len(head), len(through))
            # Generation stops at the first stop token: what the template writes after it (a
            # newline) the model never produces, so it is context, not a target.
            first_stop = np.flatnonzero(np.isin(ids[turn], stops))
            if len(first_stop):
                turn = turn[: first_stop[0] + 1]
            learned[turn] = True
        learned[0] = False  # no position predicts a conversation's first token
        if not learned.any():
            raise BadConversation("the assistant turns render to no tokens to learn")
        return EncodedConversation(ids, learned)


def read_chat_file(path: Path) -> Iterator[tuple[int, Conversation | BadConversation]]:
    """(line number, conversation or what is wrong with it) for each non-blank line of `path`."""
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # (a BOM some editors write first)
            except UnicodeDecodeError as e:
                yield lineno, BadConversation(f"not UTF-8 (byte {e.start})")
                continue
            if not line.strip():
                continue
            try:
                yield lineno, parse_conversation(line)
            except BadConversation as e:
                yield lineno, e


def pack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into rows of at most `capacity` tokens: best fit decreasing
    (each conversation, longest first, into the fullest row it fits), which wastes a few percent of
    a row where a row per conversation wastes what the conversations leave empty."""
    rows: list[list[int]] = []
    by_room: dict[int, list[int]] = {}  # room left -> the rows with that much room
    rooms: list[int] = []  # by_room's keys, ascending
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        k = bisect_left(rooms, n)
        if k < len(rooms):
            room = rooms[k]
            row = by_room[room].pop()
            if not by_room[room]:
                del by_room[room], rooms[k]
        else:
            row, room = len(rows), capacity
            rows.append([])
        rows[row].append(i)
        room -= n
        if room > 0:
            if room not in by_room:
                by_room[room] = []
                insort(rooms, room)
            by_room[room].append(row)
    return rows


def packed_arrays(convs: list[EncodedConversation], row_tokens: int,
                  pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The conversations packed into rows of `row_tokens`, flattened: token ids, learned (0/1)
    and each token's position in its conversation (0 starts one). A row's unused tail is
    `pad_id` tokens, never learned, numbered as a conversation of its own."""
    rows = pack([len(c.ids) for c in convs], row_tokens)
    ids = np.full((len(rows), row_tokens), pad_id, dtype=np.int64)
    learned = np.zeros((len(rows), row_tokens), dtype=np.uint8)
    pos = np.zeros((len(rows), row_tokens), dtype=np.int64)
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            n = len(convs[i].ids)
            ids[r, at:at + n], learned[r, at:at + n], pos[r, at:at + n] = convs[i].ids, convs[i].learned, np.arange(n)
            at += n
        pos[r, at:] = np.arange(row_tokens - at)
    return ids.ravel(), learned.ravel(), pos.ravel()
