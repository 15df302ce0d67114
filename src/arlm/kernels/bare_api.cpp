// The decode library's C functions for a process without torch (arlm.bare): decode.cpp's layer
// stacks and head, built with ARLM_BARE from the same sources (bare_aten.h's views for ATen's),
// so that each call computes what its torch op computes, bit for bit. Tensors come in as
// `ArlmTensor` views of the caller's memory (numpy arrays over the layout cache's map). Each
// function returns 0, or 1 with the error's message in `arlm_bare_error()`.
#include "aten.h"

#include <omp.h>

#include <string>
#include <vector>

// decode.cpp's functions (the same declarations as its torch registration binds)
void decode_llama(const at::Tensor& x, at::TensorList weights, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& pos, const at::Tensor& cos, const at::Tensor& sin, int64_t kv_len,
                  int64_t n_head, int64_t n_kv_heads, double eps, bool a8, int64_t residual, int64_t kv_format,
                  bool geglu, double q_scale, at::IntArrayRef windows, const at::Tensor& local_cos,
                  const at::Tensor& local_sin);
void forward_llama_paged(const at::Tensor& x, at::TensorList weights, const at::Tensor& k_pool,
                         const at::Tensor& v_pool, const at::Tensor& block_table, const at::Tensor& seq_index,
                         const at::Tensor& pos, const at::Tensor& cos, const at::Tensor& sin, int64_t n_head,
                         int64_t n_kv_heads, double eps, bool a8, int64_t residual, int64_t kv_format, int64_t window,
                         int64_t sinks, bool geglu, double q_scale, at::IntArrayRef windows,
                         const at::Tensor& local_cos, const at::Tensor& local_sin, const at::Tensor& local_k,
                         const at::Tensor& local_v, const at::Tensor& local_table);
void llama_head(const at::Tensor& x, const at::Tensor& norm, at::TensorList head, double eps, bool a8,
                bool residual, const at::Tensor& out);
int64_t argmax_row(const float* r, int64_t V);
bool packed_a8_available();
std::string packed_a8_isa();
bool amx_active();

constexpr int kMaxDim = 6;

extern "C" {
// A view of a caller's array: data, ATen's scalar type number, sizes and strides (in elements).
struct ArlmTensor {
  void* data;
  int64_t dtype;
  int64_t dim;
  int64_t sizes[kMaxDim];
  int64_t strides[kMaxDim];
};

}

namespace {

thread_local std::string g_error;

at::Tensor view(const ArlmTensor& t) {
  TORCH_CHECK(t.dim >= 0 && t.dim <= kMaxDim, "a tensor of more than ", kMaxDim, " dimensions");
  return at::Tensor(t.data, static_cast<at::ScalarType>(t.dtype), t.dim, t.sizes, t.strides);
}

template <class F>
int guarded(F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    g_error = e.what();
  } catch (...) {
    g_error = "unknown error";
  }
  return 1;
}

}  // namespace

extern "C" {

const char* arlm_bare_error() { return g_error.c_str(); }

// 2: the packed kernels are AVX-512 VNNI's, 1: AVX2's, 0: not built.
int arlm_bare_packed() { return !packed_a8_available() ? 0 : packed_a8_isa() == "AVX2" ? 1 : 2; }

int arlm_bare_amx() { return amx_active() ? 1 : 0; }

void arlm_bare_set_threads(int n) { omp_set_num_threads(n); }

int arlm_bare_decode(const ArlmTensor* x, const ArlmTensor* weights, int64_t n_weights, const ArlmTensor* k_cache,
                     const ArlmTensor* v_cache, const ArlmTensor* pos, const ArlmTensor* cos, const ArlmTensor* sin,
                     int64_t kv_len, int64_t n_head, int64_t n_kv_heads, double eps, int a8, int64_t residual,
                     int64_t kv_format, int geglu, double q_scale, const int64_t* windows, int64_t n_windows,
                     const ArlmTensor* local_cos, const ArlmTensor* local_sin) {
  return guarded([&] {
    std::vector<at::Tensor> w;
    for (int64_t i = 0; i < n_weights; ++i) w.push_back(view(weights[i]));
    decode_llama(view(*x), at::TensorList(w.data(), w.size()), view(*k_cache), view(*v_cache), view(*pos),
                 view(*cos), view(*sin), kv_len, n_head, n_kv_heads, eps, a8, residual, kv_format, geglu, q_scale,
                 at::IntArrayRef(windows, n_windows), view(*local_cos), view(*local_sin));
  });
}

int arlm_bare_forward(const ArlmTensor* x, const ArlmTensor* weights, int64_t n_weights, const ArlmTensor* k_pool,
                      const ArlmTensor* v_pool, const ArlmTensor* block_table, const ArlmTensor* seq_index,
                      const ArlmTensor* pos, const ArlmTensor* cos, const ArlmTensor* sin, int64_t n_head,
                      int64_t n_kv_heads, double eps, int a8, int64_t residual, int64_t kv_format, int64_t window,
                      int64_t sinks, int geglu, double q_scale, const int64_t* windows, int64_t n_windows,
                      const ArlmTensor* local_cos, const ArlmTensor* local_sin, const ArlmTensor* local_k,
                      const ArlmTensor* local_v, const ArlmTensor* local_table) {
  return guarded([&] {
    std::vector<at::Tensor> w;
    for (int64_t i = 0; i < n_weights; ++i) w.push_back(view(weights[i]));
    forward_llama_paged(view(*x), at::TensorList(w.data(), w.size()), view(*k_pool), view(*v_pool),
                        view(*block_table), view(*seq_index), view(*pos), view(*cos), view(*sin), n_head, n_kv_heads,
                        eps, a8, residual, kv_format, window, sinks, geglu, q_scale,
                        at::IntArrayRef(windows, n_windows), view(*local_cos), view(*local_sin), view(*local_k),
                        view(*local_v), view(*local_table));
  });
}

int arlm_bare_head(const ArlmTensor* x, const ArlmTensor* norm, const ArlmTensor* head, double eps, int a8,
                   int residual, const ArlmTensor* out) {
  return guarded([&] {
    const at::Tensor w[3] = {view(head[0]), view(head[1]), view(head[2])};
    llama_head(view(*x), view(*norm), at::TensorList(w, 3), eps, a8, residual, view(*out));
  });
}

int64_t arlm_bare_argmax(const float* row, int64_t n) { return argmax_row(row, n); }

}  // extern "C"
