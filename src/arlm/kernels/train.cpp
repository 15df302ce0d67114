// Training's fused passes: the cross-entropy gradient over a block of logits in place, and RMSNorm,
// RoPE and SwiGLU forward and backward, each one pass through memory where torch takes several.
//
// softmax_xent_(logits [C, V], targets [C], scale [C]) -> loss [C]
//   For each row r (parallel over rows): loss[r] = logsumexp(logits[r]) - logits[r, targets[r]],
//   and logits[r] is overwritten with the loss's gradient with respect to it, scaled:
//   (softmax(logits[r]) - one_hot(targets[r])) * scale[r]. Float32 arithmetic on bf16 or float32
//   storage (arlm.train.loss: the head's products come out in bf16 under autocast and go back
//   into the two backward products in bf16).
//
// torch needs ~7 passes over the [C, V] block for this (max, subtract, exp, sum, scale, the
// target's -1, the cast), each through memory: the block is hundreds of MB. Here a row (V = 49,152
// values: 96 KB in bf16) is read three times while it sits in the core's cache and written once.
//
// rms_norm(x [N, d] float32, w [d], eps, out_bf16) -> (y [N, d], rstd [N])
//   y = w * (x * rstd), rstd = 1 / sqrt(mean(x^2) + eps), in bf16 (out_bf16: the projection after
//   it multiplies in bf16 under autocast) or float32.
// rms_norm_backward(g [N, d], x, rstd, w) -> (dx [N, d] float32, dw [d] float32)
//   n = x * rstd:  dx = (g w - n mean(g w n)) rstd,  dw = sum over rows of g n.
// add_rms_norm(x, h, w, eps, out_bf16) -> (x + h, rms_norm(x + h), rstd); its backward adds the
//   residual stream's gradient and writes the branch's in its dtype (one pass each way).
// rope(x [B, T, H, d], cos, sin [B, T, 1, d] float32, inverse) -> y [B, T, H, d], x's dtype
//   y = x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1) for the halves x1, x2 of each head;
//   inverse: the transpose, x cos + (x2, -x1) sin (the backward pass). In float32, rounded once.
//   x's heads may be strided (a view of the fused q/k/v projection); its last dim is contiguous.
// rope_qkv(qkv [B, T, H + 2 H_kv, d], cos, sin, H, H_kv) -> (q, k, v): q and k rotated, v copied;
// rope_qkv_backward(gq, gk, gv, cos, sin) -> the projection's gradient [B, T, H + 2 H_kv, d].
// adamw_(param, grad, exp_avg, exp_avg_sq, step, shadow?, ...): one AdamW step in one pass, the
//   bf16 copy of the new weights written on the way.
// norms(tensors) -> [n] float32: each one's 2-norm (bf16 or float32; clipping's per-tensor norms).
// swiglu(gate_up [N, 2F] bf16) -> act [N, F]: silu(gate) * up, gate and up the two halves of a row,
//   rounded to bf16 after the silu and after the product, as torch's two bf16 ops round.
// swiglu_backward(grad [N, F], gate_up) -> d_gate_up [N, 2F]: (grad * up * silu'(gate), grad * silu(gate)),
//   silu'(g) = sigmoid(g) (1 + g (1 - sigmoid(g))), with torch's roundings (grad * up to bf16 first).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <tuple>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kStep = 2 * fVec::size();  // values a loop iteration takes: two float vectors

// Two float vectors from kStep values of T, and back.
inline void load2(const float* p, fVec& a, fVec& b) {
  a = fVec::loadu(p);
  b = fVec::loadu(p + fVec::size());
}
inline void load2(const at::BFloat16* p, fVec& a, fVec& b) {
  std::tie(a, b) = at::vec::convert_bfloat16_float(at::vec::Vectorized<at::BFloat16>::loadu(p, kStep));
}
inline void store2(float* p, const fVec& a, const fVec& b) {
  a.store(p);
  b.store(p + fVec::size());
}
inline void store2(at::BFloat16* p, const fVec& a, const fVec& b) {
  at::vec::convert_float_bfloat16(a, b).store(p, kStep);
}

inline float reduce_max(const fVec& v) {
  float lanes[fVec::size()];
  v.store(lanes);
  float m = lanes[0];
  for (int64_t j = 1; j < fVec::size(); ++j) m = std::max(m, lanes[j]);
  return m;
}
inline float reduce_sum(const fVec& v) {
  float lanes[fVec::size()];
  v.store(lanes);
  float s = 0.f;
  for (int64_t j = 0; j < fVec::size(); ++j) s += lanes[j];
  return s;
}

template <typename T>
void softmax_xent_rows(T* logits, int64_t ld, int64_t C, int64_t V, const int64_t* targets, const float* scale,
                       float* loss) {
  at::parallel_for(0, C, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* row = logits + r * ld;
      const int64_t t = targets[r];
      const float target_logit = static_cast<float>(row[t]);
      // pass 1: the row's max
      fVec vmax(-std::numeric_limits<float>::infinity());
      int64_t i = 0;
      for (; i + kStep <= V; i += kStep) {
        fVec a, b;
        load2(row + i, a, b);
        vmax = at::vec::maximum(vmax, at::vec::maximum(a, b));
      }
      float peak = reduce_max(vmax);
      for (; i < V; ++i) peak = std::max(peak, static_cast<float>(row[i]));
      // pass 2: sum of exp(x - max)
      fVec vsum(0.f);
      const fVec vpeak(peak);
      for (i = 0; i + kStep <= V; i += kStep) {
        fVec a, b;
        load2(row + i, a, b);
        vsum = vsum + (a - vpeak).exp() + (b - vpeak).exp();
      }
      float total = reduce_sum(vsum);
      for (; i < V; ++i) total += std::exp(static_cast<float>(row[i]) - peak);
      loss[r] = peak + std::log(total) - target_logit;
      // pass 3: the gradient, softmax * scale, and the target's -scale
      const float k = scale[r] / total;
      const fVec vk(k);
      for (i = 0; i + kStep <= V; i += kStep) {
        fVec a, b;
        load2(row + i, a, b);
        store2(row + i, (a - vpeak).exp() * vk, (b - vpeak).exp() * vk);
      }
      for (; i < V; ++i) row[i] = static_cast<T>(std::exp(static_cast<float>(row[i]) - peak) * k);
      row[t] = static_cast<T>(std::exp(target_logit - peak) * k - scale[r]);
    }
  });
}

at::Tensor softmax_xent_(at::Tensor logits, const at::Tensor& targets, const at::Tensor& scale) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "softmax_xent_: logits must be [C, V], rows contiguous");
  TORCH_CHECK(targets.scalar_type() == at::kLong && scale.scalar_type() == at::kFloat, "softmax_xent_: dtypes");
  const int64_t C = logits.size(0), V = logits.size(1);
  auto t = targets.contiguous();
  auto s = scale.contiguous();
  TORCH_CHECK(t.numel() == C && s.numel() == C, "softmax_xent_: one target and one scale per row");
  auto loss = at::empty({C}, logits.options().dtype(at::kFloat));
  if (logits.scalar_type() == at::kBFloat16) {
    softmax_xent_rows(logits.data_ptr<at::BFloat16>(), logits.stride(0), C, V, t.data_ptr<int64_t>(),
                      s.data_ptr<float>(), loss.data_ptr<float>());
  } else {
    TORCH_CHECK(logits.scalar_type() == at::kFloat, "softmax_xent_: logits must be bfloat16 or float32");
    softmax_xent_rows(logits.data_ptr<float>(), logits.stride(0), C, V, t.data_ptr<int64_t>(), s.data_ptr<float>(),
                      loss.data_ptr<float>());
  }
  return loss;
}

// -- RMSNorm ------------------------------------------------------------------------------------

template <typename T>
void rms_norm_rows(const float* x, const float* w, int64_t N, int64_t d, float eps, T* y, float* rstd) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * d;
      T* yr = y + r * d;
      fVec acc(0.f);
      int64_t i = 0;
      for (; i + kStep <= d; i += kStep) {
        fVec a, b;
        load2(xr + i, a, b);
        acc = at::vec::fmadd(a, a, acc);
        acc = at::vec::fmadd(b, b, acc);
      }
      float ss = reduce_sum(acc);
      for (; i < d; ++i) ss += xr[i] * xr[i];
      const float k = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
      rstd[r] = k;
      const fVec vk(k);
      for (i = 0; i + kStep <= d; i += kStep) {
        fVec a, b, wa, wb;
        load2(xr + i, a, b);
        load2(w + i, wa, wb);
        store2(yr + i, (a * vk) * wa, (b * vk) * wb);
      }
      for (; i < d; ++i) yr[i] = static_cast<T>((xr[i] * k) * w[i]);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool out_bf16) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "rms_norm: x and w must be float32");
  auto xc = x.contiguous();
  const int64_t d = xc.size(-1), N = xc.numel() / d;
  auto y = at::empty_like(xc, xc.options().dtype(out_bf16 ? at::kBFloat16 : at::kFloat));
  auto rstd = at::empty({N}, xc.options());
  auto wc = w.contiguous();
  if (out_bf16) {
    rms_norm_rows(xc.data_ptr<float>(), wc.data_ptr<float>(), N, d, static_cast<float>(eps),
                  y.data_ptr<at::BFloat16>(), rstd.data_ptr<float>());
  } else {
    rms_norm_rows(xc.data_ptr<float>(), wc.data_ptr<float>(), N, d, static_cast<float>(eps), y.data_ptr<float>(),
                  rstd.data_ptr<float>());
  }
  return {y, rstd};
}

template <typename T, typename H = float>
void rms_norm_backward_rows(const T* g, const float* x, const float* rstd, const float* w, int64_t N, int64_t d,
                            float* dx, float* dw_parts, int64_t chunk, const float* gres = nullptr,
                            H* dh = nullptr) {
  // gres: a gradient arriving at x besides the norm's (add_rms_norm's residual stream), added to
  // dx; dh: dx written once more in H (the residual branch's gradient, in its dtype).
  // Each chunk of rows sums its share of dw into its own row of dw_parts (no two threads write one).
  const int64_t chunks = (N + chunk - 1) / chunk;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      float* dwc = dw_parts + c * d;
      std::fill(dwc, dwc + d, 0.f);
      for (int64_t r = c * chunk; r < std::min(N, (c + 1) * chunk); ++r) {
        const T* gr = g + r * d;
        const float* xr = x + r * d;
        float* dxr = dx + r * d;
        const float k = rstd[r];
        const fVec vk(k);
        fVec acc(0.f);
        int64_t i = 0;
        for (; i + kStep <= d; i += kStep) {  // sum of g w n
          fVec ga, gb, xa, xb, wa, wb;
          load2(gr + i, ga, gb);
          load2(xr + i, xa, xb);
          load2(w + i, wa, wb);
          acc = at::vec::fmadd(ga * wa, xa * vk, acc);
          acc = at::vec::fmadd(gb * wb, xb * vk, acc);
        }
        float dot = reduce_sum(acc);
        for (; i < d; ++i) dot += static_cast<float>(gr[i]) * w[i] * (xr[i] * k);
        dot /= static_cast<float>(d);
        const fVec vdot(dot);
        for (i = 0; i + kStep <= d; i += kStep) {
          fVec ga, gb, xa, xb, wa, wb, da, db;
          load2(gr + i, ga, gb);
          load2(xr + i, xa, xb);
          load2(w + i, wa, wb);
          const fVec na = xa * vk, nb = xb * vk;
          fVec dxa = (ga * wa - na * vdot) * vk, dxb = (gb * wb - nb * vdot) * vk;
          if (gres) {
            fVec ra, rb;
            load2(gres + r * d + i, ra, rb);
            dxa = dxa + ra;
            dxb = dxb + rb;
          }
          store2(dxr + i, dxa, dxb);
          if (dh) store2(dh + r * d + i, dxa, dxb);
          load2(dwc + i, da, db);
          store2(dwc + i, at::vec::fmadd(ga, na, da), at::vec::fmadd(gb, nb, db));
        }
        for (; i < d; ++i) {
          const float n = xr[i] * k, gi = static_cast<float>(gr[i]);
          dxr[i] = (gi * w[i] - n * dot) * k + (gres ? gres[r * d + i] : 0.f);
          if (dh) dh[r * d + i] = static_cast<H>(dxr[i]);
          dwc[i] += gi * n;
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& g, const at::Tensor& x, const at::Tensor& rstd,
                                                     const at::Tensor& w) {
  auto gc = g.contiguous();
  auto xc = x.contiguous();
  const int64_t d = xc.size(-1), N = xc.numel() / d;
  TORCH_CHECK(gc.numel() == xc.numel() && rstd.numel() == N && w.numel() == d, "rms_norm_backward: shapes");
  auto dx = at::empty_like(xc);
  const int64_t chunk = 64;
  auto parts = at::empty({(N + chunk - 1) / chunk, d}, xc.options());
  auto wc = w.contiguous();
  if (gc.scalar_type() == at::kBFloat16) {
    rms_norm_backward_rows(gc.data_ptr<at::BFloat16>(), xc.data_ptr<float>(), rstd.data_ptr<float>(),
                           wc.data_ptr<float>(), N, d, dx.data_ptr<float>(), parts.data_ptr<float>(), chunk);
  } else {
    TORCH_CHECK(gc.scalar_type() == at::kFloat, "rms_norm_backward: g must be bfloat16 or float32");
    rms_norm_backward_rows(gc.data_ptr<float>(), xc.data_ptr<float>(), rstd.data_ptr<float>(), wc.data_ptr<float>(),
                           N, d, dx.data_ptr<float>(), parts.data_ptr<float>(), chunk);
  }
  return {dx, parts.sum(0)};
}

// -- the residual add and RMSNorm together -------------------------------------------------------
//
// add_rms_norm(x [N, d] float32, h [N, d] bf16 or float32, w, eps, out_bf16) -> (s, y, rstd):
//   s = x + h (float32: the residual stream), y = rms_norm(s) as rms_norm gives it. One pass where
//   the add and the norm take two, the mixed-dtype add a slow one.
// add_rms_norm_backward(gs [N, d] float32, gy, s, rstd, w, h_bf16) -> (dx, dh, dw):
//   dx = gs + the norm's gradient at s (float32), dh = the same values in h's dtype, dw.

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& h,
                                                            const at::Tensor& w, double eps, bool out_bf16) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && h.sizes() == x.sizes(),
              "add_rms_norm: x float32, h of x's shape");
  auto xc = x.contiguous();
  auto hc = h.contiguous();
  const int64_t d = xc.size(-1), N = xc.numel() / d;
  auto sum = at::empty_like(xc);
  float* sp = sum.data_ptr<float>();
  const float* xp = xc.data_ptr<float>();
  auto add_rows = [&](auto* hp) {
    at::parallel_for(0, N * d / kStep + 1, 4096, [&](int64_t u0, int64_t u1) {
      const int64_t begin = std::min(N * d, u0 * kStep), end = std::min(N * d, u1 * kStep);
      int64_t i = begin;
      for (; i + kStep <= end; i += kStep) {
        fVec a, b, c, e;
        load2(xp + i, a, b);
        load2(hp + i, c, e);
        store2(sp + i, a + c, b + e);
      }
      for (; i < end; ++i) sp[i] = xp[i] + static_cast<float>(hp[i]);
    });
  };
  if (hc.scalar_type() == at::kBFloat16) {
    add_rows(hc.data_ptr<at::BFloat16>());
  } else {
    TORCH_CHECK(hc.scalar_type() == at::kFloat, "add_rms_norm: h must be bfloat16 or float32");
    add_rows(hc.data_ptr<float>());
  }
  auto [y, rstd] = rms_norm(sum, w, eps, out_bf16);
  return {sum, y, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_backward(const at::Tensor& gs, const at::Tensor& gy,
                                                                     const at::Tensor& s, const at::Tensor& rstd,
                                                                     const at::Tensor& w, bool h_bf16) {
  auto gsc = gs.to(at::kFloat).contiguous();
  auto gyc = gy.contiguous();
  auto sc = s.contiguous();
  const int64_t d = sc.size(-1), N = sc.numel() / d;
  TORCH_CHECK(gsc.numel() == sc.numel() && gyc.numel() == sc.numel() && rstd.numel() == N && w.numel() == d,
              "add_rms_norm_backward: shapes");
  auto dx = at::empty_like(sc);
  auto dh = at::empty_like(sc, sc.options().dtype(h_bf16 ? at::kBFloat16 : at::kFloat));
  const int64_t chunk = 64;
  auto parts = at::empty({(N + chunk - 1) / chunk, d}, sc.options());
  auto wc = w.contiguous();
  auto run = [&](auto* g) {
    if (h_bf16) {
      rms_norm_backward_rows(g, sc.data_ptr<float>(), rstd.data_ptr<float>(), wc.data_ptr<float>(), N, d,
                             dx.data_ptr<float>(), parts.data_ptr<float>(), chunk, gsc.data_ptr<float>(),
                             dh.data_ptr<at::BFloat16>());
    } else {
      rms_norm_backward_rows(g, sc.data_ptr<float>(), rstd.data_ptr<float>(), wc.data_ptr<float>(), N, d,
                             dx.data_ptr<float>(), parts.data_ptr<float>(), chunk, gsc.data_ptr<float>(),
                             dh.data_ptr<float>());
    }
  };
  if (gyc.scalar_type() == at::kBFloat16) {
    run(gyc.data_ptr<at::BFloat16>());
  } else {
    TORCH_CHECK(gyc.scalar_type() == at::kFloat, "add_rms_norm_backward: gy must be bfloat16 or float32");
    run(gyc.data_ptr<float>());
  }
  return {dx, dh, parts.sum(0)};
}

// -- RoPE ---------------------------------------------------------------------------------------

// One head's rotation: y = x cos + rotate_half(x) sin, or with `inverse` its transpose.
template <typename T>
inline void rope_head(const T* xr, const float* c, const float* s, int64_t d, bool inverse, T* yr) {
  const int64_t half = d / 2;
  int64_t i = 0;
  for (; i + kStep <= half; i += kStep) {
    fVec x1a, x1b, x2a, x2b, c1a, c1b, c2a, c2b, s1a, s1b, s2a, s2b;
    load2(xr + i, x1a, x1b);
    load2(xr + half + i, x2a, x2b);
    load2(c + i, c1a, c1b);
    load2(c + half + i, c2a, c2b);
    load2(s + i, s1a, s1b);
    load2(s + half + i, s2a, s2b);
    if (!inverse) {  // (y1, y2) = (x1 c1 - x2 s1, x2 c2 + x1 s2)
      store2(yr + i, x1a * c1a - x2a * s1a, x1b * c1b - x2b * s1b);
      store2(yr + half + i, x2a * c2a + x1a * s2a, x2b * c2b + x1b * s2b);
    } else {  // the transpose: (x1 c1 + x2 s2, x2 c2 - x1 s1)
      store2(yr + i, x1a * c1a + x2a * s2a, x1b * c1b + x2b * s2b);
      store2(yr + half + i, x2a * c2a - x1a * s1a, x2b * c2b - x1b * s1b);
    }
  }
  for (; i < half; ++i) {
    const float x1 = static_cast<float>(xr[i]), x2 = static_cast<float>(xr[half + i]);
    if (!inverse) {
      yr[i] = static_cast<T>(x1 * c[i] - x2 * s[i]);
      yr[half + i] = static_cast<T>(x2 * c[half + i] + x1 * s[half + i]);
    } else {
      yr[i] = static_cast<T>(x1 * c[i] + x2 * s[half + i]);
      yr[half + i] = static_cast<T>(x2 * c[half + i] - x1 * s[i]);
    }
  }
}

template <typename T>
void rope_rows(const T* x, std::array<int64_t, 3> xs, const float* cos, const float* sin, std::array<int64_t, 2> cs,
               int64_t B, int64_t Tn, int64_t H, int64_t d, bool inverse, T* y) {
  at::parallel_for(0, B * Tn, 16, [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t b = bt / Tn, t = bt % Tn;
      const float* c = cos + b * cs[0] + t * cs[1];
      const float* s = sin + b * cs[0] + t * cs[1];
      for (int64_t h = 0; h < H; ++h) {
        rope_head(x + b * xs[0] + t * xs[1] + h * xs[2], c, s, d, inverse, y + (bt * H + h) * d);
      }
    }
  });
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool inverse) {
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1 && x.size(3) % 2 == 0, "rope: x must be [B, T, H, d], d even, rows contiguous");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.dim() == 4 &&
              cos.sizes() == sin.sizes() && cos.strides() == sin.strides() && cos.stride(3) == 1,
              "rope: cos and sin must be float32 [B, T, 1, d] alike");
  const int64_t B = x.size(0), Tn = x.size(1), H = x.size(2), d = x.size(3);
  auto y = at::empty({B, Tn, H, d}, x.options());
  const std::array<int64_t, 3> xs{x.stride(0), x.stride(1), x.stride(2)};
  const std::array<int64_t, 2> cs{cos.size(0) == 1 ? 0 : cos.stride(0), cos.size(1) == 1 ? 0 : cos.stride(1)};
  if (x.scalar_type() == at::kBFloat16) {
    rope_rows(x.data_ptr<at::BFloat16>(), xs, cos.data_ptr<float>(), sin.data_ptr<float>(), cs, B, Tn, H, d, inverse,
              y.data_ptr<at::BFloat16>());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "rope: x must be bfloat16 or float32");
    rope_rows(x.data_ptr<float>(), xs, cos.data_ptr<float>(), sin.data_ptr<float>(), cs, B, Tn, H, d, inverse,
              y.data_ptr<float>());
  }
  return y;
}

// -- q/k/v with RoPE -----------------------------------------------------------------------------
//
// Attention's fused projection [B, T, H + 2 H_kv, d] holds q's heads, then k's, then v's. Split,
// rotated and cat back in the backward pass, that is a rope pass and two cats each way; here it is
// one pass: forward from the projection into q, k, v (q and k rotated, v copied), backward from
// their three gradients into the projection's (the inverse rotation, v's copied).

template <typename T>
struct Heads {  // a [B, T, n, d] tensor's heads (any strides; each head's d values contiguous)
  T* data;
  int64_t sb, st, sh, n;
};

template <typename T>
Heads<T> heads_of(const at::Tensor& x, int64_t first, int64_t n) {
  return {x.data_ptr<T>() + first * x.stride(2), x.stride(0), x.stride(1), x.stride(2), n};
}

template <typename T>
void rope_qkv_rows(std::array<Heads<T>, 3> src, std::array<Heads<T>, 3> dst, const float* cos, const float* sin,
                   std::array<int64_t, 2> cs, int64_t B, int64_t Tn, int64_t d, bool inverse) {
  at::parallel_for(0, B * Tn, 16, [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t b = bt / Tn, t = bt % Tn;
      const float* c = cos + b * cs[0] + t * cs[1];
      const float* s = sin + b * cs[0] + t * cs[1];
      for (int p = 0; p < 3; ++p) {  // q, k: rotated; v: copied
        const T* x = src[p].data + b * src[p].sb + t * src[p].st;
        T* y = dst[p].data + b * dst[p].sb + t * dst[p].st;
        for (int64_t h = 0; h < src[p].n; ++h) {
          if (p < 2) {
            rope_head(x + h * src[p].sh, c, s, d, inverse, y + h * dst[p].sh);
          } else {
            std::copy(x + h * src[p].sh, x + h * src[p].sh + d, y + h * dst[p].sh);
          }
        }
      }
    }
  });
}

std::array<int64_t, 2> rope_table_strides(const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.dim() == 4 &&
              cos.sizes() == sin.sizes() && cos.strides() == sin.strides() && cos.stride(3) == 1,
              "rope: cos and sin must be float32 [B, T, 1, d] alike");
  return {cos.size(0) == 1 ? 0 : cos.stride(0), cos.size(1) == 1 ? 0 : cos.stride(1)};
}

// rope_qkv(qkv [B, T, H + 2 H_kv, d], cos, sin, H, H_kv) -> (q [B, T, H, d], k [B, T, H_kv, d], v)
std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv(const at::Tensor& qkv, const at::Tensor& cos,
                                                        const at::Tensor& sin, int64_t H, int64_t H_kv) {
  TORCH_CHECK(qkv.dim() == 4 && qkv.stride(3) == 1 && qkv.size(3) % 2 == 0 && qkv.size(2) == H + 2 * H_kv,
              "rope_qkv: qkv must be [B, T, H + 2 H_kv, d], d even, rows contiguous");
  const auto cs = rope_table_strides(cos, sin);
  const int64_t B = qkv.size(0), Tn = qkv.size(1), d = qkv.size(3);
  auto q = at::empty({B, Tn, H, d}, qkv.options());
  auto k = at::empty({B, Tn, H_kv, d}, qkv.options());
  auto v = at::empty({B, Tn, H_kv, d}, qkv.options());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    rope_qkv_rows<T>({heads_of<T>(qkv, 0, H), heads_of<T>(qkv, H, H_kv), heads_of<T>(qkv, H + H_kv, H_kv)},
                     {heads_of<T>(q, 0, H), heads_of<T>(k, 0, H_kv), heads_of<T>(v, 0, H_kv)},
                     cos.data_ptr<float>(), sin.data_ptr<float>(), cs, B, Tn, d, false);
  };
  if (qkv.scalar_type() == at::kBFloat16) {
    run(at::BFloat16());
  } else {
    TORCH_CHECK(qkv.scalar_type() == at::kFloat, "rope_qkv: qkv must be bfloat16 or float32");
    run(float());
  }
  return {q, k, v};
}

// rope_qkv_backward(gq [B, T, H, d], gk, gv [B, T, H_kv, d], cos, sin) -> g [B, T, H + 2 H_kv, d]
at::Tensor rope_qkv_backward(const at::Tensor& gq, const at::Tensor& gk, const at::Tensor& gv, const at::Tensor& cos,
                             const at::Tensor& sin) {
  const auto cs = rope_table_strides(cos, sin);
  auto rows = [&](const at::Tensor& x) {  // (each head's values contiguous, in gq's dtype)
    auto y = x.to(gq.scalar_type());
    return y.stride(3) == 1 ? y : y.contiguous();
  };
  auto q = rows(gq), k = rows(gk), v = rows(gv);
  const int64_t B = q.size(0), Tn = q.size(1), H = q.size(2), H_kv = k.size(2), d = q.size(3);
  TORCH_CHECK(q.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == B && k.size(1) == Tn && k.size(3) == d,
              "rope_qkv_backward: shapes");
  auto g = at::empty({B, Tn, H + 2 * H_kv, d}, q.options());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    rope_qkv_rows<T>({heads_of<T>(q, 0, H), heads_of<T>(k, 0, H_kv), heads_of<T>(v, 0, H_kv)},
                     {heads_of<T>(g, 0, H), heads_of<T>(g, H, H_kv), heads_of<T>(g, H + H_kv, H_kv)},
                     cos.data_ptr<float>(), sin.data_ptr<float>(), cs, B, Tn, d, true);
  };
  if (q.scalar_type() == at::kBFloat16) {
    run(at::BFloat16());
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "rope_qkv_backward: gradients must be bfloat16 or float32");
    run(float());
  }
  return g;
}

// -- AdamW with a bf16 shadow -------------------------------------------------------------------
//
// adamw_(param, grad, exp_avg, exp_avg_sq, step, shadow?, lr, beta1, beta2, weight_decay, eps, grad_scale)
//   One AdamW step of a float32 parameter in one pass, torch's fused CPU AdamW's arithmetic
//   (decoupled weight decay, exp_avg by lerp, bias corrections in double), on the gradient times
//   grad_scale (the clipping coefficient: clip_grad_norm_'s multiply, done here in the register);
//   step (a float32 scalar tensor, torch's format) is incremented first. The gradient may be bf16
//   (a bf16 shadow's, as the matrix product gave it) or float32. Where `shadow` is given (bf16,
//   param's shape), the new value is also written there rounded to bf16 (round to nearest even,
//   as autocast's cast rounds): the copy the next forward pass multiplies with.

template <typename G>
void adamw_rows(float* p, const G* g, float* m, float* v, at::BFloat16* shadow, int64_t n, double lr, double beta1,
                double beta2, double weight_decay, double eps, float grad_scale, double step) {
  const double bc1 = 1 - std::pow(beta1, step), bc2 = 1 - std::pow(beta2, step);
  const float step_size = static_cast<float>(-(lr / bc1)), bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float decay = static_cast<float>(1 - lr * weight_decay), w1 = static_cast<float>(1 - beta1);
  const float b2 = static_cast<float>(beta2), w2 = static_cast<float>(1 - beta2), e = static_cast<float>(eps);
  const fVec vscale(grad_scale), vdecay(decay), vw1(w1), vb2(b2), vw2(w2), vbc2(bc2_sqrt), ve(e), vss(step_size);
  at::parallel_for(0, (n + kStep - 1) / kStep, 2048, [&](int64_t u0, int64_t u1) {
    const int64_t begin = u0 * kStep, end = std::min(n, u1 * kStep);
    int64_t i = begin;
    for (; i + kStep <= end; i += kStep) {
      fVec ga, gb, pa, pb, ma, mb, va, vb;
      load2(g + i, ga, gb);
      load2(p + i, pa, pb);
      load2(m + i, ma, mb);
      load2(v + i, va, vb);
      ga = ga * vscale;
      gb = gb * vscale;
      if (weight_decay != 0) {
        pa = pa * vdecay;
        pb = pb * vdecay;
      }
      ma = at::vec::fmadd(vw1, ga - ma, ma);
      mb = at::vec::fmadd(vw1, gb - mb, mb);
      va = va * vb2 + vw2 * ga * ga;
      vb = vb * vb2 + vw2 * gb * gb;
      pa = pa + vss * ma / (va.sqrt() / vbc2 + ve);
      pb = pb + vss * mb / (vb.sqrt() / vbc2 + ve);
      store2(m + i, ma, mb);
      store2(v + i, va, vb);
      store2(p + i, pa, pb);
      if (shadow) store2(shadow + i, pa, pb);
    }
    for (; i < end; ++i) {
      const float gi = static_cast<float>(g[i]) * grad_scale;
      float pi = weight_decay != 0 ? p[i] * decay : p[i];
      m[i] = m[i] + w1 * (gi - m[i]);
      v[i] = v[i] * b2 + w2 * gi * gi;
      pi = pi + step_size * m[i] / (std::sqrt(v[i]) / bc2_sqrt + e);
      p[i] = pi;
      if (shadow) shadow[i] = static_cast<at::BFloat16>(pi);
    }
  });
}

void adamw_(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg, at::Tensor exp_avg_sq, at::Tensor step,
            const std::optional<at::Tensor>& shadow, double lr, double beta1, double beta2, double weight_decay,
            double eps, double grad_scale) {
  TORCH_CHECK(param.scalar_type() == at::kFloat && exp_avg.scalar_type() == at::kFloat &&
              exp_avg_sq.scalar_type() == at::kFloat && param.is_contiguous() && exp_avg.is_contiguous() &&
              exp_avg_sq.is_contiguous(), "adamw_: param and its moments must be contiguous float32");
  const int64_t n = param.numel();
  TORCH_CHECK(grad.numel() == n && exp_avg.numel() == n && exp_avg_sq.numel() == n, "adamw_: sizes");
  at::BFloat16* sh = nullptr;
  if (shadow.has_value()) {
    TORCH_CHECK(shadow->scalar_type() == at::kBFloat16 && shadow->is_contiguous() && shadow->numel() == n,
                "adamw_: the shadow must be contiguous bf16 of param's size");
    sh = shadow->data_ptr<at::BFloat16>();
  }
  step.add_(1);
  const double t = step.item<double>();
  auto g = grad.contiguous();
  if (g.scalar_type() == at::kBFloat16) {
    adamw_rows(param.data_ptr<float>(), g.data_ptr<at::BFloat16>(), exp_avg.data_ptr<float>(),
               exp_avg_sq.data_ptr<float>(), sh, n, lr, beta1, beta2, weight_decay, eps,
               static_cast<float>(grad_scale), t);
  } else {
    TORCH_CHECK(g.scalar_type() == at::kFloat, "adamw_: grad must be bfloat16 or float32");
    adamw_rows(param.data_ptr<float>(), g.data_ptr<float>(), exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
               sh, n, lr, beta1, beta2, weight_decay, eps, static_cast<float>(grad_scale), t);
  }
}

// -- gradient norms --------------------------------------------------------------------------------
//
// norms(tensors) -> [n] float32: each tensor's 2-norm, bf16 or float32, summed in double per
// thread's share (clip_grad_norm_'s per-tensor norms, without widening a bf16 gradient to a
// float32 copy first: torch's norm with dtype=float32 makes that copy).

template <typename T>
double sum_squares(const T* x, int64_t n) {
  const int64_t units = (n + kStep - 1) / kStep;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units / 256));
  std::vector<double> partial(parts, 0.0);
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t begin = std::min(n, units * p / parts * kStep), end = std::min(n, units * (p + 1) / parts * kStep);
      fVec acc(0.f);
      double total = 0.0;
      int64_t i = begin, since = 0;
      for (; i + kStep <= end; i += kStep) {
        fVec a, b;
        load2(x + i, a, b);
        acc = at::vec::fmadd(a, a, acc);
        acc = at::vec::fmadd(b, b, acc);
        if (++since == 64) {  // (folded into double often: float lanes stay accurate)
          total += reduce_sum(acc);
          acc = fVec(0.f);
          since = 0;
        }
      }
      total += reduce_sum(acc);
      for (; i < end; ++i) total += static_cast<double>(static_cast<float>(x[i])) * static_cast<float>(x[i]);
      partial[p] = total;
    }
  });
  double total = 0.0;
  for (double v : partial) total += v;
  return total;
}

at::Tensor norms(const std::vector<at::Tensor>& tensors) {
  auto out = at::empty({static_cast<int64_t>(tensors.size())}, at::TensorOptions().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  for (size_t k = 0; k < tensors.size(); ++k) {
    auto t = tensors[k].contiguous();
    double ss;
    if (t.scalar_type() == at::kBFloat16) {
      ss = sum_squares(t.data_ptr<at::BFloat16>(), t.numel());
    } else {
      TORCH_CHECK(t.scalar_type() == at::kFloat, "norms: bfloat16 or float32 tensors");
      ss = sum_squares(t.data_ptr<float>(), t.numel());
    }
    o[k] = static_cast<float>(std::sqrt(ss));
  }
  return out;
}

// -- SwiGLU -------------------------------------------------------------------------------------

inline fVec round_bf16(const fVec& v) {  // a float vector's values rounded to bf16 and back
  fVec a, b;
  std::tie(a, b) = at::vec::convert_bfloat16_float(at::vec::convert_float_bfloat16(v, v));
  return a;
}

inline fVec sigmoid(const fVec& g) { return fVec(1.f) / (fVec(1.f) + g.neg().exp()); }

void swiglu_rows(const at::BFloat16* gu, int64_t N, int64_t F, at::BFloat16* act) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const at::BFloat16* g = gu + r * 2 * F;
      const at::BFloat16* u = g + F;
      at::BFloat16* o = act + r * F;
      int64_t i = 0;
      for (; i + kStep <= F; i += kStep) {
        fVec ga, gb, ua, ub;
        load2(g + i, ga, gb);
        load2(u + i, ua, ub);
        store2(o + i, round_bf16(ga * sigmoid(ga)) * ua, round_bf16(gb * sigmoid(gb)) * ub);
      }
      for (; i < F; ++i) {
        const float gi = static_cast<float>(g[i]);
        const float silu = static_cast<float>(static_cast<at::BFloat16>(gi / (1.f + std::exp(-gi))));
        o[i] = static_cast<at::BFloat16>(silu * static_cast<float>(u[i]));
      }
    }
  });
}

void swiglu_backward_rows(const at::BFloat16* grad, const at::BFloat16* gu, int64_t N, int64_t F, at::BFloat16* dgu) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const at::BFloat16* gr = grad + r * F;
      const at::BFloat16* g = gu + r * 2 * F;
      const at::BFloat16* u = g + F;
      at::BFloat16* dg = dgu + r * 2 * F;
      at::BFloat16* du = dg + F;
      int64_t i = 0;
      for (; i + kStep <= F; i += kStep) {
        fVec ra, rb, ga, gb, ua, ub;
        load2(gr + i, ra, rb);
        load2(g + i, ga, gb);
        load2(u + i, ua, ub);
        const fVec sa = sigmoid(ga), sb = sigmoid(gb);
        store2(du + i, ra * round_bf16(ga * sa), rb * round_bf16(gb * sb));
        const fVec one(1.f);
        store2(dg + i, round_bf16(ra * ua) * (sa * (one + ga * (one - sa))),
               round_bf16(rb * ub) * (sb * (one + gb * (one - sb))));
      }
      for (; i < F; ++i) {
        const float ri = static_cast<float>(gr[i]), gi = static_cast<float>(g[i]), ui = static_cast<float>(u[i]);
        const float si = 1.f / (1.f + std::exp(-gi));
        du[i] = static_cast<at::BFloat16>(ri * static_cast<float>(static_cast<at::BFloat16>(gi * si)));
        const float ru = static_cast<float>(static_cast<at::BFloat16>(ri * ui));
        dg[i] = static_cast<at::BFloat16>(ru * (si * (1.f + gi * (1.f - si))));
      }
    }
  });
}

at::Tensor swiglu(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16 && gate_up.size(-1) % 2 == 0, "swiglu: bf16 [..., 2F]");
  auto gu = gate_up.contiguous();
  const int64_t F = gu.size(-1) / 2, N = gu.numel() / (2 * F);
  auto sizes = gu.sizes().vec();
  sizes.back() = F;
  auto act = at::empty(sizes, gu.options());
  swiglu_rows(gu.data_ptr<at::BFloat16>(), N, F, act.data_ptr<at::BFloat16>());
  return act;
}

at::Tensor swiglu_backward(const at::Tensor& grad, const at::Tensor& gate_up) {
  TORCH_CHECK(grad.scalar_type() == at::kBFloat16 && gate_up.scalar_type() == at::kBFloat16, "swiglu_backward: bf16");
  auto gu = gate_up.contiguous();
  auto gr = grad.contiguous();
  const int64_t F = gu.size(-1) / 2, N = gu.numel() / (2 * F);
  TORCH_CHECK(gr.numel() == N * F, "swiglu_backward: shapes");
  auto dgu = at::empty_like(gu);
  swiglu_backward_rows(gr.data_ptr<at::BFloat16>(), gu.data_ptr<at::BFloat16>(), N, F, dgu.data_ptr<at::BFloat16>());
  return dgu;
}

}  // namespace

TORCH_LIBRARY(arlm_train, m) {
  m.def("softmax_xent_(Tensor(a!) logits, Tensor targets, Tensor scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps, bool out_bf16) -> (Tensor, Tensor)");
  m.def("rms_norm_backward(Tensor g, Tensor x, Tensor rstd, Tensor w) -> (Tensor, Tensor)");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, bool inverse) -> Tensor");
  m.def("swiglu(Tensor gate_up) -> Tensor");
  m.def("swiglu_backward(Tensor grad, Tensor gate_up) -> Tensor");
  m.def("rope_qkv(Tensor qkv, Tensor cos, Tensor sin, int n_head, int n_kv_heads) -> (Tensor, Tensor, Tensor)");
  m.def("norms(Tensor[] tensors) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor h, Tensor w, float eps, bool out_bf16) -> (Tensor, Tensor, Tensor)");
  m.def("add_rms_norm_backward(Tensor gs, Tensor gy, Tensor s, Tensor rstd, Tensor w, bool h_bf16) -> (Tensor, Tensor, Tensor)");
  m.def("rope_qkv_backward(Tensor gq, Tensor gk, Tensor gv, Tensor cos, Tensor sin) -> Tensor");
  m.def("adamw_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor(d!) step, "
        "Tensor(e!)? shadow, float lr, float beta1, float beta2, float weight_decay, float eps, float grad_scale) -> ()");
}

TORCH_LIBRARY_IMPL(arlm_train, CPU, m) {
  m.impl("softmax_xent_", &softmax_xent_);
  m.impl("rms_norm", &rms_norm);
  m.impl("rms_norm_backward", &rms_norm_backward);
  m.impl("rope", &rope);
  m.impl("swiglu", &swiglu);
  m.impl("swiglu_backward", &swiglu_backward);
  m.impl("rope_qkv", &rope_qkv);
  m.impl("rope_qkv_backward", &rope_qkv_backward);
  m.impl("norms", &norms);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("add_rms_norm_backward", &add_rms_norm_backward);
  m.impl("adamw_", &adamw_);
}
