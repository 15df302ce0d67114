"""Token embedding rows in numpy, as the torch path gathers them (`quant.*.dequantize_rows`, the
packed layouts' unpackers in `arlm.kernels`), op for op in float32 so each row is the same to
the bit: the plan's writer checks that on the model's own table before it writes a plan
(`arlm.bare.write`), and tests/test_bare.py on every kind.

A kind is the table's class name as the layout cache's manifest names it; `tensors` are its
arrays as the cache holds them (packed: 16 output channels to a block).
"""

from __future__ import annotations

import numpy as np

# Q6_K's top two bits (kernels.pack_q6_k / packed_rows: the lane whose bits sit at bits 0-1,
# 2-3, 4-5, 6-7 of a stored byte, and the neighbouring byte they come from)
_Q6_LANE_AT_SHIFT = (2, 3, 0, 1)
_Q6_BYTE_OFFSET = (1, 1, 0, 0)


def _packed_rows(wp: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Output rows `index` [T] of a packed weight [N/16, C, 64] (16 channels by 4 bytes): [T, C, 4]."""
    NB, C = wp.shape[:2]
    return wp.reshape(NB, C, 16, 4)[index // 16, :, index % 16, :]


def _nibbles(b: np.ndarray, T: int, K: int) -> np.ndarray:
    """Packed 4-bit bytes [T, K/8, 4] -> their values [T, K] (low nibbles, then high, per 8)."""
    return np.stack([b & 0x0F, b >> 4], axis=2).reshape(T, K)


def _q5_rows(wp: np.ndarray, index: np.ndarray) -> np.ndarray:
    """`kernels.unpack_q5_rows`: output rows of pack_q5's layout as their values, uint8 [T, K]."""
    NB, C = wp.shape[:2]
    T = len(index)
    b, lane = index // 16, index % 16
    nib = wp[:, :, :64].reshape(NB, C, 16, 4)[b, :, lane, :]  # [T, K/8, 4]
    bits = (wp[b, :, 64:].reshape(T, C, 2, 8, 1) >> np.arange(8, dtype=np.uint8)) & 1
    bits = bits.reshape(T, C, 2, 64)
    at = np.broadcast_to((lane[:, None] * 4 + np.arange(4))[:, None, None, :], (T, C, 2, 4))
    high = np.take_along_axis(bits, at, axis=3)  # [T, K/8, 2, 4]
    return (np.stack([nib & 0x0F, nib >> 4], axis=2) | (high << 4)).reshape(T, C * 8)


def _q6_rows(wp: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Output rows of pack_q6_k's layout as u = q + 32, uint8 [T, K] (as `kernels.packed_rows` reads them)."""
    NB, C = wp.shape[:2]
    T = len(index)
    b, lane = index // 16, index % 16
    nib = wp[:, :, :64].reshape(NB, C, 16, 4)[b, :, lane, :]  # [T, K/8, 4]
    low = np.stack([nib & 0x0F, nib >> 4], axis=2)  # [T, K/8, 2, 4]
    stored = wp[b, :, 64:].reshape(T, C, 2, 4, 4)  # [T, K/8, vector, word, byte]
    L, word = lane // 4, lane % 4
    slot = np.array([_Q6_LANE_AT_SHIFT.index(i) for i in range(4)])[L]  # [T]
    offset = np.array(_Q6_BYTE_OFFSET)[slot]
    byte = (np.arange(4)[None, :] + offset[:, None]) % 4  # [T, 4]
    words = stored[np.arange(T), :, :, word]  # [T, K/8, 2, 4]
    bits = np.take_along_axis(words, np.broadcast_to(byte[:, None, None, :], (T, C, 2, 4)), axis=3)
    top = (bits >> (2 * slot)[:, None, None, None].astype(np.uint8)) & 0x03
    return (low | (top << 4)).reshape(T, C * 8)


def _kscale_rows(scale: np.ndarray, b: np.ndarray, lane: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Channels (block b, lane) of a Q4_K / Q5_K scale [NB, K/256, 192] (arlm.kernels.pack_kscales)
    -> their 6-bit sc and m, uint8 [T, K/32] each."""
    T, S = len(b), scale.shape[1]
    low = scale[b, :, :128].reshape(T, S, 8, 16)[np.arange(T), :, :, lane]  # [T, S, 8]
    pairs = scale[b, :, 128:].reshape(T, S, 4, 16)[np.arange(T), :, :, lane]  # [T, S, 4]: groups k, k + 4
    top = np.concatenate([pairs & 15, pairs >> 4], axis=-1)
    return (((low & 15) | ((top & 3) << 4)).reshape(T, 8 * S), ((low >> 4) | ((top >> 2) << 4)).reshape(T, 8 * S))


def _f32(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32)


def rows(kind: str, tensors: list[np.ndarray], index: np.ndarray, kquant: str | None = None) -> np.ndarray:
    """Float32 rows `index` [T] of the table: [T, in_features]. kind: "dense" (a float table:
    float32, float16, or bfloat16 held as uint16), or a packed quantized layer's class name;
    kquant: a KQuantLinear's block type. ValueError for a kind not gathered here."""
    index = np.asarray(index, dtype=np.int64)
    T = len(index)
    if kind == "dense":
        w = tensors[0]
        if w.dtype == np.uint16:  # bfloat16: its bits are a float32's top half
            return (w[index].astype(np.uint32) << 16).view(np.float32)
        return w[index].astype(np.float32)  # (float32: a copy, as index_select)
    wp = tensors[0]
    b, lane = index // 16, index % 16
    if kind == "Int8Linear":  # scale float32 [N]
        K = wp.shape[1] * 4
        q = (_packed_rows(wp, index).reshape(T, K) ^ 0x80).view(np.int8)
        return _f32(q) * tensors[1][index, None]
    if kind == "Q8Linear":  # scale [N/16, K/32, 16]
        K = wp.shape[1] * 4
        q = (_packed_rows(wp, index).reshape(T, K) ^ 0x80).view(np.int8)
        d = tensors[1][b, :, lane]  # [T, K/32]
        return (_f32(q).reshape(T, d.shape[1], -1) * _f32(d)[..., None]).reshape(T, K)
    if kind == "Q4Linear":
        K = wp.shape[1] * 8
        q = _nibbles(_packed_rows(wp, index), T, K)
        scale, mins = tensors[1], tensors[2]
        d = scale[b, :, lane]
        m = mins[b, :, lane] if mins.size else (_f32(d) * np.float32(-8)).astype(np.float16)
        return (_f32(q).reshape(T, -1, 32) * _f32(d)[..., None] + _f32(m)[..., None]).reshape(T, K)
    if kind == "Q5Linear":
        q = _f32(_q5_rows(wp, index)).reshape(T, -1, 32)
        d = _f32(tensors[1][b, :, lane])  # (Q5_0: no mins, -16 d)
        return (q * d[..., None] + (d * np.float32(-16))[..., None]).reshape(T, -1)
    if kind == "KQuantLinear":
        scale, supers = tensors[1], tensors[2]
        if kquant == "Q6_K":
            K = wp.shape[1] * 8
            q = _f32(_q6_rows(wp, index)).reshape(T, K // 16, 16) - np.float32(32.0)
            d = np.repeat(_f32(supers[b, :, lane]), 16, axis=1)  # [T, K/16]
            return ((d * _f32(scale[b, :, lane]))[..., None] * q).reshape(T, K)
        if kquant in ("Q4_K", "Q5_K"):
            if kquant == "Q5_K":
                q = _f32(_q5_rows(wp, index))
                K = q.shape[1]
                q = q.reshape(T, K // 32, 32)
            else:
                K = wp.shape[1] * 8
                wb = wp.reshape(wp.shape[0], -1, 16, 4)[b, :, lane, :]  # [T, K/8, 4]
                q = _f32(np.stack([wb & 0x0F, wb >> 4], axis=2).reshape(T, K // 32, 32))
            sc, m = (_f32(t) for t in _kscale_rows(scale, b, lane))  # [T, K/32]
            d, dmin = (np.repeat(_f32(supers[b, :, lane + o]), 8, axis=1) for o in (0, 16))
            return ((d * sc)[..., None] * q - (dmin * m)[..., None]).reshape(T, K)
    raise ValueError(f"no numpy gather for a {kind} table" + (f" ({kquant})" if kquant else ""))
