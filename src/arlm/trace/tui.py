"""`arlm trace` in the terminal (rich): the run's header, then every step as a panel."""

from __future__ import annotations

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def _slots(occupied: int, written: tuple[int, int], capacity: int, width: int = 48) -> Text:
    """A slot bar: written this step, occupied before, unallocated (scaled to `width` cells)."""
    cells = Text()
    scale = max(1, -(-capacity // width))
    for c in range(0, capacity, scale):
        if written[0] <= c < written[1] or (c < written[1] <= c + scale and written[1] > written[0]):
            cells.append("█", "bold green")
        elif c < occupied:
            cells.append("█", "blue")
        else:
            cells.append("░", "grey50")
    return cells


def step_panel(trace: dict, step: dict) -> Panel:
    m = trace["machine"]
    bw = step["bandwidth"]
    share = f" ({bw / m['bandwidth']:.0%} of the machine's {m['bandwidth'] / 1e9:.1f} GB/s)" if m.get("bandwidth") else ""
    title = (f"step {step['step']} · {step['phase']} · batch {step['batch_shape']} · "
             f"{step['seconds'] * 1e3:.2f} ms · {bw / 1e9:.1f} GB/s{share}")
    capacity = trace["cache"]["block_size"] * (1 if trace["cache"]["layout"] == "contiguous" else 1)
    parts = []
    for s in step["sequences"]:
        cap = capacity if trace["cache"]["layout"] == "contiguous" else len(s["blocks"]) * trace["cache"]["block_size"]
        line = Text(f"seq {s['seq']} ", style="bold")
        line.append(f"{s['phase']} input [1, {s['shape'][1]}] ")
        line.append("".join(s["input_text"]).replace("\n", "⏎")[-60:], style="cyan")
        if s.get("draft"):
            line.append(f"  draft {len(s['draft'])}, accepted {s['accepted']}", style="magenta")
        if s["sampled"]:
            line.append("  → ")
            line.append("".join(s["sampled_text"]).replace("\n", "⏎"), style="bold yellow")
        parts.append(line)
        bar = Text("  KV slots ")
        bar.append(_slots(s["slots_written"][0], tuple(s["slots_written"]), max(cap, s["slots_written"][1])))
        where = f"row {s['blocks'][0]}" if trace["cache"]["layout"] == "contiguous" else \
            f"blocks {s['blocks'][:8]}{'…' if len(s['blocks']) > 8 else ''}"
        bar.append(f" {s['slots_occupied']}/{max(cap, s['slots_occupied'])} ({where})")
        parts.append(bar)
        for d in s["distributions"][:1]:
            top = Table.grid(padding=(0, 1))
            for tok, p, kept, sampled_id, i in zip(d["text"][:5], d["p"][:5], d["kept"][:5], [d["sampled"]] * 5,
                                                  d["ids"][:5]):
                mark = "✓" if i == sampled_id else ("" if kept else "cut")
                top.add_row(f"  {tok!r}", f"{p:6.3f}", Text("█" * max(1, round(p * 30)), style="green" if kept else
                                                            "grey50"), mark)
            parts.append(top)
    parts.append(Text(f"  read: weights {_mb(step['bytes_weights'])}, K/V {_mb(step['bytes_kv'])} · "
                      f"{step['flops'] / 1e9:.2f} GFLOP · cache {step['kv']['tokens_cached']} tokens × "
                      f"{step['kv']['bytes_per_token']} B", style="grey70"))
    return Panel(Group(*parts), title=title, title_align="left",
                 border_style="green" if step["phase"] == "prefill" else "blue")


def print_trace(trace: dict, console: Console | None = None) -> None:
    console = console or Console(highlight=False)
    mod, c, m = trace["model"], trace["cache"], trace["machine"]
    console.print(Panel(
        f"{mod['name']}: {mod['n_layer']} layers, {mod['n_head']} heads ({mod['n_kv_heads']} KV) of {mod['head_dim']}, "
        f"d_model {mod['d_model']}, vocab {mod['vocab_size']} · weights {mod['quantization']}\n"
        + (f"sliding-window layers: {len(mod['sliding_layers'])} of {mod['n_layer']} read only their last "
           f"{mod['sliding_window']} positions (layers {', '.join(map(str, mod['sliding_layers']))}); their K/V "
           "reads are counted so\n" if mod.get("sliding_layers") else "") +
        f"KV cache: {c['layout']}, {c['dtype']}, shape {c['shape']} ([L, {'B' if c['layout'] == 'contiguous' else 'blocks'}, "
        f"H_kv, {'T' if c['layout'] == 'contiguous' else 'block'}, d_head]), {c['bytes_per_token']} bytes/token\n"
        f"machine: {m['cpu']}, {m.get('threads', '?')} threads, memory {m.get('bandwidth', 0) / 1e9:.1f} GB/s, "
        f"float32 matmul {m.get('flops', 0) / 1e9:.0f} GFLOP/s (measured)",
        title="arlm trace", title_align="left"))
    for step in trace["steps"]:
        console.print(step_panel(trace, step))
    for i, (p, o) in enumerate(zip(trace["prompts"], trace["outputs"])):
        t = Text(f"seq {i}: ", style="bold")
        t.append(p["text"], style="cyan")
        t.append(o["text"], style="bold yellow")
        t.append(f"  [{o['finish_reason']}]", style="grey50")
        console.print(t)
    prefill = [s for s in trace["steps"] if s["phase"] == "prefill"]
    decode = [s for s in trace["steps"] if s["phase"] == "decode"]
    if decode:
        ms = sum(s["seconds"] for s in decode) / len(decode) * 1e3
        console.print(f"{len(prefill)} prefill step(s), {len(decode)} decode steps: {ms:.2f} ms a decode step, "
                      f"{sum(s['bandwidth'] for s in decode) / len(decode) / 1e9:.1f} GB/s of weights and K/V")
