"""arlm perplexity: the strided windows against HF transformers' own forward passes, the engine's
prompt logits (batching, chunked prefill, the module path), the logits file and KL divergence,
and the command line (in process, through `arlm.cli.main`)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import arlm.cli
import arlm.perplexity
from arlm.engine import Engine, EngineConfig, ModelRunner
from arlm.perplexity import LogitsWriter, evaluate, kl_stats, read_logits, stream_nll, windows
from arlm.sampling import SamplingParams

TEXT = ("The lighthouse stood at the edge of the cliff for more than two hundred years. Every night the "
        "keeper climbed the narrow stairs, trimmed the wick and wound the clockwork that turned the great lens. "
        "Ships passing in the dark counted its flashes to learn where they were: three short, one long, then "
        "silence. When the electric lamp arrived, the keeper stayed on to polish the brass and write the weather "
        "in a thick book, and the children of the village came on Sundays to hear how the storm of 1887 had "
        "broken every window on the seaward side. Nobody remembers now who lit the lamp the last time, but the "
        "book is still there, its final page blank except for the date.")
CONTEXT, STRIDE = 64, 32
GREEDY = SamplingParams(max_new_tokens=1, temperature=0.0)
U16 = 2.0 ** -11  # float16's unit roundoff: a stored log-probability l comes back as l(1 + e), |e| <= U16


@pytest.fixture(scope="module")
def ids(smollm2):
    ids = smollm2.tokenizer.encode(TEXT)
    assert 130 <= len(ids) <= 170  # ~150 tokens: 4 windows of 64 at stride 32, the last one short
    return ids


@pytest.fixture(scope="module")
def base_file(smollm2, ids, tmp_path_factory):
    """The float32 run's logits file (context 64, stride 32) and its result."""
    path = tmp_path_factory.mktemp("logits") / "base.lgp"
    return path, evaluate(smollm2, ids, CONTEXT, STRIDE, save_logits=path)


def run(engine: Engine, reqs) -> None:
    while not all(r.finished for r in reqs):
        for out in engine.step():
            assert out.error is None, out.error


# -- windows ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, context, stride", [(150, 64, 32), (150, 64, 64), (150, 64, 1), (10, 4, 3),
                                                (2, 2, 1), (100, 512, 256), (513, 512, 256)])
def test_windows_score_every_token_once(n, context, stride):
    wins = windows(n, context, stride)
    scored = [t for w in wins for t in range(w.first, w.end)]
    if stride < context:
        assert scored == list(range(1, n))  # each once, in order
    else:  # non-overlapping: a window's first token has no context in it
        assert scored == [t for t in range(1, n) if t % context]
    assert [w.begin for w in wins] == [stride * i for i in range(len(wins))]
    assert all(w.length <= context and w.begin < w.first for w in wins)
    assert wins[-1].end == n and all(w.end < n for w in wins[:-1])  # stop after the window that reaches the end


# -- against HF transformers -----------------------------------------------------------------------

@pytest.mark.slow
def test_perplexity_matches_hf(smollm2, hf_smollm2, ids):
    """HF's strided perplexity done by hand (one HF forward pass per window, float64 log-softmax):
    the same scored tokens, and a perplexity within 1e-4 relative of arlm's float32 engine path.
    Per token: float32 logits agree to ~1e-4 absolute, so each NLL within 1e-3."""
    result = evaluate(smollm2, ids, CONTEXT, STRIDE)
    hf_nll, prev_end = [], 0
    for begin in range(0, len(ids), STRIDE):
        end = min(begin + CONTEXT, len(ids))
        first = max(prev_end, 1)
        with torch.no_grad():
            logits = hf_smollm2(torch.tensor([ids[begin:end]])).logits[0].double()
        logp = torch.log_softmax(logits[first - 1 - begin:end - 1 - begin], -1)
        hf_nll.append(-logp.gather(1, torch.tensor(ids[first:end])[:, None])[:, 0])
        prev_end = end
        if end == len(ids):
            break
    hf_nll = torch.cat(hf_nll).numpy()
    assert len(result.nll) == len(hf_nll) == len(ids) - 1 and len(result.windows) == 4
    assert np.abs(result.nll - hf_nll).max() < 1e-3
    hf_ppl = math.exp(hf_nll.mean())
    assert abs(result.perplexity / hf_ppl - 1) < 1e-4, (result.perplexity, hf_ppl)


# -- the engine's prompt logits --------------------------------------------------------------------

def test_batching_windows_changes_nothing(smollm2, smollm2_default, ids):
    """One window per forward pass, two, or all four in one: the same NLLs, bit for bit on the
    quantized native path (its integer kernels sum a token's products in the same order whatever
    else its pass holds); within float32 rounding on the float32 model, whose prompt GEMMs (MKL)
    may sum a row in another order as the pass's row count changes (seen on Intel Xeons)."""
    nll = [evaluate(smollm2_default, ids, CONTEXT, STRIDE, batch_tokens=b).nll for b in (CONTEXT, 2 * CONTEXT, 4096)]
    assert np.array_equal(nll[0], nll[1]) and np.array_equal(nll[0], nll[2])
    nll = [evaluate(smollm2, ids, CONTEXT, STRIDE, batch_tokens=b).nll for b in (CONTEXT, 2 * CONTEXT, 4096)]
    np.testing.assert_allclose(nll[1], nll[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(nll[2], nll[0], rtol=1e-4, atol=1e-5)


def test_chunked_prefill_gives_the_same_prompt_logits(smollm2, ids):
    """A paged engine computing the prompt in chunks of 16 tokens (beside another request) keeps
    the same rows as one pass, within 2e-4 absolute on logits of magnitude ~20 (float32: the
    chunks' GEMMs and attention over the cache sum in another order); both match the model's
    uncached forward within 1e-3. The last row is the one the first token was sampled from;
    a request without the flag keeps nothing."""
    prompt = ids[:100]

    def prompt_logits(budget: int):
        engine = Engine(smollm2.runner, (), EngineConfig(block_size=16, kv_cache_tokens=512,
                                                         max_num_batched_tokens=budget))
        kept = engine.add_request(prompt, GREEDY, prompt_logits=True)
        other = engine.add_request(ids[:40], GREEDY)
        run(engine, [kept, other])
        assert other.prompt_logits is None
        return kept

    whole, chunked = prompt_logits(512), prompt_logits(16)
    assert whole.prompt_logits.shape == (100, smollm2.model.config.vocab_size)
    assert whole.prompt_logits.dtype == torch.float32
    assert (chunked.prompt_logits - whole.prompt_logits).abs().max() < 2e-4
    with torch.inference_mode():
        reference = smollm2.model(torch.tensor([prompt]))[0]
    assert (whole.prompt_logits - reference).abs().max() < 1e-3
    assert whole.output_ids == chunked.output_ids == [int(whole.prompt_logits[-1].argmax())]


def test_prompt_logits_on_the_module_path(smollm2, ids, monkeypatch):
    """Without the native stack a contiguous engine prefills a static batch by rows (`_prefill_rows`,
    the last position only); a request that keeps its prompt's logits goes through the block
    table instead, beside one that does not, which samples what it samples alone."""
    monkeypatch.setenv("ARLM_NO_FUSED", "1")
    runner = ModelRunner(smollm2.model)
    assert runner.native is None

    def engine():
        return Engine(runner, (), EngineConfig(block_size=None, max_num_batched_tokens=4096))

    alone = engine()
    plain_alone = alone.add_request(ids[:30], GREEDY)
    run(alone, [plain_alone])
    mixed = engine()
    kept, plain = mixed.add_request(ids[:50], GREEDY, prompt_logits=True), mixed.add_request(ids[:30], GREEDY)
    run(mixed, [kept, plain])
    with torch.inference_mode():
        reference = smollm2.model(torch.tensor([ids[:50]]))[0]
    assert kept.prompt_logits.shape == reference.shape
    assert (kept.prompt_logits - reference).abs().max() < 1e-3
    assert plain.prompt_logits is None and plain.output_ids == plain_alone.output_ids


# -- the logits file and KL divergence --------------------------------------------------------------

def test_logits_file_holds_the_float16_log_probabilities(base_file, ids, smollm2):
    path, result = base_file
    header, rows = read_logits(path)
    vocab = smollm2.model.config.vocab_size
    assert rows.shape == (len(ids) - 1, vocab) and rows.dtype == np.float16
    assert header["token_ids"] == ids and (header["context"], header["stride"]) == (CONTEXT, STRIDE)
    assert header["windows"] == [[w.begin, w.first, w.end] for w in result.windows]
    assert header["config"]["quantization"] == "none" and header["bos"] is False
    stored = -rows[np.arange(len(ids) - 1), ids[1:]].astype(np.float64)  # row k predicts token k + 1
    assert np.all(np.abs(stored - result.nll) <= U16 * result.nll + 1e-5)  # + float32's log_softmax
    assert not list(path.parent.glob(".*.tmp"))  # the temporary file was renamed


def test_a_failed_run_leaves_the_old_file(base_file, ids, smollm2, monkeypatch, tmp_path):
    """--save-logits is atomic: a run that fails part way leaves BASE as it was, and no temporary file."""
    path = tmp_path / "kept.lgp"
    path.write_bytes(b"the old file")

    def one_window_then_fail(*args):
        yield next(iter(window_logits(*args)))
        raise RuntimeError("interrupted")

    window_logits = arlm.perplexity.window_logits
    monkeypatch.setattr(arlm.perplexity, "window_logits", one_window_then_fail)
    with pytest.raises(RuntimeError, match="interrupted"):
        evaluate(smollm2, ids, CONTEXT, STRIDE, save_logits=path)
    assert path.read_bytes() == b"the old file" and list(tmp_path.iterdir()) == [path]


def test_kl_of_the_same_configuration_is_float16_rounding(base_file, ids, smollm2):
    """Against its own saved run: the same NLLs bit for bit, 100 % top-1, and a KL that only the
    float16 storage makes non-zero. Bound: a stored row is l + d, |d_v| <= U16 |l_v|; renormalized
    (kl_positions), KL(softmax(l + d) || softmax(l)) = 1/2 Var_p(d) + O(d^3) <= 1/2 U16^2 E_p[l^2],
    and E_p[(log p)^2] <= (log V)^2 (Jensen, p log^2 p concave below 1/e): 1/2 * 2^-22 * 10.8^2
    = 1.4e-5 at every position. The perplexities differ by the target's rounding plus the
    renormalization shift: |d log ppl| <= U16 (mean NLL + log V)."""
    path, first = base_file
    again = evaluate(smollm2, ids, CONTEXT, STRIDE, base=read_logits(path))
    kl = again.kl
    assert np.array_equal(again.nll, first.nll)
    assert kl["positions"] == len(ids) - 1
    bound = 0.5 * U16 ** 2 * math.log(smollm2.model.config.vocab_size) ** 2
    assert 0 <= kl["max_kl"] < bound and kl["mean_kl"] < bound
    assert kl["top1_agreement"] == 100.0
    assert kl["perplexity"] == pytest.approx(again.perplexity, rel=1e-12)
    slack = U16 * (float(first.nll.mean()) + math.log(smollm2.model.config.vocab_size))
    assert abs(math.log(kl["base_perplexity"] / kl["perplexity"])) <= slack


def test_kl_stats_on_known_distributions():
    """Two-token distributions by hand: KL(p || q) = sum p log(p / q), the argmax and the target's
    log-probabilities; logits and log-probabilities give the same numbers (rows are normalized)."""
    p = torch.tensor([[0.9, 0.1], [0.5, 0.5], [0.2, 0.8]], dtype=torch.float64)
    q = torch.tensor([[0.6, 0.4], [0.5, 0.5], [0.7, 0.3]], dtype=torch.float64)
    targets = np.array([0, 1, 1])
    kl = (p * (p / q).log()).sum(-1).numpy()
    stats = kl_stats(p.log().numpy(), q.log() + 3.0, targets)  # q as logits (shifted log-probabilities)
    assert stats["mean_kl"] == pytest.approx(kl.mean(), rel=1e-12)
    assert stats["max_kl"] == pytest.approx(kl.max(), rel=1e-12)
    assert stats["median_kl"] == pytest.approx(np.median(kl), rel=1e-12)
    assert stats["top1_agreement"] == pytest.approx(100 * 2 / 3)  # argmax 0/0, tie 0/0, 1/0
    logp, logq = p.log().numpy()[[0, 1, 2], targets], q.log().numpy()[[0, 1, 2], targets]
    assert stats["mean_abs_delta_logp"] == pytest.approx(np.abs(logq - logp).mean(), rel=1e-12)
    assert stats["base_perplexity"] == pytest.approx(math.exp(-logp.mean()), rel=1e-12)
    assert stats["perplexity"] == pytest.approx(math.exp(-logq.mean()), rel=1e-12)


# -- the command line --------------------------------------------------------------------------------

@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


@pytest.fixture
def cli(monkeypatch, smollm2, capsys):
    """arlm.cli.main with the float32 model already loaded (--quantize none): (exit code, stdout, stderr)."""
    monkeypatch.setattr(arlm.cli, "load_llm", lambda args: smollm2)

    def main(*args: str) -> tuple[int, str, str]:
        rc = arlm.cli.main(["perplexity", *map(str, args)])
        out, err = capsys.readouterr()
        return rc, out, err

    return main


def test_cli_json_and_text(cli, text_file, base_file, ids):
    path, result = base_file
    rc, out, err = cli(text_file, "--quantize", "none", "--context", CONTEXT, "--stride", STRIDE, "--json")
    assert rc == 0, err
    report = json.loads(out)
    assert report["perplexity"] == pytest.approx(result.perplexity, rel=1e-12)
    assert (report["tokens_scored"], report["windows"], report["text_tokens"]) == (len(ids) - 1, 4, len(ids))
    assert report["quantization"] == "none" and report["kv_dtype"] == "float32" and report["bos"] is False
    rc, out, err = cli(text_file, "--quantize", "none", "--context", CONTEXT, "--kl-divergence", path)
    assert rc == 0, err
    assert "perplexity:" in out and "no BOS token" in out and "top-1 agreement: 100.00 %" in out


def test_cli_kv_window_is_one_stream(cli, text_file, ids):
    """--kv-window W --kv-sinks S scores the text as one stream (perplexity.stream_nll), every
    token but the first once; a window wider than the text is full attention over one pass."""
    rc, out, err = cli(text_file, "--quantize", "none", "--kv-window", 24, "--kv-sinks", 2, "--batch-tokens", 16,
                       "--json")
    assert rc == 0, err
    report = json.loads(out)
    nll = stream_nll(arlm.cli.load_llm(None), ids, 24, 2, chunk=16)
    assert report["perplexity"] == pytest.approx(math.exp(nll.mean()), rel=1e-12)
    assert (report["tokens_scored"], report["kv_window"], report["kv_sinks"]) == (len(ids) - 1, 24, 2)
    rc, out, err = cli(text_file, "--quantize", "none", "--kv-window", 24)
    assert rc == 0 and "one stream: 4 sink tokens + a window of 24" in out, err
    rc, out, err = cli(text_file, "--kv-window", 24, "--stride", 8)
    assert rc == 2 and "--stride does not apply with --kv-window" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_cli_end_to_end_quantized_kl(text_file, tmp_path, capsys):
    """Real loads: the float32 run saved, the single 8-bit pass (`--activations int8`) compared
    with it: a KL well above the float16 bound (1.4e-5), the base perplexity read back from the
    file; the default (8 bits twice) within that bound of float32."""
    base = tmp_path / "f32.lgp"
    common = [str(text_file), "--context", str(CONTEXT), "--stride", str(STRIDE), "--json"]
    assert arlm.cli.main(["perplexity", *common, "--quantize", "none", "--save-logits", str(base)]) == 0
    f32 = json.loads(capsys.readouterr().out)
    assert arlm.cli.main(["perplexity", *common, "--quantize", "auto", "--activations", "int8",
                          "--kl-divergence", str(base)]) == 0
    quant = json.loads(capsys.readouterr().out)
    assert quant["activations"] == "int8"
    kl = quant["kl_divergence"]
    assert quant["quantization"] == "auto" and kl["base_config"]["quantization"] == "none"
    assert kl["mean_kl"] > 1e-4 and kl["max_kl"] >= kl["p99_kl"] >= kl["median_kl"] > 0
    assert kl["base_perplexity"] == pytest.approx(f32["perplexity"], rel=1e-2)
    assert kl["perplexity"] == pytest.approx(quant["perplexity"], rel=1e-12)
    assert arlm.cli.main(["perplexity", *common, "--kl-divergence", str(base)]) == 0
    default = json.loads(capsys.readouterr().out)
    assert default["activations"] == "int8x2" and default["kl_divergence"]["mean_kl"] < 1.4e-5


def bad_inputs(tmp_path, text_file, base_file, smollm2) -> dict[str, tuple[list, str, int]]:
    """name -> (arguments, a word the one-line error must contain, exit code)."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    one_token = tmp_path / "one.txt"
    one_token.write_text("the")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9".encode("latin-1"))
    not_logits = tmp_path / "not.lgp"
    not_logits.write_text("hello")
    other_vocab = tmp_path / "vocab.lgp"
    writer = LogitsWriter(other_vocab, {"format": "arlm-logprobs", "version": 1, "vocab_size": 7, "n_scored": 1})
    writer.write(torch.zeros(1, 7))
    writer.commit()
    truncated = tmp_path / "truncated.lgp"
    truncated.write_bytes(base_file[0].read_bytes()[:-2])
    f = [str(text_file), "--quantize", "none"]
    return {
        "missing-file": ([tmp_path / "missing.txt"], "cannot read", 2),
        "empty-text": ([empty], "empty", 2),
        "one-token": ([one_token, "--quantize", "none"], "at least 2", 2),
        "not-utf8": ([latin1], "UTF-8", 2),
        "context-1": (f + ["--context", 1], "--context", 2),
        "stride-0": (f + ["--stride", 0], "--stride", 2),
        "stride-above-context": (f + ["--context", 64, "--stride", 65], "--stride", 2),
        "batch-tokens-0": (f + ["--batch-tokens", 0], "--batch-tokens", 2),
        "context-above-model": (f + ["--context", smollm2.model.config.max_seq_len + 1], "context window", 1),
        "missing-base": (f + ["--kl-divergence", tmp_path / "missing.lgp"], "cannot read", 2),
        "not-a-logits-file": (f + ["--kl-divergence", not_logits], "not an arlm logits file", 1),
        "truncated-base": (f + ["--kl-divergence", truncated], "truncated", 1),
        "other-vocabulary": (f + ["--kl-divergence", other_vocab], "vocabulary", 1),
        "other-stride": (f + ["--context", CONTEXT, "--stride", 16, "--kl-divergence", base_file[0]], "windows", 1),
        "other-text": (f + ["--context", CONTEXT, "--max-tokens", 100, "--kl-divergence", base_file[0]],
                       "different text", 1),
        "save-to-missing-dir": (f + ["--save-logits", tmp_path / "no" / "dir.lgp"], "no directory", 2),
    }


def test_cli_bad_input_is_one_line(cli, tmp_path, text_file, base_file, smollm2):
    for name, (args, word, code) in bad_inputs(tmp_path, text_file, base_file, smollm2).items():
        rc, out, err = cli(*args)
        assert (rc, out) == (code, ""), (name, rc, out, err)
        assert err.count("\n") == 1 and word in err and "Traceback" not in err, (name, err)
