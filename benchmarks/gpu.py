"""One short prepared run on an NVIDIA GPU: correctness against the CPU reference, then speed.

    python benchmarks/gpu.py [--json out.json]      # ~3-5 minutes on an H100/H200

1. Correctness: SmolLM2 float32 on CUDA (TF32 off) against the same weights on the CPU: logits
   within 1e-3 relative, and 32 greedy tokens identical; the bf16 + CUDA-graph path's greedy
   tokens against the float32 CUDA path (reported, and must agree on the first 8 tokens).
2. Decode tokens/s at batch 1 and 32: eager float32, and bf16 with torch.compile's
   "reduce-overhead" mode (CUDA graphs), 128 new tokens, greedy.
3. Training-step model-FLOPs utilization for a GPT-2-124M-size config (12 layers, 12 heads,
   d_model 768, context 1024), bf16 autocast, fused AdamW, torch.compile: MFU = 6 * params *
   tokens/s / the card's dense bf16 peak.
Exits non-zero if a correctness check fails. No GPU: says so and exits 0 (nothing to measure).
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
from arlm.generate import Generation  # noqa: E402
from arlm.llm import LLM  # noqa: E402
from arlm.model import Transformer  # noqa: E402
from arlm.sampling import SamplingParams  # noqa: E402

# Dense bf16 tensor-core peaks (TFLOP/s), from the vendors' data sheets (SXM parts).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "4090": 165e12}


def greedy(llm: LLM, prompts: list[list[int]], n: int) -> tuple[list[list[int]], float]:
    gen = Generation(llm.model, prompts, SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True),
                     decode_fn=llm.decode_fn, static_kv_len=llm.static_kv_len)
    for _ in gen:
        pass
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return gen.completions, gen.stats.decode_tokens_per_s


def train_mfu(steps: int = 20) -> dict:
    cfg = ModelConfig.gpt2(vocab_size=50304, max_seq_len=1024)
    model = Transformer(cfg).cuda()
    n_params = sum(p.numel() for p in model.parameters() if p is not model.pos_emb.weight)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    step_fn = torch.compile(model)
    B, T = 16, 1024
    x = torch.randint(0, cfg.vocab_size, (B, T + 1), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = step_fn(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    tokens_per_s = B * T / dt
    flops = 6 * n_params * tokens_per_s  # forward + backward matmuls; attention excluded
    return {"step_ms": dt * 1e3, "tokens_per_s": tokens_per_s, "params": n_params,
            "mfu": flops / peak if peak else None}


def main() -> int:
    ap = argparse.ArgumentParser(description="GPU correctness + speed check")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "date": time.strftime("%Y-%m-%d")}
    ok = True

    cpu = LLM.load("smollm2", quantize=None)
    gpu = LLM.load("smollm2", device="cuda", quantize=None)
    ids = cpu.tokenizer.encode("The capital of France is Paris. The capital of Germany is")
    with torch.inference_mode():
        ref = cpu.model(torch.tensor([ids]))
        out = gpu.model(torch.tensor([ids], device="cuda")).cpu()
    rel = ((out - ref).abs().max() / ref.abs().max()).item()
    res["logits_rel_err_fp32"] = rel
    ok &= rel <= 1e-3
    cpu_tokens, _ = greedy(cpu, [ids], 32)
    gpu_tokens, _ = greedy(gpu, [ids], 32)
    res["greedy32_equal_cpu_vs_cuda_fp32"] = cpu_tokens == gpu_tokens
    ok &= cpu_tokens == gpu_tokens
    print(f"correctness: logits rel err {rel:.2e}; greedy 32 tokens equal: {cpu_tokens == gpu_tokens}")

    prompts = [cpu.tokenizer.encode(f"Story number {i}: once upon a time") for i in range(32)]
    for label, llm in (("fp32-eager", gpu), ("bf16-cudagraph", None)):
        if llm is None:
            llm = LLM.load("smollm2", device="cuda", dtype=torch.bfloat16, quantize=None, compile=True)
            fast_tokens, _ = greedy(llm, [ids], 32)
            agree = sum(a == b for a, b in zip(fast_tokens[0], gpu_tokens[0]))
            res["bf16_greedy_agreement_of_32"] = agree
            ok &= fast_tokens[0][:8] == gpu_tokens[0][:8]
            print(f"bf16 + CUDA graphs: {agree}/32 greedy tokens agree with fp32")
        for b in (1, 32):
            greedy(llm, prompts[:b], 8)  # warm-up (and compile / graph capture)
            _, tps = greedy(llm, prompts[:b], 128)
            res[f"decode_{label}_b{b}_tokens_per_s"] = tps
            print(f"decode {label} batch {b}: {tps:.0f} tokens/s")

    res["train_gpt2_124m"] = train_mfu()
    print(f"training GPT-2-124M: {res['train_gpt2_124m']}")
    res["ok"] = bool(ok)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    print("OK" if ok else "CORRECTNESS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
