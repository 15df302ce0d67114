"""One short prepared run on an NVIDIA GPU: correctness against the CPU reference, then speed.

    python benchmarks/gpu.py [--json out.json]      # ~3-5 minutes on an H100/H200
    python benchmarks/gpu.py --device cpu --smoke   # the script itself on CPU, tiny sizes (a test runs it)

1. Correctness: SmolLM2 float32 on CUDA (TF32 off) against the same weights on the CPU: logits
   within 1e-3 relative, and 32 greedy tokens identical; the bf16 + CUDA-graph path's greedy
   tokens against the float32 CUDA path (reported, and must agree on the first 8 tokens).
2. Decode tokens/s at batch 1 and 32: eager float32, and bf16 with torch.compile's
   "reduce-overhead" mode (CUDA graphs), 128 new tokens, greedy.
3. Training-step model-FLOPs utilization for a GPT-2-124M-size config (12 layers, 12 heads,
   d_model 768, context 1024), bf16 autocast, fused AdamW, torch.compile: MFU = 6 * params *
   tokens/s / the card's dense bf16 peak.
Exits non-zero if a correctness check fails. No GPU: says so and exits 0 (nothing to measure).
`--smoke` runs every step with tiny sizes (4-8 new tokens, batches 1 and 2, a 2-layer training
config, no compile off CUDA but the CUDA-graph path's static KV length): it checks the script, so
that a GPU session's few minutes are not lost to a bug in it; its speed figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from arlm.config import ModelConfig  # noqa: E402
from arlm.engine import ModelRunner  # noqa: E402
from arlm.llm import LLM  # noqa: E402
from arlm.model import Transformer  # noqa: E402
from arlm.sampling import SamplingParams  # noqa: E402

# Dense bf16 tensor-core peaks (TFLOP/s), from the vendors' data sheets (SXM parts).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "4090": 165e12}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def greedy(llm: LLM, prompts: list[list[int]], n: int) -> tuple[list[list[int]], float]:
    """`LLM.generate`'s greedy tokens and its decode tokens/s (each engine step ends in a host
    sync: sampling reads the tokens back)."""
    completions = llm.generate(prompts, SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))
    sync(next(llm.model.parameters()).device)
    return [c.token_ids for c in completions], completions[0].stats.decode_tokens_per_s


def train_mfu(device: torch.device, smoke: bool = False) -> dict:
    if smoke:
        cfg = ModelConfig.gpt2(vocab_size=50304, max_seq_len=64, n_layer=2, n_head=2, d_model=64)
        B, T, steps = 2, 64, 2
    else:
        cfg = ModelConfig.gpt2(vocab_size=50304, max_seq_len=1024)
        B, T, steps = 16, 1024, 20
    model = Transformer(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters() if p is not model.pos_emb.weight)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    step_fn = torch.compile(model) if device.type == "cuda" else model
    x = torch.randint(0, cfg.vocab_size, (B, T + 1), device=device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = step_fn(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    dt = (time.perf_counter() - t0) / steps
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    tokens_per_s = B * T / dt
    flops = 6 * n_params * tokens_per_s  # forward + backward matmuls; attention excluded
    return {"step_ms": dt * 1e3, "tokens_per_s": tokens_per_s, "params": n_params,
            "mfu": flops / peak if peak else None}


def main() -> int:
    ap = argparse.ArgumentParser(description="GPU correctness + speed check")
    ap.add_argument("--device", default="cuda", help="the device to check (default: cuda; cpu with --smoke)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script, measures nothing")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        ap.error(f"--device: {e}")
    if device.type not in ("cuda", "cpu"):
        ap.error(f"--device: expected cuda, cuda:N or cpu, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        ap.error(f"--device: {args.device} does not exist ({torch.cuda.device_count()} CUDA device(s))")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    res: dict = {"device": name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "smoke": args.smoke}
    ok = True
    n_check, n_speed, batches = (8, 8, (1, 2)) if args.smoke else (32, 128, (1, 32))

    cpu = LLM.load("smollm2", quantize=None)
    gpu = LLM.load("smollm2", device=str(device), quantize=None)
    ids = cpu.tokenizer.encode("The capital of France is Paris. The capital of Germany is")
    with torch.inference_mode():
        ref = cpu.model(torch.tensor([ids]))
        out = gpu.model(torch.tensor([ids], device=device)).cpu()
    rel = ((out - ref).abs().max() / ref.abs().max()).item()
    res["logits_rel_err_fp32"] = rel
    ok &= rel <= 1e-3
    cpu_tokens, _ = greedy(cpu, [ids], n_check)
    gpu_tokens, _ = greedy(gpu, [ids], n_check)
    res[f"greedy{n_check}_equal_cpu_vs_device_fp32"] = cpu_tokens == gpu_tokens
    ok &= cpu_tokens == gpu_tokens
    print(f"correctness: logits rel err {rel:.2e}; greedy {n_check} tokens equal: {cpu_tokens == gpu_tokens}")

    prompts = [cpu.tokenizer.encode(f"Story number {i}: once upon a time") for i in range(max(batches))]
    for label, llm in (("fp32-eager", gpu), ("bf16-cudagraph", None)):
        if llm is None:
            # CUDA graphs need torch.compile; off CUDA (--smoke) the same static-KV-length path runs eagerly
            llm = LLM.load("smollm2", device=str(device), dtype=torch.bfloat16, quantize=None,
                           compile=device.type == "cuda")
            if not llm.runner.static_kv_len:  # (compile on CUDA sets it)
                r = llm.runner
                llm._start(ModelRunner(r.model, r.decode_fn, static_kv_len=True, dense_prefill=r.dense_prefill))
            fast_tokens, _ = greedy(llm, [ids], n_check)
            agree = sum(a == b for a, b in zip(fast_tokens[0], gpu_tokens[0]))
            res[f"bf16_greedy_agreement_of_{n_check}"] = agree
            ok &= fast_tokens[0][:8] == gpu_tokens[0][:8]
            print(f"bf16 + CUDA graphs: {agree}/{n_check} greedy tokens agree with fp32")
        for b in batches:
            greedy(llm, prompts[:b], 8)  # warm-up (and compile / graph capture)
            _, tps = greedy(llm, prompts[:b], n_speed)
            res[f"decode_{label}_b{b}_tokens_per_s"] = tps
            print(f"decode {label} batch {b}: {tps:.0f} tokens/s")

    res["train_gpt2_124m"] = train_mfu(device, smoke=args.smoke)
    print(f"training GPT-2-124M{' (smoke: 2 layers, d 64)' if args.smoke else ''}: {res['train_gpt2_124m']}")
    res["ok"] = bool(ok)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    print("OK" if ok else "CORRECTNESS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
