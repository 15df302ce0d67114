// The part of ATen's C++ API the decode kernels use, without libtorch: a non-owning view of a
// tensor (`at::Tensor`: data, dtype, sizes, strides), ATen's scalar types, `TORCH_CHECK` (throws
// std::runtime_error) and `at::parallel_for` on OpenMP, split as ATen splits it. The decode
// library built with ARLM_BARE (bare_api.cpp: the same sources, no torch) sees these instead of
// the real headers (aten.h picks one); a process that never imports torch calls it through its
// C functions (arlm.bare). Only views: nothing here allocates a tensor, and the kernels' ops
// that return new tensors, or multiply through torch's GEMMs, are left out of that build.
#pragma once

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <sstream>
#include <stdexcept>
#include <string>

namespace at {

enum class ScalarType : int8_t { Byte = 0, Char = 1, Short = 2, Int = 3, Long = 4, Half = 5, Float = 6, Double = 7,
                                 Bool = 11, BFloat16 = 15 };
constexpr ScalarType kByte = ScalarType::Byte, kChar = ScalarType::Char, kInt = ScalarType::Int,
                     kLong = ScalarType::Long, kHalf = ScalarType::Half, kFloat = ScalarType::Float,
                     kDouble = ScalarType::Double, kBFloat16 = ScalarType::BFloat16;

inline std::ostream& operator<<(std::ostream& os, ScalarType t) { return os << "dtype " << static_cast<int>(t); }

// IEEE half: conversions round to nearest even, as c10::Half's.
struct Half {
  uint16_t x;
  Half() = default;
  Half(float f) : x(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT)) {}  // NOLINT: implicit, as c10::Half
  operator float() const { return _cvtsh_ss(x); }
};

struct BFloat16 {
  uint16_t x;
  BFloat16() = default;
  BFloat16(float f) {  // NOLINT: round to nearest even, as c10::BFloat16 (NaN kept a NaN)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    x = (f != f) ? 0x7fc0 : static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
  }
  operator float() const {
    const uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

template <class T>
class ArrayRef {
 public:
  ArrayRef() : data_(nullptr), n_(0) {}
  ArrayRef(const T* data, size_t n) : data_(data), n_(n) {}
  const T* data() const { return data_; }
  size_t size() const { return n_; }
  bool empty() const { return n_ == 0; }
  const T* begin() const { return data_; }
  const T* end() const { return data_ + n_; }
  const T& operator[](size_t i) const { return data_[i]; }
  ArrayRef slice(size_t start, size_t n) const { return ArrayRef(data_ + start, n); }
  bool operator==(const ArrayRef& o) const { return n_ == o.n_ && std::equal(begin(), end(), o.begin()); }
  bool operator!=(const ArrayRef& o) const { return !(*this == o); }

 private:
  const T* data_;
  size_t n_;
};
using IntArrayRef = ArrayRef<int64_t>;

constexpr int kMaxDim = 6;

// A view of memory someone else owns (arlm.bare passes these in: `ArlmTensor` in bare_api.cpp).
class Tensor {
 public:
  Tensor() = default;
  Tensor(void* data, ScalarType dtype, int64_t dim, const int64_t* sizes, const int64_t* strides)
      : data_(data), dtype_(dtype), dim_(dim) {
    for (int64_t i = 0; i < dim; ++i) sizes_[i] = sizes[i], strides_[i] = strides[i];
  }
  template <class T>
  T* data_ptr() const { return static_cast<T*>(data_); }
  void* data_ptr() const { return data_; }
  int64_t dim() const { return dim_; }
  int64_t size(int64_t i) const { return sizes_[i < 0 ? i + dim_ : i]; }
  int64_t stride(int64_t i) const { return strides_[i < 0 ? i + dim_ : i]; }
  IntArrayRef sizes() const { return IntArrayRef(sizes_, dim_); }
  IntArrayRef strides() const { return IntArrayRef(strides_, dim_); }
  ScalarType scalar_type() const { return dtype_; }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t i = 0; i < dim_; ++i) n *= sizes_[i];
    return n;
  }
  bool is_contiguous() const {
    int64_t expect = 1;
    for (int64_t i = dim_ - 1; i >= 0; --i) {
      if (sizes_[i] != 1 && strides_[i] != expect) return false;
      expect *= sizes_[i];
    }
    return true;
  }

 private:
  void* data_ = nullptr;
  ScalarType dtype_ = kFloat;
  int64_t dim_ = 1;
  int64_t sizes_[kMaxDim] = {0};
  int64_t strides_[kMaxDim] = {1};
};
using TensorList = ArrayRef<Tensor>;

inline int get_num_threads() { return omp_get_max_threads(); }
inline int get_thread_num() { return omp_get_thread_num(); }
inline bool in_parallel_region() { return omp_in_parallel(); }

// ATen's OpenMP parallel_for (ATen/Parallel-inl.h, ParallelOpenMP.h): [begin, end) in one chunk
// per thread, at most (end - begin) / grain threads; inline where the range is not over one grain,
// or already in a parallel region. An exception in a chunk is rethrown after the region.
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  if (!(end - begin > grain && end - begin > 1 && !in_parallel_region() && get_num_threads() > 1)) {
    f(begin, end);
    return;
  }
  std::exception_ptr error;
#pragma omp parallel
  {
    int64_t n = omp_get_num_threads();
    if (grain > 0) n = std::min<int64_t>(n, (end - begin + grain - 1) / grain);
    const int64_t tid = omp_get_thread_num(), chunk = (end - begin + n - 1) / n, b = begin + tid * chunk;
    if (b < end) {
      try {
        f(b, std::min(end, b + chunk));
      } catch (...) {
#pragma omp critical
        if (!error) error = std::current_exception();
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace at

namespace arlm_bare {
inline void put(std::ostringstream&) {}
template <class T, class... R>
void put(std::ostringstream& s, const T& v, const R&... rest) {
  s << v;
  put(s, rest...);
}
template <class... R>
std::string message(const R&... parts) {
  std::ostringstream s;
  put(s, parts...);
  return s.str();
}
}  // namespace arlm_bare

#define TORCH_CHECK(cond, ...) \
  do {                         \
    if (!(cond)) throw std::runtime_error(arlm_bare::message(__VA_ARGS__)); \
  } while (0)
