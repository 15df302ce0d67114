"""GGML's block types as numpy fields: the bytes of a block of 32 (Q8_0, Q4_0, Q4_1, Q5_0) or a
super-block of 256 (Q4_K, Q5_K, Q6_K) split into their integer values and scales, as ggml lays
them out and `gguf.quants` reads them. No file here (gguf.py) and no layer (gguf_layers.py).
"""

from __future__ import annotations

import numpy as np

# Bytes per block of 32, for the types loaded as they are: Q4_1 into Q4Linear, Q8_0 into
# Q8Linear, and Q5_0 / Q4_0 into Q8Linear too, their values widened to int8 (exactly: the same
# scale, the same d * q; `as_q8_0`).
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34, "Q5_0": 22, "Q4_0": 18}
AS_Q8 = ("Q8_0", "Q5_0", "Q4_0")
# Bytes per super-block of 256, for the K-quants read as they are (KQuantLinear).
K_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def k_quant_fields(b: np.ndarray, kind: str) -> dict[str, np.ndarray]:
    """K-quant super-blocks [N, S, bytes] (S = K / 256) -> their integer fields and scales, rows
    [N, K] in element order (ggml's block layouts, as gguf.quants reads them):

    - Q4_K (d, dmin float16; 12 bytes of 6-bit scales and mins for 8 groups of 32; 128 bytes of
      nibbles, each 32 bytes holding two groups: low nibbles the first, high the second):
      q uint8 [N, K] 0..15, sc and m uint8 [N, K/32], d and dmin float32 [N, S];
      w = d sc q - dmin m.
    - Q5_K: Q4_K's with 32 bytes of 5th bits before the nibbles (bit g of byte j: element j of
      group g); q 0..31.
    - Q6_K (128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales, d float16): q int8
      [N, K] -32..31, sc int8 [N, K/16], d float32 [N, S]; w = d sc q.
    """
    N, S, _ = b.shape
    if kind in ("Q4_K", "Q5_K"):
        d = np.ascontiguousarray(b[..., 0:2]).view(np.float16).astype(np.float32)[..., 0]
        dmin = np.ascontiguousarray(b[..., 2:4]).view(np.float16).astype(np.float32)[..., 0]
        raw = b[..., 4:16].astype(np.uint8)  # [N, S, 12]
        lo6 = np.uint8(0x3F)
        sc = np.concatenate([raw[..., 0:4] & lo6, (raw[..., 8:12] & 0x0F) | ((raw[..., 0:4] >> 6) << 4)], axis=-1)
        m = np.concatenate([raw[..., 4:8] & lo6, (raw[..., 8:12] >> 4) | ((raw[..., 4:8] >> 6) << 4)], axis=-1)
        nibbles = b[..., 16:144] if kind == "Q4_K" else b[..., 48:176]
        qs = nibbles.reshape(N, S, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
        q = (qs & np.uint8(0x0F)).reshape(N, S, 8, 32)
        if kind == "Q5_K":
            qh = b[..., 16:48].reshape(N, S, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
            q = q | ((qh & np.uint8(1)) << np.uint8(4))
        q = q.reshape(N, S * 256)
        return {"q": q, "sc": sc.reshape(N, S * 8), "m": m.reshape(N, S * 8), "d": d, "dmin": dmin}
    assert kind == "Q6_K", kind
    ql = b[..., 0:128].reshape(N, S, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    ql = (ql & np.uint8(0x0F)).reshape(N, S, 2, 128)
    qh = b[..., 128:192].reshape(N, S, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)
    qh = (qh & np.uint8(0x03)).reshape(N, S, 2, 128)
    q = ((ql | (qh << np.uint8(4))) - np.uint8(32)).view(np.int8).reshape(N, S * 256)  # (0..63 - 32, wrapped)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).reshape(N, S * 16)
    d = np.ascontiguousarray(b[..., 208:210]).view(np.float16).astype(np.float32)[..., 0]
    return {"q": q, "sc": sc, "d": d}


# Float matrices: held in float32 as they are (F16 and BF16 widen exactly), never rounded again.
FLOAT_TYPES = ("F32", "F16", "BF16")
# The K-quants the row layout holds exactly (Q4_K as Q4Linear, Q6_K as Q8Linear, Q5_K as
# Q8MinsLinear: float32 scales), where the packed kernels are not built.
ROW_K_TYPES = ("Q4_K", "Q5_K", "Q6_K")


def as_q8_0(b: np.ndarray, kind: str) -> np.ndarray:
    """Q8_0 / Q5_0 / Q4_0 blocks [N, G, bytes] as Q8_0 blocks [N, G, 34]: the fp16 scale d as
    it is, each value q as an int8 (Q5_0: 4 low bits from qs, the 5th from the 32-bit qh,
    minus 16; Q4_0: a nibble minus 8; element j < 16 in the low nibble of qs[j], j + 16 in its
    high one). d * q is then gguf's dequantized value, bit for bit."""
    if kind not in ("Q5_0", "Q4_0"):
        assert kind == "Q8_0", kind
        return b
    out = np.empty((*b.shape[:2], 34), np.uint8)
    out[..., :2] = b[..., :2]
    qs = b[..., 6:22] if kind == "Q5_0" else b[..., 2:18]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16)  # [N, G, 32]
    if kind == "Q5_0":
        qh = np.ascontiguousarray(b[..., 2:6]).view("<u4")  # [N, G, 1]
        q |= (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.int16)
        q -= 16
    else:
        q -= 8
    out[..., 2:] = q.astype(np.int8).view(np.uint8)
    return out


def dequantize_blocks(b: np.ndarray, kind: str, out: np.ndarray, rows: int = 2048) -> None:
    """Blocks of a BLOCK_BYTES type [N, G, bytes] -> float32 out [N, 32 G], as gguf.quants.dequantize
    does (d * q (+ m) in float32: the same values, bit for bit), `rows` rows at a time."""
    for i in range(0, b.shape[0], rows):
        c = b[i:i + rows] if kind in ("Q4_1", "Q8_0") else as_q8_0(b[i:i + rows], kind)
        n, G = c.shape[0], c.shape[1]
        d = np.ascontiguousarray(c[..., 0:2]).view(np.float16).astype(np.float32)  # [n, G, 1]
        if kind != "Q4_1":
            q = np.ascontiguousarray(c[..., 2:]).view(np.int8).astype(np.float32)
            out[i:i + n] = (d * q).reshape(n, 32 * G)
        else:
            m = np.ascontiguousarray(c[..., 2:4]).view(np.float16).astype(np.float32)
            qs = c[..., 4:]
            q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)
            out[i:i + n] = (d * q + m).reshape(n, 32 * G)
