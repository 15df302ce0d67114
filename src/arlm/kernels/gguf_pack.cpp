// GGUF's Q4_K, Q6_K, Q8_0, Q4_0, Q4_1 and Q5_0 blocks straight into a8_linear.cpp's packed layouts, at a first
// load's speed.
//
// The Python path (loading.gguf_blocks.k_quant_fields, then kernels.pack_q4_k / pack_q6_k; the
// Q8_0 values, then pack_int8 / pack_scales) reads every block's fields into [N, K] tensors and
// repacks them with torch ops: ~8 s of a 1B Q4_K_M file's first load. This does the same byte
// moves per block, in one pass over the file's rows, with the same result bit for bit
// (tests/test_gguf_pack.py checks the two against each other).
//
//   pack_gguf_blocks(blocks uint8 [N, S, bytes], kind) -> tensors, N a multiple of 16:
//   Q8_0 (34 bytes a block of 32: d, 32 int8): wp [N/16, K/4, 64] (channel c's byte 4c + t of
//     K-values 4j..4j+3: q[4j + t] XOR 0x80), scale float16 [N/16, K/32, 16];
//   Q4_K (144 bytes a super-block of 256): wp [N/16, K/8, 64] (channel c's byte 4c + t of
//     8 K-values 8p..8p+7: q[8p + t] | q[8p + 4 + t] << 4), scale uint8 [N/16, S, 192] (the 6-bit
//     sc and m as kernels.pack_kscales lays them out), supers float16 [N/16, S, 32] (d, then dmin);
//   Q4_0 (18 bytes a block of 32: d, 16 bytes of nibbles, value i low and i + 16 high) and Q4_1
//     (20: d, m, the nibbles): wp [N/16, K/8, 64] as Q4_K's, scale float16 [N/16, K/32, 16] (d),
//     mins float16 [N/16, K/32, 16] (Q4_1's m; Q4_0: none, [0]: its kernels take -8 d);
//   Q6_K (210 bytes): wp [N/16, K/8, 96] (u = q + 32: the same 64 bytes of its low 4 bits, then 32
//     of its top 2, placed where a8_linear.cpp's load_q6 rotation finds them), scale int8
//     [N/16, K/16, 16], supers float16 [N/16, S, 16] (d).

#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Q4_K's packed sc and m, per block of 16 channels and super-block (kernels.pack_kscales).
constexpr int64_t kKScaleBytes = 192;
constexpr int64_t kQ4KBytes = 144, kQ6KBytes = 210, kQ8Bytes = 34, kQ40Bytes = 18, kQ41Bytes = 20, kQ50Bytes = 22, kSuper = 256;

// One Q4_K super-block's 8 groups' 6-bit scales and mins (ggml's get_scale_min_k4).
inline void q4k_scales(const uint8_t* raw, uint8_t* sc, uint8_t* m) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = raw[j] & 63;
    m[j] = raw[j + 4] & 63;
    sc[j + 4] = (raw[j + 8] & 0x0F) | ((raw[j] >> 6) << 4);
    m[j + 4] = (raw[j + 8] >> 4) | ((raw[j + 4] >> 6) << 4);
  }
}

// One super-block's 256 values (Q4_K: q 0..15; Q6_K: u = q + 32, 0..63) in element order.
inline void q4k_values(const uint8_t* blk, uint8_t* q) {
  const uint8_t* nib = blk + 16;
  for (int i = 0; i < 4; ++i)  // 32 bytes hold two groups: low nibbles the first, high the second
    for (int j = 0; j < 32; ++j) {
      q[64 * i + j] = nib[32 * i + j] & 0x0F;
      q[64 * i + 32 + j] = nib[32 * i + j] >> 4;
    }
}

inline void q6k_values(const uint8_t* blk, uint8_t* u) {
  for (int half = 0; half < 2; ++half) {
    const uint8_t* ql = blk + 64 * half;
    const uint8_t* qh = blk + 128 + 32 * half;
    for (int j = 0; j < 64; ++j) {
      u[128 * half + j] = ql[j] & 0x0F;
      u[128 * half + 64 + j] = ql[j] >> 4;
    }
    for (int s = 0; s < 4; ++s)
      for (int j = 0; j < 32; ++j) u[128 * half + 32 * s + j] |= ((qh[j] >> (2 * s)) & 3) << 4;
  }
}

// The top-bit bytes of Q6_K's layout for 8 K-values of 16 channels: top[c][t'] (c channel,
// t' = 4h + t the K-value) -> 32 stored bytes, byte 16h + 4w + b carrying at bits 2s..2s+1 the
// top bits of lane L = kLaneAtShift[s]'s channel 4L + w, K-value 4h + (b - kByteOffset[s]) mod 4
// (kernels/__init__.py's _Q6_LANE_AT_SHIFT / _Q6_BYTE_OFFSET).
constexpr int kLaneAtShift[4] = {2, 3, 0, 1};
constexpr int kByteOffset[4] = {1, 1, 0, 0};

inline void q6k_top_bytes(const uint8_t (&top)[16][8], uint8_t* out) {
  for (int h = 0; h < 2; ++h)
    for (int w = 0; w < 4; ++w)
      for (int b = 0; b < 4; ++b) {
        uint8_t v = 0;
        for (int s = 0; s < 4; ++s) {
          const int c = 4 * kLaneAtShift[s] + w, t = (b - kByteOffset[s] + 4) % 4;
          v |= static_cast<uint8_t>(top[c][4 * h + t] << (2 * s));
        }
        out[16 * h + 4 * w + b] = v;
      }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_k_blocks(const at::Tensor& blocks, int64_t kind) {
  const bool q6 = kind == 6;
  const int64_t N = blocks.size(0), S = blocks.size(1), K = S * kSuper, NB = N / 16;
  TORCH_CHECK(blocks.size(2) == (q6 ? kQ6KBytes : kQ4KBytes), "pack_gguf_blocks: ", blocks.size(2),
              " bytes a block, not ", q6 ? "Q6_K's 210" : "Q4_K's 144");
  const auto u8 = blocks.options();
  at::Tensor wp = at::empty({NB, K / 8, q6 ? 96 : 64}, u8);
  at::Tensor scale = q6 ? at::empty({NB, K / 16, 16}, u8.dtype(at::kChar)) : at::empty({NB, S, kKScaleBytes}, u8);
  at::Tensor supers = at::empty({NB, S, q6 ? 16 : 32}, u8.dtype(at::kHalf));
  const uint8_t* in = blocks.data_ptr<uint8_t>();
  uint8_t* wo = wp.data_ptr<uint8_t>();
  uint8_t* so = static_cast<uint8_t*>(scale.data_ptr());
  uint16_t* dout = reinterpret_cast<uint16_t*>(supers.data_ptr<at::Half>());
  const int64_t bytes = blocks.size(2), chunk = q6 ? 96 : 64;
  at::parallel_for(0, NB * S, 1, [&](int64_t i0, int64_t i1) {
    uint8_t q[16][kSuper];
    for (int64_t i = i0; i < i1; ++i) {  // (tile nb, super-block s): 16 channels' 256 K-values
      const int64_t nb = i / S, s = i % S;
      for (int c = 0; c < 16; ++c) {
        const uint8_t* blk = in + ((nb * 16 + c) * S + s) * bytes;
        if (q6) {
          q6k_values(blk, q[c]);
          for (int g = 0; g < 16; ++g) so[(nb * (K / 16) + s * 16 + g) * 16 + c] = blk[192 + g];
          std::memcpy(dout + (nb * S + s) * 16 + c, blk + 208, 2);
        } else {
          q4k_values(blk, q[c]);
          uint8_t sc[8], m[8];
          q4k_scales(blk + 4, sc, m);
          uint8_t* at = so + (nb * S + s) * kKScaleBytes;
          for (int g = 0; g < 8; ++g) at[16 * g + c] = (sc[g] & 15) | ((m[g] & 15) << 4);
          for (int k = 0; k < 4; ++k)
            at[128 + 16 * k + c] = ((sc[k] >> 4) | ((m[k] >> 4) << 2)) | (((sc[k + 4] >> 4) | ((m[k + 4] >> 4) << 2)) << 4);
          std::memcpy(dout + (nb * S + s) * 32 + c, blk, 2);
          std::memcpy(dout + (nb * S + s) * 32 + 16 + c, blk + 2, 2);
        }
      }
      for (int p = 0; p < kSuper / 8; ++p) {  // 8 K-values at a time
        uint8_t* o = wo + (nb * (K / 8) + s * (kSuper / 8) + p) * chunk;
        for (int c = 0; c < 16; ++c)
          for (int t = 0; t < 4; ++t)
            o[4 * c + t] = (q[c][8 * p + t] & 0x0F) | ((q[c][8 * p + 4 + t] & 0x0F) << 4);
        if (q6) {
          uint8_t top[16][8];
          for (int c = 0; c < 16; ++c)
            for (int t = 0; t < 8; ++t) top[c][t] = q[c][8 * p + t] >> 4;
          q6k_top_bytes(top, o + 64);
        }
      }
    }
  });
  return {wp, scale, supers};
}

// For each block of 32 of a file with blocks of `bytes` bytes a group of 32 K-values: fn(nb, g, c,
// block) for tile nb (16 channels), group g, channel c of the tile, in parallel over (nb, g).
template <typename F>
void for_each_group(const at::Tensor& blocks, int64_t bytes, const F& fn) {
  const int64_t G = blocks.size(1), NB = blocks.size(0) / 16;
  const uint8_t* in = blocks.data_ptr<uint8_t>();
  at::parallel_for(0, NB * G, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t nb = i / G, g = i % G;
      for (int c = 0; c < 16; ++c) fn(nb, g, c, in + ((nb * 16 + c) * G + g) * bytes);
    }
  });
}

std::vector<at::Tensor> pack_q8_0_blocks(const at::Tensor& blocks) {
  TORCH_CHECK(blocks.size(2) == kQ8Bytes, "pack_gguf_blocks: ", blocks.size(2), " bytes a block, not Q8_0's 34");
  const int64_t N = blocks.size(0), G = blocks.size(1), K = 32 * G, NB = N / 16;
  at::Tensor wp = at::empty({NB, K / 4, 64}, blocks.options());
  at::Tensor scale = at::empty({NB, G, 16}, blocks.options().dtype(at::kHalf));
  uint8_t* wo = wp.data_ptr<uint8_t>();
  uint16_t* so = reinterpret_cast<uint16_t*>(scale.data_ptr<at::Half>());
  for_each_group(blocks, kQ8Bytes, [&](int64_t nb, int64_t g, int c, const uint8_t* blk) {
    uint8_t* o = wo + (nb * (K / 4) + g * 8) * 64;
    std::memcpy(so + (nb * G + g) * 16 + c, blk, 2);
    for (int j = 0; j < 8; ++j)
      for (int t = 0; t < 4; ++t) o[64 * j + 4 * c + t] = blk[2 + 4 * j + t] ^ 0x80;
  });
  return {wp, scale};
}

// Q4_0 (kind 40) or Q4_1 (41) blocks -> q4_linear_a8p's layout (kernels.pack_q4 of the rows the
// loader reads from them: the nibbles and scales as stored).
std::vector<at::Tensor> pack_q4_blocks(const at::Tensor& blocks, bool q4_1) {
  const int64_t bytes = q4_1 ? kQ41Bytes : kQ40Bytes;
  TORCH_CHECK(blocks.size(2) == bytes, "pack_gguf_blocks: ", blocks.size(2), " bytes a block, not ",
              q4_1 ? "Q4_1's 20" : "Q4_0's 18");
  const int64_t N = blocks.size(0), G = blocks.size(1), K = 32 * G, NB = N / 16;
  at::Tensor wp = at::empty({NB, K / 8, 64}, blocks.options());
  at::Tensor scale = at::empty({NB, G, 16}, blocks.options().dtype(at::kHalf));
  at::Tensor mins = q4_1 ? at::empty({NB, G, 16}, blocks.options().dtype(at::kHalf))
                        : at::empty({0}, blocks.options().dtype(at::kHalf));
  uint8_t* wo = wp.data_ptr<uint8_t>();
  uint16_t* so = reinterpret_cast<uint16_t*>(scale.data_ptr<at::Half>());
  uint16_t* mo = q4_1 ? reinterpret_cast<uint16_t*>(mins.data_ptr<at::Half>()) : nullptr;
  for_each_group(blocks, bytes, [&](int64_t nb, int64_t g, int c, const uint8_t* blk) {
    uint8_t* o = wo + (nb * (K / 8) + g * 4) * 64;
    std::memcpy(so + (nb * G + g) * 16 + c, blk, 2);
    if (q4_1) std::memcpy(mo + (nb * G + g) * 16 + c, blk + 2, 2);
    const uint8_t* nib = blk + (q4_1 ? 4 : 2);
    uint8_t q[32];
    for (int j = 0; j < 16; ++j) q[j] = nib[j] & 0x0F, q[j + 16] = nib[j] >> 4;
    for (int p = 0; p < 4; ++p)  // 8 K-values at a time: 4 in the low nibbles, the next 4 high
      for (int t = 0; t < 4; ++t) o[64 * p + 4 * c + t] = q[8 * p + t] | (q[8 * p + 4 + t] << 4);
  });
  return {wp, scale, mins};
}

// Q5_0 (kind 50: 22 bytes a block of 32: d, the 32-bit qh of the values' 5th bits, the nibbles
// as Q4_0's) -> Q5Linear's layout (kernels.pack_q5 of q = value + 16, 0..31: its 64 bytes of low
// nibbles as Q4_0's, then per half of 4 K-values a 64-bit mask, bit 4c + t for channel c's
// value t), scale float16 [N/16, K/32, 16] (d) and no mins (the kernels take -16 d).
std::vector<at::Tensor> pack_q5_0_blocks(const at::Tensor& blocks) {
  TORCH_CHECK(blocks.size(2) == kQ50Bytes, "pack_gguf_blocks: ", blocks.size(2), " bytes a block, not Q5_0's 22");
  const int64_t N = blocks.size(0), G = blocks.size(1), K = 32 * G, NB = N / 16;
  at::Tensor wp = at::zeros({NB, K / 8, 80}, blocks.options());  // (the masks are or-ed in)
  at::Tensor scale = at::empty({NB, G, 16}, blocks.options().dtype(at::kHalf));
  at::Tensor mins = at::empty({0}, blocks.options().dtype(at::kHalf));
  uint8_t* wo = wp.data_ptr<uint8_t>();
  at::Half* so = scale.data_ptr<at::Half>();
  for_each_group(blocks, kQ50Bytes, [&](int64_t nb, int64_t g, int c, const uint8_t* blk) {
    uint8_t* o = wo + (nb * (K / 8) + g * 4) * 80;
    at::Half d;
    std::memcpy(&d, blk, 2);
    so[(nb * G + g) * 16 + c] = d;
    uint32_t qh;
    std::memcpy(&qh, blk + 2, 4);
    const uint8_t* nib = blk + 6;
    uint8_t q[32];
    for (int j = 0; j < 16; ++j) q[j] = nib[j] & 0x0F, q[j + 16] = nib[j] >> 4;
    for (int p = 0; p < 4; ++p)  // 8 K-values at a time: 4 in the low nibbles, the next 4 high
      for (int half = 0; half < 2; ++half)
        for (int t = 0; t < 4; ++t) {
          const int j = 8 * p + 4 * half + t, bit = 4 * c + t;
          if (half == 0) o[80 * p + 4 * c + t] = q[8 * p + t] | (q[8 * p + 4 + t] << 4);
          if ((qh >> j) & 1) o[80 * p + 64 + 8 * half + bit / 8] |= static_cast<uint8_t>(1u << (bit % 8));
        }
  });
  return {wp, scale, mins};
}

std::vector<at::Tensor> pack_gguf_blocks(const at::Tensor& blocks, int64_t kind) {
  TORCH_CHECK(blocks.dim() == 3 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "pack_gguf_blocks: blocks [N, K/block, bytes] contiguous uint8");
  TORCH_CHECK(blocks.size(0) % 16 == 0, "pack_gguf_blocks: N a multiple of 16");
  TORCH_CHECK(kind == 4 || kind == 6 || kind == 8 || kind == 40 || kind == 41 || kind == 50,
              "pack_gguf_blocks: kind 4 (Q4_K), 6 (Q6_K), 8 (Q8_0), 40 (Q4_0), 41 (Q4_1) or 50 (Q5_0)");
  if (kind == 8) return pack_q8_0_blocks(blocks);
  if (kind == 50) return pack_q5_0_blocks(blocks);
  if (kind == 40 || kind == 41) return pack_q4_blocks(blocks, kind == 41);
  auto [wp, scale, supers] = pack_k_blocks(blocks, kind);
  return {wp, scale, supers};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(arlm, m) {
  m.def("pack_gguf_blocks(Tensor blocks, int kind) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(arlm, CPU, m) { m.impl("pack_gguf_blocks", &pack_gguf_blocks); }
