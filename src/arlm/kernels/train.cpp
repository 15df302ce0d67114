// Training's fused passes: the cross-entropy gradient over a block of logits, in place.
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
#include <cmath>
#include <limits>

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

}  // namespace

TORCH_LIBRARY(arlm_train, m) { m.def("softmax_xent_(Tensor(a!) logits, Tensor targets, Tensor scale) -> Tensor"); }

TORCH_LIBRARY_IMPL(arlm_train, CPU, m) { m.impl("softmax_xent_", &softmax_xent_); }
