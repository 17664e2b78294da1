// Attention of a short query window over a KV cache whose valid slots form a prefix, on CPU.
//
//   q[B, T, N, H], k/v cache[B, K, S, H], k/v window[B, T, K, H], lengths[B], mask[B, T, T]
//     ->  out[B, T, N, H]
//   query t of row b attends cache slots s < lengths[b], then the window positions j with
//   mask[b, t, j] != 0, in ascending j (causal windows: j = 0..t; draft trees: the node's
//   ancestors and itself, in depth order -- the order plain decoding later reads them from the
//   cache, so a tree node's row equals the one-token step at its position bit for bit)
//
// The window's own keys and values come as separate inputs, so the cache may be written before or
// after the call (speculate.py writes it after a variable-width verify: a cache written inside a
// lax.switch branch is copied whole by XLA).
//
// Decode (T = 1) and verify windows (T = γ+1) read every valid k/v row once for all G*T query
// rows of a kv head (G = N / K) and never touch the slots past the prefix. XLA:CPU instead runs
// these batched products and the softmax over the whole capacity S: in SmolLM2's decode loop with
// ~770-token prompts, plain decoding ran at 22-27 tok/s with XLA's attention and 38-40 with this.
//
// Each query row is computed alone, in a fixed order (slots ascending, fixed-order lane sums), so a
// row's output does not depend on T or on the other rows in the window.
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;

// Fixed-order lane sums: 16 partial sums, then a fixed tree (the same whatever the caller).
inline float LaneSum(const float* acc) {
  float t[kLanes];
  for (int j = 0; j < kLanes; ++j) t[j] = acc[j];
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) t[j] += t[j + w];
  return t[0];
}

// exp(x) for x <= 0 (softmax after the max is subtracted): Cephes' expf polynomial, written as
// plain arithmetic so loops over it vectorise; relative error ~1e-7, exp(x < -87) -> 0.
inline float ExpNonPositive(float x) {
  const float clamped = x < -87.0f ? -87.0f : x;
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float t = __builtin_fmaf(clamped, 1.44269504088896341f, shifter);
  const float n = t - shifter;
  float r = __builtin_fmaf(n, -0.693359375f, clamped);
  r = __builtin_fmaf(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = __builtin_fmaf(p, r, 1.3981999507e-3f);
  p = __builtin_fmaf(p, r, 8.3334519073e-3f);
  p = __builtin_fmaf(p, r, 4.1665795894e-2f);
  p = __builtin_fmaf(p, r, 1.6666665459e-1f);
  p = __builtin_fmaf(p, r, 5.0000001201e-1f);
  const float e = __builtin_fmaf(p, r * r, r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.0f ? 0.0f : e * scale;
}

struct Shapes {
  int64_t B, T, N, K, S, H, G;
};

// The key (or value) rows one query sees, in order: `cached` cache rows, then window rows
// widx[0], widx[1], ... (row j at window + j * stride).
struct Slots {
  const float* cache;   // [S, H] of one (batch row, kv head)
  const float* window;
  const int32_t* widx;
  int64_t cached, stride, H;
  const float* at(int64_t s) const {
    return s < cached ? cache + s * H : window + widx[s - cached] * stride;
  }
};

constexpr int kRowBlock = 4;  // query rows sharing each k/v load

#if defined(__AVX512F__)

// exp of 16 lanes, x <= 0: ExpNonPositive lane by lane (same constants, same rounding).
inline __m512 Exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  const __m512 c = _mm512_max_ps(x, lo);
  const __m512 shifter = _mm512_set1_ps(12582912.0f);
  const __m512 t = _mm512_fmadd_ps(c, _mm512_set1_ps(1.44269504088896341f), shifter);
  const __m512 n = _mm512_sub_ps(t, shifter);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), c);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 e = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(~underflow, e, _mm512_castsi512_ps(bits));
}

// Fold (a, b) by `half`: within every group of 2*half lanes, add the second half onto the first;
// a's folded groups fill lanes 0..7 of the result, b's lanes 8..15.
template <int half>
inline __m512 FoldPair(__m512 a, __m512 b) {
  static constexpr auto lane = [](int i, int offset) {
    return (i < 8 ? 0 : 16) + ((i % 8) / half) * 2 * half + offset + i % half;
  };
  const __m512i il = _mm512_setr_epi32(
      lane(0, 0), lane(1, 0), lane(2, 0), lane(3, 0), lane(4, 0), lane(5, 0), lane(6, 0), lane(7, 0),
      lane(8, 0), lane(9, 0), lane(10, 0), lane(11, 0), lane(12, 0), lane(13, 0), lane(14, 0), lane(15, 0));
  const __m512i ih = _mm512_setr_epi32(
      lane(0, half), lane(1, half), lane(2, half), lane(3, half), lane(4, half), lane(5, half),
      lane(6, half), lane(7, half), lane(8, half), lane(9, half), lane(10, half), lane(11, half),
      lane(12, half), lane(13, half), lane(14, half), lane(15, half));
  return _mm512_add_ps(_mm512_permutex2var_ps(a, il, b), _mm512_permutex2var_ps(a, ih, b));
}

// Lane j of the result = the sum of all 16 lanes of x[j], by a fixed tree (4 fold levels).
inline __m512 SumEach16(__m512* x) {
  for (int i = 0; i < 8; ++i) x[i] = FoldPair<8>(x[2 * i], x[2 * i + 1]);
  for (int i = 0; i < 4; ++i) x[i] = FoldPair<4>(x[2 * i], x[2 * i + 1]);
  for (int i = 0; i < 2; ++i) x[i] = FoldPair<2>(x[2 * i], x[2 * i + 1]);
  return FoldPair<1>(x[0], x[1]);
}

// scores[s] = q . k[s] * scale for s in [0, n) (16 at a time; the tail reads as 0).
template <int HC>  // H = 16 * HC
void ScoreRow(const float* q, const Slots& k, int64_t n, float scale, float* scores) {
  __m512 qv[HC];
  for (int c = 0; c < HC; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t s0 = 0; s0 < n; s0 += 16) {
    __m512 x[16];
    for (int j = 0; j < 16; ++j) {
      if (s0 + j >= n) { x[j] = _mm512_setzero_ps(); continue; }
      const float* ks = k.at(s0 + j);
      __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(ks));
      for (int c = 1; c < HC; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(ks + 16 * c), a);
      x[j] = a;
    }
    _mm512_storeu_ps(scores + s0, _mm512_mul_ps(SumEach16(x), sc));
  }
}

// out[r] = sum_{s < n[r]} w[r * ld + s] * v[s] for rows r < R (slots ascending).
template <int HC>
void WeightBlock(const float* w, int64_t ld, const int64_t* n, int R, const Slots& v, float* const* out) {
  __m512 o[kRowBlock][HC];
  for (int r = 0; r < kRowBlock; ++r)
    for (int c = 0; c < HC; ++c) o[r][c] = _mm512_setzero_ps();
  int64_t most = 0;
  for (int r = 0; r < R; ++r) most = std::max(most, n[r]);
  for (int64_t s = 0; s < most; ++s) {
    __m512 vs[HC];
    const float* vrow = v.at(s);
    for (int c = 0; c < HC; ++c) vs[c] = _mm512_loadu_ps(vrow + 16 * c);
    for (int r = 0; r < kRowBlock; ++r) {
      if (r >= R || s >= n[r]) continue;
      const __m512 ws = _mm512_set1_ps(w[r * ld + s]);
      for (int c = 0; c < HC; ++c) o[r][c] = _mm512_fmadd_ps(ws, vs[c], o[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < HC; ++c) _mm512_storeu_ps(out[r] + 16 * c, o[r][c]);
}

// Softmax weights in place over scores[0, n) (unnormalised); returns 1 / their sum.
inline float SoftmaxInPlace(float* scores, int64_t n) {
  __m512 m16 = _mm512_set1_ps(-INFINITY);
  int64_t s = 0;
  for (; s + 16 <= n; s += 16) m16 = _mm512_max_ps(m16, _mm512_loadu_ps(scores + s));
  float m = _mm512_reduce_max_ps(m16);
  for (; s < n; ++s) m = std::max(m, scores[s]);
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (s = 0; s + 16 <= n; s += 16) {
    const __m512 e = Exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + s), mv));
    _mm512_storeu_ps(scores + s, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (s < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - s)) - 1);
    const __m512 e = Exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, scores + s), mv));
    _mm512_mask_storeu_ps(scores + s, tail, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
  }
  alignas(64) float lanes[kLanes];
  _mm512_store_ps(lanes, sum);
  return 1.0f / LaneSum(lanes);
}

// Up to kRowBlock rows of one kv head (H = 16 * HC).
template <int HC>
void VectorRows(const float* const* q, const int64_t* n, int R, const Slots& k, const Slots& v,
                float scale, float* const* out, float* scratch) {
  int64_t most = 0;
  for (int r = 0; r < R; ++r) most = std::max(most, n[r]);
  const int64_t ld = (most + 15) / 16 * 16;
  for (int r = 0; r < R; ++r) ScoreRow<HC>(q[r], k, n[r], scale, scratch + r * ld);
  float inv[kRowBlock];
  for (int r = 0; r < R; ++r) inv[r] = n[r] > 0 ? SoftmaxInPlace(scratch + r * ld, n[r]) : 0.0f;
  WeightBlock<HC>(scratch, ld, n, R, v, out);
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 16 * HC; ++h) out[r][h] *= inv[r];
}
#endif

inline void ScoresPortable(const float* q, const Slots& k, int64_t n, int64_t H, float scale,
                           float* scores) {
  for (int64_t s = 0; s < n; ++s) {
    float acc[kLanes] = {};
    const float* ks = k.at(s);
    for (int64_t h = 0; h < H; ++h) acc[h % kLanes] = __builtin_fmaf(q[h], ks[h], acc[h % kLanes]);
    scores[s] = LaneSum(acc) * scale;
  }
}

inline void WeightedPortable(const float* w, const Slots& v, int64_t n, int64_t H, float* out) {
  for (int64_t h = 0; h < H; ++h) out[h] = 0.0f;
  for (int64_t s = 0; s < n; ++s) {
    const float* vs = v.at(s);
    for (int64_t h = 0; h < H; ++h) out[h] = __builtin_fmaf(w[s], vs[h], out[h]);
  }
}

// One query row over its n valid slots of one kv head: softmax(q . k * scale) . v (any H).
void PortableRow(const float* q, const Slots& k, const Slots& v, int64_t n, int64_t H, float scale,
                 float* out, float* scratch) {
  if (n <= 0) {
    for (int64_t h = 0; h < H; ++h) out[h] = 0.0f;
    return;
  }
  ScoresPortable(q, k, n, H, scale, scratch);
  float m = -INFINITY;
  for (int64_t s = 0; s < n; ++s) m = std::max(m, scratch[s]);
  for (int64_t s = 0; s < n; ++s) scratch[s] = ExpNonPositive(scratch[s] - m);
  float acc[kLanes] = {};
  for (int64_t s = 0; s < n; ++s) acc[s % kLanes] += scratch[s];
  const float inv_sum = 1.0f / LaneSum(acc);
  WeightedPortable(scratch, v, n, H, out);
  for (int64_t h = 0; h < H; ++h) out[h] *= inv_sum;
}

// Query rows [r0, r1) of (batch b, kv head kh); row r is head kh*G + r/T at window position r%T.
// Blocks of rows share each k/v load; a row's arithmetic does not depend on its block.
void HeadRows(const Shapes& d, const float* q, const float* kc, const float* vc, const float* kw,
              const float* vw, const int32_t* lengths, const uint8_t* mask, float scale, float* out,
              int64_t b, int64_t kh, int64_t r0, int64_t r1) {
  const int64_t cached = std::clamp<int64_t>(lengths[b], 0, d.S), stride = d.K * d.H;
  const int64_t cache_at = (b * d.K + kh) * d.S * d.H, window_at = b * d.T * stride + kh * d.H;
  // Window positions each query attends (ascending), and whether the window is plain causal.
  std::vector<int32_t> lists(d.T * d.T);
  std::vector<int64_t> counts(d.T);
  bool causal = true;
  for (int64_t t = 0; t < d.T; ++t) {
    int64_t c = 0;
    for (int64_t j = 0; j < d.T; ++j)
      if (mask[(b * d.T + t) * d.T + j]) lists[t * d.T + c++] = static_cast<int32_t>(j);
    counts[t] = c;
    causal = causal && c == t + 1 && (c == 0 || lists[t * d.T + c - 1] == t);
  }
  std::vector<float> scratch(kRowBlock * ((cached + d.T + 15) / 16 * 16));
  // Rows in blocks: causal windows block consecutive rows (row t's window list is a prefix of row
  // t+1's); otherwise a block holds rows at one window position (heads sharing one list).
  std::vector<int64_t> order;
  order.reserve(r1 - r0);
  if (causal) {
    for (int64_t r = r0; r < r1; ++r) order.push_back(r);
  } else {
    for (int64_t t = 0; t < d.T; ++t)
      for (int64_t r = r0; r < r1; ++r)
        if (r % d.T == t) order.push_back(r);
  }
  const int32_t* widest = lists.data() + (d.T - 1) * d.T;  // causal: 0..T-1
  for (size_t i0 = 0; i0 < order.size();) {
    const float* qs[kRowBlock];
    float* outs[kRowBlock];
    int64_t n[kRowBlock];
    const int64_t t0 = order[i0] % d.T;
    int R = 0;
    while (R < kRowBlock && i0 + R < order.size() && (causal || order[i0 + R] % d.T == t0)) {
      const int64_t r = order[i0 + R], head = kh * d.G + r / d.T, t = r % d.T;
      const int64_t at = ((b * d.T + t) * d.N + head) * d.H;
      qs[R] = q + at;
      outs[R] = out + at;
      n[R] = cached + counts[t];
      ++R;
    }
    i0 += R;
    const int32_t* widx = causal ? widest : lists.data() + t0 * d.T;
    const Slots k{kc + cache_at, kw + window_at, widx, cached, stride, d.H};
    const Slots v{vc + cache_at, vw + window_at, widx, cached, stride, d.H};
#if defined(__AVX512F__)
    if (d.H == 64) { VectorRows<4>(qs, n, R, k, v, scale, outs, scratch.data()); continue; }
    if (d.H == 128) { VectorRows<8>(qs, n, R, k, v, scale, outs, scratch.data()); continue; }
#endif
    for (int i = 0; i < R; ++i) PortableRow(qs[i], k, v, n[i], d.H, scale, outs[i], scratch.data());
  }
}

ffi::Error PrefixAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> k_win,
                           ffi::Buffer<ffi::F32> v_win, ffi::Buffer<ffi::S32> lengths,
                           ffi::Buffer<ffi::U8> mask, float scale, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || v.element_count() != k.element_count() || kd[0] != qd[0] ||
      kd[3] != qd[3] || kd[1] == 0 || qd[2] % kd[1] != 0 || lengths.element_count() != qd[0] ||
      k_win.element_count() != qd[0] * qd[1] * kd[1] * kd[3] ||
      v_win.element_count() != k_win.element_count() ||
      mask.element_count() != qd[0] * qd[1] * qd[1])
    return ffi::Error::InvalidArgument(
        "prefix_attention: want q[B, T, N, H], k/v[B, K, S, H] with K | N, k/v window[B, T, K, H], "
        "lengths[B], mask[B, T, T]");
  const Shapes d{qd[0], qd[1], qd[2], kd[1], kd[2], qd[3], qd[2] / kd[1]};
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const float *kwp = k_win.typed_data(), *vwp = v_win.typed_data();
  const int32_t* lp = lengths.typed_data();
  const uint8_t* mp = mask.typed_data();
  float* op = out->typed_data();
  // Tasks: (b, kv head, slice of its G*T query rows); slices only when there are few heads, so
  // every thread has work (a slice re-reads the head's k/v, which then sits in cache).
  const int64_t rows = d.G * d.T, heads = d.B * d.K;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t slices = std::clamp<int64_t>((2 * threads + heads - 1) / heads, 1, rows);
  const int64_t per_slice = (rows + slices - 1) / slices;
  auto fn = [=](int64_t task) {
    const int64_t head = task / slices, slice = task % slices;
    const int64_t r0 = slice * per_slice, r1 = std::min(rows, r0 + per_slice);
    if (r0 < r1) HeadRows(d, qp, kp, vp, kwp, vwp, lp, mp, scale, op, head / d.K, head % d.K, r0, r1);
  };
  jaxspec::ParallelFor(pool, heads * slices, fn);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecPrefixAttention, PrefixAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
