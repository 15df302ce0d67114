"""Chat fine-tuning (SFT): chat data, the assistant-only loss, packed rows, bad lines, and a run
that teaches SmolLM2 a reply format.

References and tolerances:
- the loss mask against the conversations' own text: the learned tokens of every conversation,
  decoded, are exactly its learned assistant turns' contents, each followed by `<|im_end|>`;
  and the ids are those `arlm chat` gives the same conversation (the template through
  `LLM.apply_chat_template`'s renderer, then `Tokenizer.encode`);
- the loss against cross-entropy computed by hand (float64) over the learned targets: 1e-6
  relative; its
  gradient w.r.t. the logits exactly 0 at every ignored position, and not 0 at every learned one;
- packing: a conversation's logits in a packed row against the same conversation alone in a row
  of its own (positions from 0, plain causal attention): 1e-5; changing the other conversation of
  the row changes nothing there (1e-6) and changes its own logits (so the check can fail).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from arlm.cli import main as arlm_main
from arlm.config import ModelConfig
from arlm.llm import render_chat, template_tokens
from arlm.model import Transformer
from arlm.train import TrainConfig, next_token_loss, train
from arlm.train.chat import ChatEncoder, parse_conversation
from arlm.train.data import IGNORE, ChatData, TokenData, prepare_chat

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "chat_answer_format.jsonl"
IM_END = "<|im_end|>"

CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "Hi there!"}, {"role": "assistant", "content": "Hello! How can I help?"}]},
    {"messages": [{"role": "system", "content": "You answer in French."},
                  {"role": "user", "content": "Good morning"}, {"role": "assistant", "content": "Bonjour !"},
                  {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": " Merci,\n de rien."}]},
    {"prompt": "What is 2 + 2?", "completion": "4"},
    {"prompt": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Red."},
                {"role": "user", "content": "Another one?"}],
     "completion": [{"role": "assistant", "content": "Blue, or perhaps green."}]},
    {"messages": [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""}]},
    {"messages": [{"role": "user", "content": "Emoji?"}, {"role": "assistant", "content": "Sure: 🎉✨ ünïcödé"}]},
]


def learned_texts(conv: dict) -> list[str]:
    """What the loss must learn of `conv`: each learned assistant turn's content, then <|im_end|>."""
    if "messages" in conv:
        turns = conv["messages"]
    elif isinstance(conv["completion"], str):
        turns = [{"role": "assistant", "content": conv["completion"]}]
    else:
        turns = conv["completion"]
    return [m["content"] + IM_END for m in turns if m["role"] == "assistant"]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module", autouse=True)
def tokenizers_read_once():
    """Each `prepare --chat --tokenizer smollm2` reads SmolLM2's tokenizer from its GGUF's metadata
    (~1 s): the module's dozen runs share the first read (a cache by model name; what is read, and
    how, is unchanged)."""
    import functools

    import arlm.train.data as data

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(data, "pretrained_tokenizer_and_template",
                   functools.lru_cache(maxsize=None)(data.pretrained_tokenizer_and_template))
        yield


@pytest.fixture(scope="module")
def smollm2_chat():
    import arlm.train.data as data

    return data.pretrained_tokenizer_and_template("smollm2")


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> Path:
    """CONVERSATIONS (three times over) in SmolLM2's tokens, packed into 96-token rows."""
    root = tmp_path_factory.mktemp("chat")
    write_jsonl(root / "chat.jsonl", CONVERSATIONS * 3)
    prepare_chat([root / "chat.jsonl"], root / "data", tokenizer="smollm2", context_length=96, val_fraction=0.35)
    return root / "data"


def runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of True in `mask`."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2], edges[1::2]))


# -- the loss mask ---------------------------------------------------------------------------------

def test_mask_is_the_assistant_turns_through_their_end_of_turn_token(smollm2_chat):
    tok, template = smollm2_chat
    encoder = ChatEncoder(template, tok)
    for conv in CONVERSATIONS:
        enc = encoder.encode(parse_conversation(json.dumps(conv)))
        messages = conv.get("messages") or (
            conv["prompt"] + conv["completion"] if isinstance(conv["prompt"], list) else
            [{"role": "user", "content": conv["prompt"]}, {"role": "assistant", "content": conv["completion"]}])
        # the ids `arlm chat` gives the conversation (LLM.apply_chat_template, then encode)
        text = render_chat(template, messages, add_generation_prompt=False, **template_tokens(tok))
        assert enc.ids.tolist() == tok.encode(text)
        assert [tok.decode(enc.ids[a:b].tolist()) for a, b in runs(enc.learned)] == learned_texts(conv), conv
        assert enc.ids[enc.learned].tolist().count(tok.eos_id) == len(learned_texts(conv))


def test_prepared_rows_hold_every_conversation_and_its_mask(chat_data):
    data = TokenData.open(chat_data)
    assert isinstance(data, ChatData) and data.meta["format"] == "chat" and data.meta["context_length"] == 96
    tok = data.tokenizer
    assert "<|im_start|>" in data.meta["chat_template"]
    found = []
    for split in ("train", "val"):
        ids, learned, pos = (np.asarray(a[split]).reshape(-1, 97) for a in (data.splits, data.masks, data.positions))
        assert data.meta[f"{split}_rows"] == len(ids) and data.meta[f"{split}_learned_tokens"] == learned.sum()
        for r in range(len(ids)):
            starts = [*np.flatnonzero(pos[r] == 0), 97]
            for a, b in zip(starts[:-1], starts[1:]):  # each conversation (and the row's padding)
                assert (pos[r, a:b] == np.arange(b - a)).all()
                texts = [tok.decode(ids[r, a + s:a + e].tolist()) for s, e in runs(learned[r, a:b] == 1)]
                if texts:
                    found.append(texts)
                else:  # only padding learns nothing
                    assert (ids[r, a:b] == tok.eos_id).all()
    expected = [learned_texts(c) for c in CONVERSATIONS * 3]
    assert sorted(found) == sorted(expected)


def test_batch_targets_skip_everything_but_learned_tokens(chat_data):
    data = TokenData.open(chat_data)
    rows = np.arange(data.meta["train_rows"]) * 97
    batch = data.batch("train", rows, 96, torch.device("cpu"))
    tokens = torch.from_numpy(np.array(data.splits["train"], dtype=np.int64)).view(-1, 97)
    learned = torch.from_numpy(np.array(data.masks["train"])).view(-1, 97)[:, 1:] == 1
    assert torch.equal(batch.x, tokens[:, :-1])
    assert torch.equal(batch.y[learned], tokens[:, 1:][learned]) and (batch.y[~learned] == IGNORE).all()
    assert int(learned.sum()) == data.meta["train_learned_tokens"]
    assert (batch.input_pos[batch.doc_ids != torch.roll(batch.doc_ids, 1, dims=1)] == 0).all()


# -- the loss and packing --------------------------------------------------------------------------

class Recorder(torch.nn.Module):
    """The model, keeping its last logits and their gradient."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx, **kwargs):
        self.logits = self.model(idx, **kwargs)
        self.logits.retain_grad()
        return self.logits


def tiny_model(family: str, vocab_size: int, max_seq_len: int = 96) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.for_family(family, vocab_size=vocab_size, n_layer=2, n_head=2, n_kv_heads=1,
                                              d_model=32, d_ff=64, max_seq_len=max_seq_len))


def test_loss_learns_assistant_tokens_only(chat_data):
    data = TokenData.open(chat_data)
    batch = data.batch("train", np.arange(min(3, data.meta["train_rows"])) * 97, 96, torch.device("cpu"))
    model = Recorder(tiny_model("llama", data.vocab_size))
    # (the plain path, whose logits the Recorder sees; the fused head + loss that training runs
    # takes the same value, and tests/test_train_fast.py its gradients with ignored targets)
    loss = next_token_loss(model, batch.x, batch.y, batch.input_pos, batch.doc_ids, fused=False)
    fused = next_token_loss(model.model, batch.x, batch.y, batch.input_pos, batch.doc_ids, fused=True)
    assert fused.item() == pytest.approx(loss.item(), rel=1e-5)
    loss.backward()
    learned = batch.y != IGNORE
    logp = torch.log_softmax(model.logits.detach().double(), -1)
    by_hand = -logp[learned].gather(-1, batch.y[learned][:, None]).mean()
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-6)  # (float32 over 49,152 logits)
    grad = model.logits.grad  # [B, T, V]
    assert (grad[~learned] == 0).all()  # exactly: an ignored target adds nothing to any weight's gradient
    assert (grad[learned].abs().amax(-1) > 0).all()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_packed_conversations_never_see_each_other(family):
    model = tiny_model(family, vocab_size=53, max_seq_len=32).eval()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 53, (11,), generator=g), torch.randint(0, 53, (14,), generator=g)
    pad = torch.zeros(32 - 25, dtype=torch.int64)
    row = torch.cat([a, b, pad])[None]
    input_pos = torch.cat([torch.arange(11), torch.arange(14), torch.arange(7)])[None]
    doc_ids = torch.tensor([0] * 11 + [1] * 14 + [2] * 7)[None]
    with torch.no_grad():
        packed = model(row, input_pos=input_pos, doc_ids=doc_ids)
        alone = model(b[None])  # b in a row of its own: positions 0.., plain causal attention
        torch.testing.assert_close(packed[0, 11:25], alone[0], rtol=0, atol=1e-5)
        other = row.clone()
        other[0, :11] = (other[0, :11] + 1) % 53
        changed = model(other, input_pos=input_pos, doc_ids=doc_ids)
    torch.testing.assert_close(changed[0, 11:], packed[0, 11:], rtol=0, atol=1e-6)
    assert (changed[0, :11] - packed[0, :11]).abs().max() > 1e-3


def test_trains_on_chat_data_and_keeps_its_template(chat_data, tmp_path):
    from arlm.loading import load_model

    cfg = TrainConfig(data_dir=str(chat_data), out_dir=str(tmp_path / "run"), family="llama", n_layer=1, n_head=2,
                      d_model=16, context_length=96, batch_size=2, max_steps=3, warmup_steps=0, eval_interval=3,
                      eval_batches=2, log_interval=1, progress=False, plot=False, threads=1, dtype="float32")
    result = train(cfg)
    assert result.step == 3 and all(np.isfinite(v) for v in result.losses.values())
    assert result.evals[-1]["val_loss"] == pytest.approx(np.log(49152), abs=1.0)  # untrained: near uniform
    loaded = load_model(str(tmp_path / "run" / "latest"))
    assert loaded.chat_template == TokenData.open(chat_data).meta["chat_template"]
    with pytest.raises(ValueError, match="packed in rows for context_length 96: train with --context-length 96"):
        train(TrainConfig(**{**cfg.to_dict(), "context_length": 64, "out_dir": str(tmp_path / "r2")}))


# -- bad input: one line naming the file and line, nothing written ---------------------------------

GOOD = CONVERSATIONS[0]
BAD_LINES = {
    "not JSON": ('{"messages": [', "not JSON"),
    "not an object": ("[1, 2]", "not a JSON object"),
    "no conversation": ('{"text": "hello"}', 'no "messages", nor "prompt" and "completion"'),
    "no assistant turn": ({"messages": [{"role": "user", "content": "Hi"}]}, "no assistant turn to learn"),
    "assistant only in the prompt": ({"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                                      "completion": [{"role": "user", "content": "c"}]},
                                     "no assistant turn to learn in the completion"),
    "unknown role": ({"messages": [{"role": "robot", "content": "Hi"}, {"role": "assistant", "content": "Hi"}]},
                     "unknown role 'robot'"),
    "content not a string": ({"messages": [{"role": "user", "content": ["Hi"]}, {"role": "assistant", "content": "x"}]},
                             "content that is not a string"),
    "mixed prompt and completion": ({"prompt": "Hi", "completion": [{"role": "assistant", "content": "Hi"}]},
                                    "both be strings or both be message lists"),
    "too long": ({"prompt": "word " * 80, "completion": "ok"}, "longer than a row of 65"),
    "nested past the recursion limit": ("[" * 100_000 + "]" * 100_000, "JSON nested too deeply"),
}


def prepare_argv(chat: Path, out: Path, *more: str) -> list[str]:
    return ["prepare", "--chat", str(chat), "--tokenizer", "smollm2", "--context-length", "64", "--out", str(out),
            "--val-fraction", "0.5", *more]


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_a_bad_line_is_one_line_naming_it_and_nothing_is_written(case, tmp_path, capsys):
    line, reason = BAD_LINES[case]
    chat = write_jsonl(tmp_path / "chat.jsonl", [GOOD, "", line, GOOD, GOOD])  # the bad one is line 3
    assert arlm_main(prepare_argv(chat, tmp_path / "out")) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"{chat}:3: " in err and reason in err and "--skip-bad" in err, err
    assert not (tmp_path / "out").exists()


def test_a_line_that_is_not_utf8(tmp_path, capsys):
    chat = tmp_path / "chat.jsonl"
    chat.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"prompt": "caf\xe9"}\n' + json.dumps(GOOD).encode() + b"\n")
    assert arlm_main(prepare_argv(chat, tmp_path / "out")) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{chat}:2: not UTF-8 (byte 15)" in err, err
    assert not (tmp_path / "out").exists()


def test_skip_bad_skips_every_bad_line_and_says_how_many(tmp_path, capsys):
    bad = [line for line, _ in BAD_LINES.values()]
    chat = write_jsonl(tmp_path / "chat.jsonl", [GOOD, *bad, GOOD, GOOD])
    assert arlm_main(prepare_argv(chat, tmp_path / "out", "--skip-bad")) == 0
    err = capsys.readouterr().err
    assert f"skipped {len(bad)} bad line(s); the first: {chat}:2: not JSON" in err, err
    data = TokenData.open(tmp_path / "out")
    assert data.meta["train_conversations"] + data.meta["val_conversations"] == 3
    assert [entry.split(": ", 1)[0] for entry in data.meta["skipped"]] == [f"{chat}:{n}" for n in range(2, 2 + len(bad))]


@pytest.mark.parametrize("template, reason", [
    ("{{ messages[0]['content'] + 1 }}", "chat template failed: TypeError: can only concatenate str"),
    ("{{ 1 // (messages | length - messages | length) }}", "chat template failed: ZeroDivisionError"),
])
def test_a_template_that_fails_in_python_names_the_line(template, reason, tmp_path, capsys):
    chat = write_jsonl(tmp_path / "chat.jsonl", [GOOD, GOOD])
    assert arlm_main(prepare_argv(chat, tmp_path / "out", "--chat-template", template)) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{chat}:1: {reason}" in err, err
    assert not (tmp_path / "out").exists()


def test_a_byte_order_mark_is_not_a_bad_line(tmp_path, capsys):
    chat = tmp_path / "chat.jsonl"
    chat.write_bytes(b"\xef\xbb\xbf" + write_jsonl(tmp_path / "plain.jsonl", [GOOD, GOOD, GOOD]).read_bytes())
    assert arlm_main(prepare_argv(chat, tmp_path / "out")) == 0, capsys.readouterr().err
    data = TokenData.open(tmp_path / "out")
    assert data.meta["train_conversations"] + data.meta["val_conversations"] == 3


@pytest.mark.parametrize("lines, match", [
    (["", "  "], "no conversation to train on in {chat}: no line but blank ones"),
    (['{"messages": ['], "no conversation to train on in {chat}: --skip-bad skipped all 1 line(s); the first: "
                         "{chat}:1: not JSON"),
])
def test_no_conversation_at_all_names_the_file(lines, match, tmp_path, capsys):
    chat = write_jsonl(tmp_path / "chat.jsonl", lines)
    assert arlm_main(prepare_argv(chat, tmp_path / "out", "--skip-bad")) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match.format(chat=chat) in err, err
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_checkpoint_whose_metadata_is_not_an_object(tmp_path, capsys):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "arlm.json").write_text("[1]")
    (tmp_path / "ckpt" / "tokenizer.json").write_text("{}")
    chat = write_jsonl(tmp_path / "chat.jsonl", [GOOD, GOOD])
    argv = prepare_argv(chat, tmp_path / "out")
    argv[argv.index("smollm2")] = str(tmp_path / "ckpt")
    assert arlm_main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"arlm: error: {tmp_path / 'ckpt'} is not an arlm checkpoint", err


def test_a_directory_as_the_chat_file(tmp_path, capsys):
    assert arlm_main(prepare_argv(tmp_path, tmp_path / "out")) == 1
    assert f"chat file {tmp_path} is a directory" in capsys.readouterr().err


@pytest.mark.parametrize("argv, match", [
    (["--tokenizer", "smollm2", "--context-length", "64", "--vocab-size", "100"],
     "--vocab-size does not apply with --chat"),
    (["--tokenizer", "char", "--context-length", "64"], "--chat needs --tokenizer MODEL"),
    (["--tokenizer", "smollm2"], "--chat needs --context-length N"),
    (["--tokenizer", "smollm2", "--context-length", "64", "--chat-template", "no-such-file"], "no such file"),
])
def test_chat_usage_errors(argv, match, tmp_path, capsys):
    chat = write_jsonl(tmp_path / "chat.jsonl", [GOOD, GOOD])
    assert arlm_main(["prepare", "--chat", str(chat), *argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err
    assert not (tmp_path / "out").exists()
    assert arlm_main(["prepare", str(chat), "--skip-bad"]) == 2
    assert "--skip-bad applies with --chat" in capsys.readouterr().err


def test_chat_template_file_replaces_the_models(tmp_path, capsys):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    chat = write_jsonl(tmp_path / "chat.jsonl", [GOOD, GOOD, GOOD])
    assert arlm_main(prepare_argv(chat, tmp_path / "out", "--chat-template", str(template))) == 0
    data = TokenData.open(tmp_path / "out")
    assert data.meta["chat_template"] == template.read_text()
    row = np.asarray(data.splits["train"][:97]).tolist()
    assert data.tokenizer.decode(row).startswith("<|im_start|>user\nHi there!<|im_end|><|im_start|>assistant\nHello!")


# -- acceptance: SmolLM2 learns a reply format -----------------------------------------------------

HELD_OUT = ["What is the capital of England?", "How many wheels does a bicycle have?", "What color is grass?",
            "Which animal says meow?", "What is the capital of Norway?", "How many legs does a dog have?",
            "What do birds lay?", "Which planet do we live on?"]


@pytest.mark.slow
def test_finetuned_smollm2_answers_in_the_learned_format(tmp_path, capsys, smollm2_default):
    """Every reply in the example set is "ANSWER: <word>."; SmolLM2-135M-Instruct never answers
    so. After four steps of two rows (~20 conversations) its greedy replies to questions it never
    saw follow the format and stop there, through `arlm chat`'s path (the checkpoint's template,
    the engine, the end-of-turn token); the training loss is ~0.15 by then, from ~4.5."""
    from arlm.llm import LLM
    from arlm.sampling import SamplingParams

    assert arlm_main(["prepare", "--chat", str(EXAMPLE), "--tokenizer", "smollm2", "--context-length", "128",
                      "--out", str(tmp_path / "data")]) == 0
    assert not any(q in EXAMPLE.read_text() for q in HELD_OUT)
    train(TrainConfig(data_dir=str(tmp_path / "data"), out_dir=str(tmp_path / "run"), init_from="smollm2",
                      context_length=128, batch_size=2, max_steps=4, warmup_steps=1, lr=2e-4, min_lr=2e-5,
                      weight_decay=0.0, eval_interval=0, eval_batches=1, log_interval=1, progress=False, plot=False,
                      dtype="float32"))
    greedy = SamplingParams(max_new_tokens=16, temperature=0)
    tuned, base = LLM.load(str(tmp_path / "run" / "latest"), quantize=None), smollm2_default  # (LLM.load("smollm2"))
    for llm, follows in ((tuned, True), (base, False)):
        prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in HELD_OUT]
        replies = [c.text for c in llm.generate(prompts, greedy)]
        assert [bool(re.fullmatch(r"ANSWER: [\w-]+\.", r)) for r in replies] == [follows] * len(HELD_OUT), replies
