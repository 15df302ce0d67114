"""One configuration's decode and prefill speed, as one JSON line: the side of an A/B run.

    PYTHONPATH=/tmp/base/src .venv/bin/python benchmarks/speed_ab.py            # a worktree of the base
    PYTHONPATH=src .venv/bin/python benchmarks/speed_ab.py '{"activations": "int8"}'

The argument: LLM.load keyword arguments as JSON. Decode tokens/s at batch 1 (64-token prompt,
128 new tokens) and batch 8 (64 new tokens), prefill tokens/s of one 512-token prompt; random
prompt ids, greedy, EOS ignored. Run it for each side in turn, several times, and compare
medians (docs/benchmarks.md): the machine drifts more than most changes.
"""

import argparse
import json

import arlm

arlm.prefer_huge_pages()  # (as the arlm command does, before torch loads)

import torch  # noqa: E402

from arlm.llm import LLM  # noqa: E402
from arlm.sampling import SamplingParams  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("kwargs", nargs="?", type=json.loads, default={}, help="LLM.load keyword arguments as JSON")
kwargs = ap.parse_args().kwargs
llm = LLM.load("smollm2", **kwargs)
g = torch.Generator().manual_seed(0)
short = torch.randint(1000, 20000, (64,), generator=g).tolist()
batch = [torch.randint(1000, 20000, (64,), generator=g).tolist() for _ in range(8)]
long_prompt = torch.randint(1000, 20000, (512,), generator=g).tolist()


def params(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


llm.generate([short], params(8))  # warm
(c,) = llm.generate([short], params(128))
out = {"decode_b1": c.stats.decode_tokens_per_s}
out["decode_b8"] = llm.generate(batch, params(64))[0].stats.decode_tokens_per_s
(c,) = llm.generate([long_prompt], params(1))
out["prefill_512"] = c.stats.prefill_tokens_per_s
print(json.dumps({"config": kwargs, **{k: round(v, 1) for k, v in out.items()}}))
