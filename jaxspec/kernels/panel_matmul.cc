// y[M, O] = x[M, I] . W[O, I]^T on CPU for the small M of decode and verify (M = B * T).
//
// The weight is stored pre-packed in panels of 64 output rows, wp[O / 64, I, 64], so a panel is
// one contiguous stream: each weight value is read from memory once and used for every activation
// row, with the next 16 KB prefetched. XLA:CPU runs M = 1 as a bandwidth-bound matrix-vector
// product but M >= 2 as a packed GEMM that copies the weights first (~1.5x the time at M = 2..4
// on SmolLM2); this kernel keeps M = 1..4 at the same cost (the bandwidth floor).
//
// Every output element is one FMA chain over i = 0..I-1 in order, whatever M is, so a verify
// window of γ+1 rows and a one-token step produce bit-identical projections.
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 64;              // output rows per panel
constexpr int64_t kPrefetchFloats = 4096;   // 16 KB ahead in the panel stream
constexpr int kMaxRows = 4;                 // activation rows per register block

#if defined(__AVX512F__)
template <int MB>
inline void PanelRows(const float* x, const float* wp, float* y, int64_t I, int64_t O) {
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int k = 0; k < 4; ++k) acc[m][k] = _mm512_setzero_ps();
  for (int64_t i = 0; i < I; ++i) {
    const float* w = wp + i * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchFloats), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchFloats + 16), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchFloats + 32), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchFloats + 48), _MM_HINT_T0);
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
    const __m512 w2 = _mm512_loadu_ps(w + 32), w3 = _mm512_loadu_ps(w + 48);
    for (int m = 0; m < MB; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * I + i]);
      acc[m][0] = _mm512_fmadd_ps(w0, xb, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(w1, xb, acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(w2, xb, acc[m][2]);
      acc[m][3] = _mm512_fmadd_ps(w3, xb, acc[m][3]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int k = 0; k < 4; ++k) _mm512_storeu_ps(y + m * O + 16 * k, acc[m][k]);
}
#else  // portable: the compiler vectorises the 64-wide inner loop (AVX2, NEON, ...)
template <int MB>
inline void PanelRows(const float* x, const float* wp, float* y, int64_t I, int64_t O) {
  float acc[MB][kPanel] = {};
  for (int64_t i = 0; i < I; ++i) {
    const float* w = wp + i * kPanel;
    __builtin_prefetch(w + kPrefetchFloats);
    for (int m = 0; m < MB; ++m) {
      const float xv = x[m * I + i];
      for (int j = 0; j < kPanel; ++j) acc[m][j] = __builtin_fmaf(w[j], xv, acc[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < kPanel; ++j) y[m * O + j] = acc[m][j];
}
#endif

// Panels [p0, p1) for all M rows.
void Panels(const float* x, const float* wp, float* y, int64_t M, int64_t I, int64_t O,
            int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const float* w = wp + p * I * kPanel;
    for (int64_t m = 0; m < M; m += kMaxRows) {
      const float* xm = x + m * I;
      float* ym = y + m * O + p * kPanel;
      switch (std::min<int64_t>(kMaxRows, M - m)) {
        case 1: PanelRows<1>(xm, w, ym, I, O); break;
        case 2: PanelRows<2>(xm, w, ym, I, O); break;
        case 3: PanelRows<3>(xm, w, ym, I, O); break;
        default: PanelRows<4>(xm, w, ym, I, O); break;
      }
    }
  }
}

ffi::Error PanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> wp,
                       ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = wp.dimensions();
  const auto xd = x.dimensions();
  if (wd.size() != 3 || wd[2] != kPanel || xd.size() < 1 || xd.back() != wd[1])
    return ffi::Error::InvalidArgument("panel_matmul: want x[..., I] and wp[P, I, 64]");
  const float* xp = x.typed_data();
  const float* w = wp.typed_data();
  float* yp = y->typed_data();
  const int64_t I = wd[1], M = x.element_count() / wd[1], num_panels = wd[0], O = wd[0] * kPanel;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per_chunk = std::max<int64_t>(1, num_panels / (8 * threads));
  const int64_t num_chunks = (num_panels + per_chunk - 1) / per_chunk;
  jaxspec::ParallelFor(pool, num_chunks, [=](int64_t c) {
    const int64_t p0 = c * per_chunk;
    Panels(xp, w, yp, M, I, O, p0, std::min(num_panels, p0 + per_chunk));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecPanelMatmul, PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
