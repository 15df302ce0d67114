"""Embeddings: the mean of a prompt's final normed hidden states, L2-normalized, computed
as a prompt-only request on the engine that serves generation (Engine.add_request(embed=True)):
chunked as any prompt, batched with other requests, never from the prefix cache, no blocks kept."""

import pytest
import torch

from arlm.engine import Engine, EngineConfig, ModelRunner
from arlm.sampling import SamplingParams

from conftest import arlm_from_hf, hf_family, hf_llama


def _reference(model, ids):
    """The definition: the modules without a cache, every position's normed hidden state."""
    with torch.no_grad():
        _, h = model(torch.tensor([ids]), hidden_index=torch.arange(len(ids)))
    mean = h.double().mean(0)
    return (mean / mean.norm()).float()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("modules", [False, True])
def test_embedding_is_the_pooled_hidden_states(family, modules):
    # Prompts longer than a step (chunks of 8), beside a generating request, after the same
    # prompt was cached by another request: each vector is the definition's (1e-5), on the native
    # stack and the modules (a bfloat16 cache has no native kernel: the module path, 2e-3), and
    # the pools are empty at the end.
    model = arlm_from_hf(hf_llama(seed=3) if family == "llama" else hf_family("gemma3", seed=3))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 190, (n,), generator=g).tolist() for n in (30, 5, 17)]
    kv = torch.bfloat16 if modules else None
    engine = Engine(ModelRunner(model), (), EngineConfig(block_size=4, kv_cache_tokens=512, max_num_batched_tokens=8,
                                                         kv_dtype=kv))
    assert engine.cache.use_kernel != modules
    engine.generate([prompts[0]], SamplingParams(max_new_tokens=3, temperature=0))  # (now in the prefix cache)
    chat = engine.add_request(prompts[1] * 3, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    reqs = [engine.add_request(p, SamplingParams(), embed=True) for p in prompts]
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.embedding is not None:
                outs[o.request_id] = o
    assert len(chat.output_ids) == 12
    for r, p in zip(reqs, prompts):
        o = outs[r.request_id]
        assert o.token_id == -1 and o.num_output_tokens == 0 and r.num_cached_tokens == 0
        want = _reference(model, p)
        tol = 2e-3 if modules else 1e-5
        assert (o.embedding - want).abs().max().item() < tol and abs(o.embedding.norm().item() - 1) < 1e-5
    s = engine.scheduler
    assert s.pool.num_free == s.pool.n_blocks


def test_llm_embed_and_its_errors(smollm2):
    from arlm.llm import PromptError

    texts = ["The cat sat on the mat.", "A cat was sitting on a mat.", "Quarterly revenue rose by 4%."]
    vectors = smollm2.embed(texts)
    assert vectors.shape == (3, smollm2.model.config.d_model) and vectors.dtype == torch.float32
    assert torch.allclose(vectors.norm(dim=1), torch.ones(3), atol=1e-5)
    assert torch.allclose(smollm2.embed(texts[1])[0], vectors[1], atol=1e-5)  # alone as in a batch
    sims = vectors @ vectors.T
    assert sims[0, 1] > sims[0, 2]  # (the paraphrase closer than the unrelated sentence)
    with pytest.raises(PromptError):
        smollm2.embed([])


def test_embed_command(capfd, tmp_path):
    import json

    from conftest import run_arlm

    f = tmp_path / "in.txt"
    f.write_text("The cat sat on the mat.\n\nA dog ran in the park.\n")
    r = run_arlm(capfd, "embed", str(f), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert [x["text"] for x in d["data"]] == ["The cat sat on the mat.", "A dog ran in the park."]
    assert d["dimensions"] == len(d["data"][0]["embedding"]) and "mean" in d["pooling"]
    r = run_arlm(capfd, "embed", "The cat sat on the mat.")
    assert r.returncode == 0 and len(r.stdout.split()) == d["dimensions"]
    for bad in (str(tmp_path / "missing.txt"), ""):
        r = run_arlm(capfd, "embed", bad)
        assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
