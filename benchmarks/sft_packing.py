"""Chat fine-tuning rows: conversations packed several to a row (what `arlm prepare --chat` writes)
against one conversation a row, padded to the context.

    .venv/bin/python benchmarks/sft_packing.py [--context-length 512] [--conversations 300]
        [--median-words 25] [--layers 4] [--batch-size 4] [--steps 4] [--threads 2]

The conversations are synthetic (no chat corpus ships with arlm): 1 to 3 user/assistant exchanges,
each message a run of tiny Shakespeare's words whose length is lognormal (median --median-words,
sigma 0.8), rendered with SmolLM2's chat template and tokenized with its tokenizer. The packed
layout is `arlm prepare --chat`'s own (prepare_chat, then ChatData's batches: a block-diagonal
attention mask and positions from 0 per conversation); the padded one puts each conversation alone
in a row, pads it to the context and runs plain causal attention (no mask), the cheapest way a
padded row can run.

Each step is the trainer's: forward, the masked loss, backward and AdamW, in the trainer's
precision (`--dtype auto`), on SmolLM2-135M's shape cut to --layers of its 30 layers (random
weights: the cost is the shape's). Steps alternate between the layouts so that a change in the
machine's load falls on both. Reported for each: rows, the fraction of row tokens that are
padding, row tokens/s, conversation tokens/s (row tokens less padding) and the time one epoch of
the conversations takes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from arlm.loading import resolve_model_path  # noqa: E402
from arlm.loading.gguf import open_gguf  # noqa: E402
from arlm.model import Transformer  # noqa: E402
from arlm.train import TrainConfig  # noqa: E402
from arlm.train.chat import ChatEncoder, parse_conversation  # noqa: E402
from arlm.train.data import IGNORE, Batch, TokenData, default_corpus, prepare_chat  # noqa: E402
from arlm.train.trainer import autocast_dtype, batch_loss, configure_optimizer, mixed_precision  # noqa: E402
from bench_args import positive_int  # noqa: E402


def conversations(n: int, median_words: int, seed: int = 0) -> list[dict]:
    words = default_corpus().read_text(encoding="utf-8").split()
    rng = np.random.default_rng(seed)

    def message() -> str:
        k = max(1, int(rng.lognormal(np.log(median_words), 0.8)))
        start = int(rng.integers(0, len(words) - k))
        return " ".join(words[start:start + k])

    return [{"messages": [m for _ in range(int(rng.integers(1, 4)))
                          for m in ({"role": "user", "content": message()}, {"role": "assistant", "content": message()})]}
            for _ in range(n)]


def padded_rows(convs: list[dict], encoder: ChatEncoder, row_tokens: int,
                pad_id: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One conversation a row: ids and learned [rows, row_tokens], and the conversations' tokens."""
    encoded = [encoder.encode(parse_conversation(json.dumps(c))) for c in convs]
    ids = torch.full((len(encoded), row_tokens), pad_id, dtype=torch.int64)
    learned = torch.zeros((len(encoded), row_tokens), dtype=torch.bool)
    for r, e in enumerate(encoded):
        ids[r, :len(e.ids)], learned[r, :len(e.ids)] = torch.from_numpy(e.ids), torch.from_numpy(e.learned)
    return ids, learned, sum(len(e.ids) for e in encoded)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context-length", type=positive_int, default=512)
    ap.add_argument("--conversations", type=positive_int, default=300)
    ap.add_argument("--median-words", type=positive_int, default=25, help="median words per message")
    ap.add_argument("--layers", type=positive_int, default=4)
    ap.add_argument("--batch-size", type=positive_int, default=4)
    ap.add_argument("--steps", type=positive_int, default=4, help="timed steps per layout (after one warm-up)")
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    L = args.context_length

    convs = conversations(args.conversations, args.median_words)
    with tempfile.TemporaryDirectory() as tmp:
        chat = Path(tmp) / "chat.jsonl"
        chat.write_text("".join(json.dumps(c) + "\n" for c in convs))
        t0 = time.perf_counter()
        meta = prepare_chat([chat], Path(tmp) / "data", tokenizer="smollm2", context_length=L, val_fraction=0.01,
                            skip_bad=True)
        prepare_s = time.perf_counter() - t0
        packed = TokenData.open(Path(tmp) / "data")
        tok = packed.tokenizer
        encoder = ChatEncoder(meta["chat_template"], tok)
        kept = [c for c in convs if len(encoder.encode(parse_conversation(json.dumps(c))).ids) <= L + 1]
        kept = kept[:meta["train_conversations"]]  # the same conversations as the packed train split
        pad_ids, pad_learned, conv_tokens = padded_rows(kept, encoder, L + 1, tok.eos_id)
        layouts = {"packed": (meta["train_rows"], meta["train_padding"]),
                   "padded": (len(pad_ids), 1.0 - conv_tokens / pad_ids.numel())}

        config = replace(open_gguf(resolve_model_path("smollm2")).config, n_layer=args.layers)
        torch.manual_seed(0)
        model = Transformer(config).train()
        cfg = TrainConfig(dtype=args.dtype)
        device = torch.device("cpu")
        optimizer = configure_optimizer(model, cfg, device)
        amp = autocast_dtype(cfg, device)
        rng = np.random.default_rng(0)
        B = args.batch_size

        def packed_batch() -> Batch:
            return packed.batch("train", packed.offsets("train", B, L, rng), L, device)

        def padded_batch() -> Batch:
            rows = torch.from_numpy(rng.integers(0, len(pad_ids), size=B))
            ids, learned = pad_ids[rows], pad_learned[rows]
            return Batch(ids[:, :-1], torch.where(learned[:, 1:], ids[:, 1:], IGNORE))

        def step(batch: Batch) -> float:
            t = time.perf_counter()
            with mixed_precision(device, amp):
                loss = batch_loss(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return time.perf_counter() - t

        makers = {"packed": packed_batch, "padded": padded_batch}
        times: dict[str, list[float]] = {k: [] for k in makers}
        for i in range(args.steps + 1):
            for name, make in makers.items():
                dt = step(make())
                if i:  # the first step of each warms up
                    times[name].append(dt)

    print(f"{len(kept)} conversations (of {len(convs)}: {len(convs) - len(kept) - meta['val_conversations']} longer "
          f"than the context, {meta['val_conversations']} held out), {conv_tokens:,} tokens; context {L}; "
          f"prepare_chat {prepare_s:.1f} s; SmolLM2 shape with {args.layers} layers, batch {B}, "
          f"{str(amp or torch.float32).replace('torch.', '')}, {args.threads} threads")
    print(f"{'layout':<8} {'rows':>6} {'padding':>8} {'row tok/s':>10} {'conv tok/s':>11} {'epoch s':>8}")
    for name, (rows, padding) in layouts.items():
        s = float(np.median(times[name]))
        row_rate = B * L / s
        print(f"{name:<8} {rows:>6} {padding:>8.1%} {row_rate:>10,.0f} {row_rate * (1.0 - padding):>11,.0f} "
              f"{rows * s / B:>8.1f}")


if __name__ == "__main__":
    main()
