"""EleutherAI's lm-evaluation-harness against a real `arlm serve`: a multiple-choice task from a
local JSONL file (tests/data/lm_eval, `dataset_path: json`, no network) scored through
`local-completions` (echo + logprobs, what its loglikelihood sends) and through `hf` (HF
transformers on the same GGUF in float32, the reference): the per-item loglikelihoods agree
within 1e-3 on arlm's float32 path and the accuracies are equal; a `generate_until` task runs to
completion through the server.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from servers import ServerProcess

DATA = Path(__file__).parent / "data" / "lm_eval"

def task_yaml(name: str, data: str, body: str) -> str:
    """An lm-eval task over a JSONL file of tests/data/lm_eval."""
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {DATA / data}\n"
            f"test_split: test\n{body}")


MC_TASK = task_yaml("arlm_mc", "mc.jsonl", """output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
""")

GEN_TASK = task_yaml("arlm_gen", "gen.jsonl", """output_type: generate_until
doc_to_text: "Q: {{question}}\\nA:"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, smollm2_default):
    """The tasks' YAML and an HF tokenizer directory (the GGUF's tokenizer, written once: both
    runs tokenize with it, so both score the same token ids)."""
    root = tmp_path_factory.mktemp("lm_eval")
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "arlm_mc.yaml").write_text(MC_TASK)
    (tasks / "arlm_gen.yaml").write_text(GEN_TASK)
    tok = root / "tokenizer"
    tok.mkdir()
    t = smollm2_default.tokenizer  # (the file's tokenizer, whatever the weights' path)
    (tok / "tokenizer.json").write_text(t.backend.to_str())
    name = lambda i: t.decode([i]) if i is not None else None  # noqa: E731
    (tok / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": name(t.eos_id), "bos_token": name(t.bos_id),
        "add_bos_token": False, "model_max_length": 8192}))
    return tasks, tok


def _evaluate(model, model_args: str | None, tasks_dir: Path, tasks: list[str]) -> dict:
    """lm-eval's run of `tasks`: `model` a registered name with its `model_args`, or an LM."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, log_samples=True,
                                   task_manager=TaskManager(include_path=str(tasks_dir)), batch_size=4)


def _loglikelihoods(results: dict, task: str) -> np.ndarray:
    """Every choice's loglikelihood, item after item (lm-eval keeps (loglikelihood, is_greedy)
    pairs, or the loglikelihood alone once filtered)."""
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])

    def ll(r):
        while isinstance(r, (list, tuple)):
            r = r[0]
        return float(r)
    return np.array([ll(r) for s in samples for r in s["resps"]], dtype=np.float64)


@pytest.mark.slow  # a server process, and HF's model
def test_lm_eval_through_the_server_matches_hf(setup, hf_smollm2):
    tasks, tok = setup
    server = ServerProcess("--quantize", "none", "--kv-cache-tokens", "4096")
    try:
        server.wait_ready()
        args = (f"model=smollm2,base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
                f"tokenizer={tok},num_concurrent=1,max_retries=1")
        ours = _evaluate("local-completions", args, tasks, ["arlm_mc", "arlm_gen"])
    finally:
        server.stop()
    # lm-eval's `hf` model over the session's HF load of the same GGUF (float32, on the CPU): what
    # `model=hf,pretrained=...,gguf_file=...,dtype=float32` loads, without dequantizing it again
    from lm_eval.models.huggingface import HFLM

    ref = _evaluate(HFLM(pretrained=hf_smollm2, tokenizer=str(tok), batch_size=4), None, tasks, ["arlm_mc"])
    a, b = _loglikelihoods(ours, "arlm_mc"), _loglikelihoods(ref, "arlm_mc")
    assert a.shape == b.shape == (39,)  # 10 items, 39 choices
    print(f"lm-eval: max |loglikelihood difference| {np.abs(a - b).max():.2e} over {len(a)} choices; accuracy "
          f"{ours['results']['arlm_mc']['acc,none']} vs {ref['results']['arlm_mc']['acc,none']}")
    assert np.abs(a - b).max() < 1e-3, np.abs(a - b).max()
    assert ours["results"]["arlm_mc"]["acc,none"] == ref["results"]["arlm_mc"]["acc,none"] >= 0.5
    gen = ours["results"]["arlm_gen"]
    assert len(ours["samples"]["arlm_gen"]) == 3 and "exact_match,none" in gen
