// Lockstep CPU kernels: every output element is computed by one fixed sequence of fp32
// operations that depends only on the element's own inputs (never on M, the row's index in
// the call, the thread count, or how a sequence was split into query chunks).
//
// The arithmetic is defined by the code, not by the compiler: all kernels are written once
// against a 16-lane vector type `V` with three implementations (AVX-512, AVX2 as two 8-lane
// halves, and portable scalar code using std::fma) whose lane-wise operations are IEEE exact
// (add, mul, fma, div, min, max, round-to-nearest-even), so the three give the same bits.
// Compile with -ffp-contract=off so that no a*b+c is silently fused.
//
// Fixed reduction order used everywhere ("lane-partial + tree"):
//   lane l (0..15) accumulates elements k = l, l+16, l+32, ... in ascending k (FMA),
//   then  s8[i] = a[i] + a[i+8],  s4[i] = s8[i] + s8[i+4],  s2[i] = s4[i] + s4[i+2],
//         sum = s2[0] + s2[1].
// Reduced lengths are padded with zeros to a multiple of 16.

#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <xmmintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace lockstep {

constexpr float kInf = std::numeric_limits<float>::infinity();

// ----------------------------------------------------------------------------------------
// 16-lane vector types. min/max follow the x86 rule (second operand if unordered or equal)
// in all three so that NaN and signed zeros behave identically.
// ----------------------------------------------------------------------------------------

struct VecScalar {
  float v[16];
  static constexpr const char* kName = "scalar";

  static VecScalar zero() { return set1(0.f); }
  static VecScalar set1(float a) {
    VecScalar r;
    for (int i = 0; i < 16; ++i) r.v[i] = a;
    return r;
  }
  static VecScalar load(const float* p) {
    VecScalar r;
    std::memcpy(r.v, p, sizeof(r.v));
    return r;
  }
  static VecScalar load(const uint16_t* p) {  // bfloat16 -> fp32 is exact: shift left 16
    VecScalar r;
    for (int i = 0; i < 16; ++i) {
      uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
      std::memcpy(&r.v[i], &bits, 4);
    }
    return r;
  }
  void store(float* p) const { std::memcpy(p, v, sizeof(v)); }
  static VecScalar fma(const VecScalar& a, const VecScalar& b, const VecScalar& c) {
    VecScalar r;
    for (int i = 0; i < 16; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
    return r;
  }
#define LOCKSTEP_SCALAR_BINOP(NAME, EXPR)                            \
  static VecScalar NAME(const VecScalar& a, const VecScalar& b) {    \
    VecScalar r;                                                     \
    for (int i = 0; i < 16; ++i) {                                   \
      const float x = a.v[i], y = b.v[i];                            \
      r.v[i] = (EXPR);                                               \
    }                                                                \
    return r;                                                        \
  }
  LOCKSTEP_SCALAR_BINOP(add, x + y)
  LOCKSTEP_SCALAR_BINOP(sub, x - y)
  LOCKSTEP_SCALAR_BINOP(mul, x * y)
  LOCKSTEP_SCALAR_BINOP(div, x / y)
  LOCKSTEP_SCALAR_BINOP(min, x < y ? x : y)
  LOCKSTEP_SCALAR_BINOP(max, x > y ? x : y)
#undef LOCKSTEP_SCALAR_BINOP
  static VecScalar round_even(const VecScalar& a) {
    VecScalar r;
    for (int i = 0; i < 16; ++i) r.v[i] = std::nearbyint(a.v[i]);
    return r;
  }
  // 2^n for integral n in [-126, 127].
  static VecScalar pow2i(const VecScalar& n) {
    VecScalar r;
    for (int i = 0; i < 16; ++i) {
      uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n.v[i]) + 127) << 23;
      std::memcpy(&r.v[i], &bits, 4);
    }
    return r;
  }
  // Lanes where x < t (ordered) become +0, others keep val.
  static VecScalar zero_where_less(const VecScalar& x, float t, const VecScalar& val) {
    VecScalar r;
    for (int i = 0; i < 16; ++i) r.v[i] = x.v[i] < t ? 0.f : val.v[i];
    return r;
  }
  float reduce_add() const {
    float s8[8], s4[4], s2[2];
    for (int i = 0; i < 8; ++i) s8[i] = v[i] + v[i + 8];
    for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
    for (int i = 0; i < 2; ++i) s2[i] = s4[i] + s4[i + 2];
    return s2[0] + s2[1];
  }
  // out[i] = a[i].reduce_add() for 16 vectors (the AVX-512 type batches this).
  static void reduce16(const VecScalar* a, float* out) {
    for (int i = 0; i < 16; ++i) out[i] = a[i].reduce_add();
  }
  float reduce_max() const {
    float s8[8], s4[4], s2[2];
    for (int i = 0; i < 8; ++i) s8[i] = v[i] > v[i + 8] ? v[i] : v[i + 8];
    for (int i = 0; i < 4; ++i) s4[i] = s8[i] > s8[i + 4] ? s8[i] : s8[i + 4];
    for (int i = 0; i < 2; ++i) s2[i] = s4[i] > s4[i + 2] ? s4[i] : s4[i + 2];
    return s2[0] > s2[1] ? s2[0] : s2[1];
  }
};

#if defined(__AVX2__) && defined(__FMA__)
struct VecAvx2 {
  __m256 lo, hi;  // lanes 0..7 and 8..15
  static constexpr const char* kName = "avx2";

  static VecAvx2 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static VecAvx2 set1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
  static VecAvx2 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static __m256 bf16x8(const uint16_t* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static VecAvx2 load(const uint16_t* p) { return {bf16x8(p), bf16x8(p + 8)}; }
  void store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
  static VecAvx2 fma(const VecAvx2& a, const VecAvx2& b, const VecAvx2& c) {
    return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
  }
#define LOCKSTEP_AVX2_BINOP(NAME, INTR)                    \
  static VecAvx2 NAME(const VecAvx2& a, const VecAvx2& b) { \
    return {INTR(a.lo, b.lo), INTR(a.hi, b.hi)};           \
  }
  LOCKSTEP_AVX2_BINOP(add, _mm256_add_ps)
  LOCKSTEP_AVX2_BINOP(sub, _mm256_sub_ps)
  LOCKSTEP_AVX2_BINOP(mul, _mm256_mul_ps)
  LOCKSTEP_AVX2_BINOP(div, _mm256_div_ps)
  LOCKSTEP_AVX2_BINOP(min, _mm256_min_ps)
  LOCKSTEP_AVX2_BINOP(max, _mm256_max_ps)
#undef LOCKSTEP_AVX2_BINOP
  static VecAvx2 round_even(const VecAvx2& a) {
    constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return {_mm256_round_ps(a.lo, kMode), _mm256_round_ps(a.hi, kMode)};
  }
  static __m256 pow2i8(__m256 n) {
    __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
  }
  static VecAvx2 pow2i(const VecAvx2& n) { return {pow2i8(n.lo), pow2i8(n.hi)}; }
  static VecAvx2 zero_where_less(const VecAvx2& x, float t, const VecAvx2& val) {
    __m256 tt = _mm256_set1_ps(t);
    return {_mm256_andnot_ps(_mm256_cmp_ps(x.lo, tt, _CMP_LT_OQ), val.lo),
            _mm256_andnot_ps(_mm256_cmp_ps(x.hi, tt, _CMP_LT_OQ), val.hi)};
  }
  float reduce_add() const {
    __m256 s8 = _mm256_add_ps(lo, hi);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
  }
  static void reduce16(const VecAvx2* a, float* out) {
    for (int i = 0; i < 16; ++i) out[i] = a[i].reduce_add();
  }
  float reduce_max() const {
    __m256 s8 = _mm256_max_ps(lo, hi);
    __m128 s4 = _mm_max_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_max_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_max_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
  }
};
#endif

#if defined(__AVX512F__)
struct VecAvx512 {
  __m512 v;
  static constexpr const char* kName = "avx512";

  static VecAvx512 zero() { return {_mm512_setzero_ps()}; }
  static VecAvx512 set1(float a) { return {_mm512_set1_ps(a)}; }
  static VecAvx512 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static VecAvx512 load(const uint16_t* p) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  static VecAvx512 fma(const VecAvx512& a, const VecAvx512& b, const VecAvx512& c) {
    return {_mm512_fmadd_ps(a.v, b.v, c.v)};
  }
  static VecAvx512 add(const VecAvx512& a, const VecAvx512& b) { return {_mm512_add_ps(a.v, b.v)}; }
  static VecAvx512 sub(const VecAvx512& a, const VecAvx512& b) { return {_mm512_sub_ps(a.v, b.v)}; }
  static VecAvx512 mul(const VecAvx512& a, const VecAvx512& b) { return {_mm512_mul_ps(a.v, b.v)}; }
  static VecAvx512 div(const VecAvx512& a, const VecAvx512& b) { return {_mm512_div_ps(a.v, b.v)}; }
  static VecAvx512 min(const VecAvx512& a, const VecAvx512& b) { return {_mm512_min_ps(a.v, b.v)}; }
  static VecAvx512 max(const VecAvx512& a, const VecAvx512& b) { return {_mm512_max_ps(a.v, b.v)}; }
  static VecAvx512 round_even(const VecAvx512& a) {
    return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
  }
  static VecAvx512 pow2i(const VecAvx512& n) {
    __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(e, 23))};
  }
  static VecAvx512 zero_where_less(const VecAvx512& x, float t, const VecAvx512& val) {
    __mmask16 lt = _mm512_cmp_ps_mask(x.v, _mm512_set1_ps(t), _CMP_LT_OQ);
    return {_mm512_maskz_mov_ps(static_cast<__mmask16>(~lt), val.v)};
  }
  float reduce_add() const {
    __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
  }
  // out[i] = a[i].reduce_add() for 16 vectors at once: each level of the tree adds the same
  // lane pairs as reduce_add (i + 8, i + 4, i + 2, i + 1), with shuffles packing the
  // partial sums of several vectors into one register. Same bits, about 3x fewer instructions.
  static void reduce16(const VecAvx512* a, float* out) {
    __m512 b[8], c[4], d[2];
    for (int k = 0; k < 8; ++k)  // b[k]: lanes 0-7 = s8 of a[2k], lanes 8-15 = s8 of a[2k+1]
      b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k].v, a[2 * k + 1].v, 0x44),
                           _mm512_shuffle_f32x4(a[2 * k].v, a[2 * k + 1].v, 0xEE));
    for (int k = 0; k < 4; ++k)  // c[k]: 128-bit quarter q = s4 of a[4k + q]
      c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0x88),
                           _mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0xDD));
    for (int k = 0; k < 2; ++k)  // d[k]: quarter q = s2 of a[8k + q], then of a[8k + 4 + q]
      d[k] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // e lane 4q + j = sum of a[4j + q]; permute back to input order.
    const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_ps(out, _mm512_permutexvar_ps(idx, e));
  }
  float reduce_max() const {
    __m256 s8 = _mm256_max_ps(_mm512_castps512_ps256(v),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 s4 = _mm_max_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_max_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_max_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
  }
};
#endif

// ----------------------------------------------------------------------------------------
// Shared helpers
// ----------------------------------------------------------------------------------------

// Worker threads and the caller may differ in MXCSR (flush-to-zero, rounding mode); pin the
// default state for the duration of a task so that a row's bits never depend on which thread
// computed it.
class FpEnvGuard {
 public:
  FpEnvGuard() : saved_(_mm_getcsr()) { _mm_setcsr(0x1F80); }
  ~FpEnvGuard() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
};

// Runs fn(task) for task in [0, n) on torch's intra-op threads, handing tasks out dynamically
// (tasks have unequal cost, e.g. causal attention tiles). Which thread runs a task never
// changes the task's arithmetic.
template <class F>
void parallel_tasks(int64_t n, const F& fn) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(n, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    FpEnvGuard guard;
    for (int64_t t = next.fetch_add(1); t < n; t = next.fetch_add(1)) fn(t);
  });
}

// Deterministic exp (Cephes expf scheme): one formula for every lane and every caller, so
// silu and softmax never depend on whether an element went down a vector or a tail path.
// x < -87.34 (including -inf) gives +0; x above 88.38 saturates; NaN propagates.
template <class V>
inline V vexp(const V& x) {
  const V xc = V::max(V::set1(-87.3365478515625f), V::min(V::set1(88.3762626647949f), x));
  const V n = V::round_even(V::mul(xc, V::set1(1.44269504088896341f)));
  V r = V::fma(n, V::set1(-0.693359375f), xc);
  r = V::fma(n, V::set1(2.12194440e-4f), r);
  V p = V::set1(1.9875691500e-4f);
  p = V::fma(p, r, V::set1(1.3981999507e-3f));
  p = V::fma(p, r, V::set1(8.3334519073e-3f));
  p = V::fma(p, r, V::set1(4.1665795894e-2f));
  p = V::fma(p, r, V::set1(1.6666665459e-1f));
  p = V::fma(p, r, V::set1(5.0000001201e-1f));
  V y = V::fma(p, V::mul(r, r), r);
  y = V::add(y, V::set1(1.f));
  return V::zero_where_less(x, -87.3365478515625f, V::mul(y, V::pow2i(n)));
}

template <class V>
inline float sexp(float x) {
  float out[16];
  vexp<V>(V::set1(x)).store(out);
  return out[0];
}

// Loads n < 16 floats, filling the other lanes with `fill`.
template <class V>
inline V load_partial(const float* p, int64_t n, float fill) {
  float buf[16];
  for (int i = 0; i < 16; ++i) buf[i] = i < n ? p[i] : fill;
  return V::load(buf);
}

template <class V>
inline void store_partial(const V& a, float* p, int64_t n) {
  float buf[16];
  a.store(buf);
  for (int64_t i = 0; i < n; ++i) p[i] = buf[i];
}

// Sum of x[i]^2 over i < n in the lane-partial + tree order (tail lanes are zero).
template <class V>
inline float sum_squares(const float* x, int64_t n) {
  V acc = V::zero();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    V a = V::load(x + i);
    acc = V::fma(a, a, acc);
  }
  if (i < n) {
    V a = load_partial<V>(x + i, n - i, 0.f);
    acc = V::fma(a, a, acc);
  }
  return acc.reduce_add();
}

enum class Simd : int64_t { kAuto = 0, kAvx2 = 1, kScalar = 2, kAvx512 = 3 };

// Calls fn.template operator()<V>() with the vector type selected by `simd`.
template <class F>
auto dispatch_simd(int64_t simd, const F& fn) {
  switch (static_cast<Simd>(simd)) {
    case Simd::kScalar:
      return fn(VecScalar{});
#if defined(__AVX2__) && defined(__FMA__)
    case Simd::kAvx2:
      return fn(VecAvx2{});
#endif
#if defined(__AVX512F__)
    case Simd::kAvx512:
      return fn(VecAvx512{});
#endif
    case Simd::kAuto:
#if defined(__AVX512F__)
      return fn(VecAvx512{});
#elif defined(__AVX2__) && defined(__FMA__)
      return fn(VecAvx2{});
#else
      return fn(VecScalar{});
#endif
    default:
      break;
  }
  TORCH_CHECK(false, "lockstep: SIMD variant ", simd, " is not compiled in");
  return fn(VecScalar{});
}

std::vector<std::string> simd_variants() {
  std::vector<std::string> names{"scalar"};
#if defined(__AVX2__) && defined(__FMA__)
  names.emplace_back("avx2");
#endif
#if defined(__AVX512F__)
  names.emplace_back("avx512");
#endif
  return names;
}

// ----------------------------------------------------------------------------------------
// linear: out[m, n] = tree(lane partials of x[m, :] * w[n, :]) + bias[n]
// ----------------------------------------------------------------------------------------

constexpr int64_t kTileRows = 4;     // rows sharing each loaded weight vector
constexpr int64_t kTileCols = 4;     // output columns sharing each loaded x vector
constexpr int64_t kRowCols = 16;     // columns per single-row tile (decode, leftover rows)
constexpr int64_t kPanelCols = 48;   // columns per task (a multiple of kRowCols)
constexpr int64_t kChunkRows = 64;   // rows per task (keeps the x chunk in L2)
constexpr int64_t kWidenRows = 32;   // bf16 panels are widened to fp32 from this many rows

template <class V, class W, int R, int C>
inline void linear_tile(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t kp,
                        const float* bias, float* out, int64_t ldo) {
  V acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = V::zero();
  for (int64_t k = 0; k < kp; k += 16) {
    V xv[R];
    for (int r = 0; r < R; ++r) xv[r] = V::load(x + r * ldx + k);
    for (int c = 0; c < C; ++c) {
      const V wv = V::load(w + c * ldw + k);
      for (int r = 0; r < R; ++r) acc[r][c] = V::fma(xv[r], wv, acc[r][c]);
    }
  }
  float sums[R * C];
  if constexpr (R * C == 16) {
    V::reduce16(&acc[0][0], sums);
  } else {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) sums[r * C + c] = acc[r][c].reduce_add();
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = sums[r * C + c];
      if (bias != nullptr) s = s + bias[c];
      out[r * ldo + c] = s;
    }
}

// Output columns [0, nc) of rows [0, nr): w points at the panel's first weight row.
// Tile shape only decides which elements share loads; every tile kernel gives each element
// the same arithmetic.
template <class V, class W>
void linear_panel(const float* x, const W* w, const float* bias, float* out, int64_t nr,
                  int64_t nc, int64_t ldo, int64_t kp) {
  const int64_t block_rows = nr / kTileRows * kTileRows;
  // Blocks of kTileRows rows: each weight tile is loaded once and reused from L1 by every
  // row block, so M=16 does not cost 16x the weight traffic of M=1.
  for (int64_t c0 = 0; c0 < nc; c0 += kTileCols) {
    const int64_t cols = std::min(kTileCols, nc - c0);
    const W* wt = w + c0 * kp;
    const float* bt = bias ? bias + c0 : nullptr;
    for (int64_t r0 = 0; r0 < block_rows; r0 += kTileRows) {
      const float* xt = x + r0 * kp;
      float* ot = out + r0 * ldo + c0;
      if (cols == kTileCols) {
        linear_tile<V, W, kTileRows, kTileCols>(xt, kp, wt, kp, kp, bt, ot, ldo);
      } else {
        for (int64_t c = 0; c < cols; ++c)
          linear_tile<V, W, kTileRows, 1>(xt, kp, wt + c * kp, kp, kp, bt ? bt + c : nullptr,
                                          ot + c, ldo);
      }
    }
  }
  // Leftover rows (all of them when M < 4, e.g. decode): one row by kRowCols columns.
  for (int64_t r = block_rows; r < nr; ++r) {
    for (int64_t c0 = 0; c0 < nc; c0 += kRowCols) {
      const int64_t cols = std::min(kRowCols, nc - c0);
      const W* wt = w + c0 * kp;
      const float* bt = bias ? bias + c0 : nullptr;
      float* ot = out + r * ldo + c0;
      if (cols == kRowCols) {
        linear_tile<V, W, 1, kRowCols>(x + r * kp, kp, wt, kp, kp, bt, ot, ldo);
      } else {
        for (int64_t c = 0; c < cols; ++c)
          linear_tile<V, W, 1, 1>(x + r * kp, kp, wt + c * kp, kp, kp, bt ? bt + c : nullptr,
                                  ot + c, ldo);
      }
    }
  }
}

template <class V, class W>
void linear_impl(const float* x, const W* w, const float* bias, float* out, int64_t m, int64_t n,
                 int64_t kp) {
  const int64_t panels = (n + kPanelCols - 1) / kPanelCols;
  const int64_t chunks = (m + kChunkRows - 1) / kChunkRows;
  parallel_tasks(panels * chunks, [&](int64_t task) {
    // Consecutive tasks share a weight panel (still in L2) and walk down the row chunks.
    const int64_t c_begin = (task / chunks) * kPanelCols;
    const int64_t nc = std::min(n, c_begin + kPanelCols) - c_begin;
    const int64_t r_begin = (task % chunks) * kChunkRows;
    const int64_t nr = std::min(m, r_begin + kChunkRows) - r_begin;
    const float* xt = x + r_begin * kp;
    const float* bt = bias ? bias + c_begin : nullptr;
    float* ot = out + r_begin * n + c_begin;
    if constexpr (std::is_same_v<W, uint16_t>) {
      if (nr >= kWidenRows) {
        // Many rows reuse each weight: widen the bf16 panel to fp32 once (exact) instead of
        // in every row tile.
        thread_local std::vector<float> panel;
        panel.resize(nc * kp);
        for (int64_t i = 0; i < nc * kp; i += 16) V::load(w + c_begin * kp + i).store(&panel[i]);
        linear_panel<V, float>(xt, panel.data(), bt, ot, nr, nc, n, kp);
        return;
      }
    }
    linear_panel<V, W>(xt, w + c_begin * kp, bt, ot, nr, nc, n, kp);
  });
}

// x [M, Kp] fp32 contiguous, w [N, Kp] fp32 or bf16 contiguous, Kp % 16 == 0.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                  int64_t simd) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "lockstep linear: x and w must be 2-D");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous fp32");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  const int64_t m = x.size(0), kp = x.size(1), n = w.size(0);
  TORCH_CHECK(w.size(1) == kp && kp % 16 == 0, "lockstep linear: x is [", m, ", ", kp,
              "], w is [", n, ", ", w.size(1), "]; both need the same K, a multiple of 16");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == n,
                "bias must be contiguous fp32 [N]");
    bp = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  dispatch_simd(simd, [&](auto vec) {
    using V = decltype(vec);
    if (w.scalar_type() == at::kFloat) {
      linear_impl<V, float>(x.data_ptr<float>(), w.data_ptr<float>(), bp, out.data_ptr<float>(),
                            m, n, kp);
    } else {
      TORCH_CHECK(w.scalar_type() == at::kBFloat16, "w must be fp32 or bf16");
      linear_impl<V, uint16_t>(x.data_ptr<float>(),
                               reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), bp,
                               out.data_ptr<float>(), m, n, kp);
    }
    return 0;
  });
  return out;
}

// ----------------------------------------------------------------------------------------
// Row-wise ops: rms_norm / add_rms_norm, gated_act_mul (SiLU, GELU-tanh), log_softmax
// ----------------------------------------------------------------------------------------

// Rows per task for the cheap row-wise ops (only granularity, never arithmetic).
constexpr int64_t kRowGrain = 16;

template <class V>
void rms_row(const float* x, const float* w, float eps, float* out, int64_t h) {
  const float mean = sum_squares<V>(x, h) / static_cast<float>(h);
  const V inv = V::set1(1.f / std::sqrt(mean + eps));
  int64_t i = 0;
  for (; i + 16 <= h; i += 16)
    V::mul(V::mul(V::load(x + i), inv), V::load(w + i)).store(out + i);
  if (i < h) {
    V y = V::mul(V::mul(load_partial<V>(x + i, h - i, 0.f), inv),
                 load_partial<V>(w + i, h - i, 0.f));
    store_partial(y, out + i, h - i);
  }
}

// Returns [rms_norm(x)], or with a residual [rms_norm(x + residual), x + residual].
std::vector<at::Tensor> rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                 const at::Tensor& weight, double eps, int64_t simd) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "rms_norm: x must be contiguous fp32 [M, H]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.numel() == x.size(1),
              "rms_norm: weight must be contiguous fp32 [H]");
  const int64_t m = x.size(0), h = x.size(1);
  at::Tensor out = at::empty_like(x);
  at::Tensor sum;
  const float* xp = x.data_ptr<float>();
  const float* rp = nullptr;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == at::kFloat &&
                    residual->is_contiguous(),
                "add_rms_norm: residual must match x");
    rp = residual->data_ptr<float>();
    sum = at::empty_like(x);
  }
  float* sp = residual.has_value() ? sum.data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  dispatch_simd(simd, [&](auto vec) {
    using V = decltype(vec);
    parallel_tasks((m + kRowGrain - 1) / kRowGrain, [&](int64_t task) {
      const int64_t end = std::min(m, (task + 1) * kRowGrain);
      for (int64_t r = task * kRowGrain; r < end; ++r) {
        const float* row = xp + r * h;
        if (rp != nullptr) {
          for (int64_t i = 0; i < h; ++i) sp[r * h + i] = row[i] + rp[r * h + i];
          row = sp + r * h;
        }
        rms_row<V>(row, wp, feps, op + r * h, h);
      }
    });
    return 0;
  });
  if (residual.has_value()) return {out, sum};
  return {out};
}

template <class V>
inline V silu_mul_vec(const V& g, const V& u) {
  const V e = vexp(V::sub(V::zero(), g));
  return V::mul(V::div(g, V::add(V::set1(1.f), e)), u);
}

// gelu_tanh(g) * u with gelu_tanh(g) = 0.5 g (1 + tanh(u')) = g / (1 + exp(-2u')),
// 2u' = g * (c1 + c2 * g * g), c1 = 2 sqrt(2/pi), c2 = c1 * 0.044715: SiLU's formula with
// exp(-2u') for exp(-g), one sequence of operations per element (no FMA).
template <class V>
inline V gelu_tanh_mul_vec(const V& g, const V& u) {
  const V g2 = V::mul(g, g);
  const V two_u = V::mul(g, V::add(V::set1(1.5957691216057308f),
                                   V::mul(V::set1(0.071354816272922f), g2)));
  const V e = vexp(V::sub(V::zero(), two_u));
  return V::mul(V::div(g, V::add(V::set1(1.f), e)), u);
}

// mode 0: silu(gate) * up; mode 1: gelu_tanh(gate) * up.
at::Tensor gated_act_mul(const at::Tensor& gate_up, int64_t mode, int64_t simd) {
  TORCH_CHECK(mode == 0 || mode == 1, "gated_act_mul: mode must be 0 (silu) or 1 (gelu_tanh)");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat &&
                  gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gated_act_mul: gate_up must be contiguous fp32 [M, 2I]");
  const int64_t m = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({m, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  dispatch_simd(simd, [&](auto vec) {
    using V = decltype(vec);
    parallel_tasks((m + kRowGrain - 1) / kRowGrain, [&](int64_t task) {
      const int64_t end = std::min(m, (task + 1) * kRowGrain);
      for (int64_t r = task * kRowGrain; r < end; ++r) {
        const float* g = gp + r * 2 * inter;
        const float* u = g + inter;
        float* o = op + r * inter;
        int64_t i = 0;
        auto act = [mode](const V& gv, const V& uv) {
          return mode == 0 ? silu_mul_vec(gv, uv) : gelu_tanh_mul_vec(gv, uv);
        };
        for (; i + 16 <= inter; i += 16) act(V::load(g + i), V::load(u + i)).store(o + i);
        if (i < inter) {
          const int64_t n = inter - i;
          const V gv = load_partial<V>(g + i, n, 0.f), uv = load_partial<V>(u + i, n, 0.f);
          store_partial(act(gv, uv), o + i, n);
        }
      }
    });
    return 0;
  });
  return out;
}

// softcap: cap * tanh(x / cap) as cap * (1 - 2 / (exp(2x / cap) + 1)), one sequence of
// operations per element (vexp saturates, so the tails give exactly -cap and cap).
at::Tensor softcap(const at::Tensor& x, double cap, int64_t simd) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "softcap: x must be contiguous fp32");
  TORCH_CHECK(cap > 0, "softcap: cap=", cap, " must be > 0");
  at::Tensor out = at::empty_like(x);
  const int64_t n = x.numel();
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float fcap = static_cast<float>(cap), two_over_cap = 2.f / fcap;
  constexpr int64_t kGrain = 4096;
  dispatch_simd(simd, [&](auto vec) {
    using V = decltype(vec);
    auto one = [&](const V& v) {
      const V e = vexp(V::mul(v, V::set1(two_over_cap)));
      const V t = V::sub(V::set1(1.f), V::div(V::set1(2.f), V::add(e, V::set1(1.f))));
      return V::mul(t, V::set1(fcap));
    };
    parallel_tasks((n + kGrain - 1) / kGrain, [&](int64_t task) {
      const int64_t end = std::min(n, (task + 1) * kGrain);
      int64_t i = task * kGrain;
      for (; i + 16 <= end; i += 16) one(V::load(xp + i)).store(op + i);
      if (i < end) store_partial(one(load_partial<V>(xp + i, end - i, 0.f)), op + i, end - i);
    });
    return 0;
  });
  return out;
}

at::Tensor log_softmax(const at::Tensor& logits, int64_t simd) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "log_softmax: logits must be contiguous fp32 [R, V]");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  at::Tensor out = at::empty_like(logits);
  const float* lp = logits.data_ptr<float>();
  float* op = out.data_ptr<float>();
  dispatch_simd(simd, [&](auto vec) {
    using V = decltype(vec);
    parallel_tasks(rows, [&](int64_t r) {
      const float* x = lp + r * vocab;
      float* o = op + r * vocab;
      const int64_t full = vocab / 16 * 16;
      V mx = V::set1(-kInf);
      for (int64_t i = 0; i < full; i += 16) mx = V::max(mx, V::load(x + i));
      if (full < vocab) mx = V::max(mx, load_partial<V>(x + full, vocab - full, -kInf));
      const float row_max = mx.reduce_max();
      const V vmax = V::set1(row_max);
      V acc = V::zero();
      for (int64_t i = 0; i < full; i += 16) acc = V::add(acc, vexp(V::sub(V::load(x + i), vmax)));
      if (full < vocab)
        acc = V::add(acc, vexp(V::sub(load_partial<V>(x + full, vocab - full, -kInf), vmax)));
      const V vlog = V::set1(std::log(acc.reduce_add()));
      for (int64_t i = 0; i < full; i += 16)
        V::sub(V::sub(V::load(x + i), vmax), vlog).store(o + i);
      if (full < vocab)
        store_partial(V::sub(V::sub(load_partial<V>(x + full, vocab - full, 0.f), vmax), vlog),
                      o + full, vocab - full);
    });
    return 0;
  });
  return out;
}

// ----------------------------------------------------------------------------------------
// moe_route: each token's top-k experts and their weights from fp32 router logits [T, E]
//   experts: k passes, each taking the largest logit not yet taken; a strict > keeps the
//            first (lowest) id among equal logits. Rank order: the largest first.
//   e_r    = exp(l_{id_r} - l_{id_0})                    (vexp, the same for every lane)
//   renormalize:  s = (((0 + e_0) + e_1) + ...) + e_{k-1}           (ascending rank)
//   otherwise:    s = sum over all E experts of exp(l_j - l_{id_0})  (lane-partial + tree)
//   weight_r = e_r / s
// A row's bits depend only on its own logits.
// ----------------------------------------------------------------------------------------

std::vector<at::Tensor> moe_route(const at::Tensor& logits, int64_t top_k, bool renormalize,
                                  int64_t simd) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "moe_route: logits must be contiguous fp32 [T, E]");
  const int64_t rows = logits.size(0), experts = logits.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "moe_route: top_k=", top_k,
              " must be between 1 and the number of experts, ", experts);
  at::Tensor ids = at::empty({rows, top_k}, logits.options().dtype(at::kLong));
  at::Tensor weights = at::empty({rows, top_k}, logits.options());
  const float* lp = logits.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* wp = weights.data_ptr<float>();
  const int64_t k_padded = (top_k + 15) / 16 * 16;
  dispatch_simd(simd, [&](auto vec) {
    using V = decltype(vec);
    parallel_tasks((rows + kRowGrain - 1) / kRowGrain, [&](int64_t task) {
      std::vector<char> taken(experts);
      std::vector<float> chosen(k_padded), e(k_padded);
      const int64_t end = std::min(rows, (task + 1) * kRowGrain);
      for (int64_t r = task * kRowGrain; r < end; ++r) {
        const float* x = lp + r * experts;
        int64_t* id = ip + r * top_k;
        std::fill(taken.begin(), taken.end(), 0);
        for (int64_t rank = 0; rank < top_k; ++rank) {
          int64_t best = -1;
          for (int64_t j = 0; j < experts; ++j)
            if (!taken[j] && (best < 0 || x[j] > x[best])) best = j;
          taken[best] = 1;
          id[rank] = best;
          chosen[rank] = x[best];
        }
        const V vtop = V::set1(chosen[0]);
        for (int64_t i = 0; i < top_k; i += 16)
          vexp(V::sub(load_partial<V>(&chosen[i], std::min<int64_t>(16, top_k - i), -kInf), vtop))
              .store(&e[i]);
        float s = 0.f;
        if (renormalize) {
          for (int64_t rank = 0; rank < top_k; ++rank) s = s + e[rank];
        } else {
          const int64_t full = experts / 16 * 16;
          V acc = V::zero();
          for (int64_t i = 0; i < full; i += 16)
            acc = V::add(acc, vexp(V::sub(V::load(x + i), vtop)));
          if (full < experts)
            acc = V::add(acc, vexp(V::sub(load_partial<V>(x + full, experts - full, -kInf), vtop)));
          s = acc.reduce_add();
        }
        for (int64_t rank = 0; rank < top_k; ++rank) wp[r * top_k + rank] = e[rank] / s;
      }
    });
    return 0;
  });
  return {ids, weights};
}

// ----------------------------------------------------------------------------------------
// rope (neox / rotate_half): separate multiplies and adds per element, no FMA
// ----------------------------------------------------------------------------------------

at::Tensor rope(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "rope: x must be contiguous fp32 [T, H, D]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "rope: positions must be int64");
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && cos.size(1) == half &&
                  sin.sizes() == cos.sizes() && sin.is_contiguous(),
              "rope: cos/sin must be contiguous fp32 [max_position, D/2]");
  const int64_t max_pos = cos.size(0);
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(pp[i] >= 0 && pp[i] < max_pos, "rope: position ", pp[i], " outside [0, ",
                max_pos, ")");
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_tasks((t + kRowGrain - 1) / kRowGrain, [&](int64_t task) {
    const int64_t end = std::min(t, (task + 1) * kRowGrain);
    for (int64_t i = task * kRowGrain; i < end; ++i) {
      const float* c = cp + pp[i] * half;
      const float* s = sp + pp[i] * half;
      for (int64_t h = 0; h < heads; ++h) {
        const float* a = xp + (i * heads + h) * d;
        float* o = op + (i * heads + h) * d;
        for (int64_t j = 0; j < half; ++j) {
          const float x1 = a[j], x2 = a[j + half];
          const float p1 = x1 * c[j], p2 = x2 * s[j], p3 = x2 * c[j], p4 = x1 * s[j];
          o[j] = p1 - p2;
          o[j + half] = p3 + p4;
        }
      }
    }
  });
  return out;
}

// ----------------------------------------------------------------------------------------
// attention: causal, paged (token-granular slots), GQA, online softmax over key blocks at
// absolute positions 0, B, 2B, ...
//
//   for each query row (position p) and head, for each block j0 = 0, B, ... <= p:
//     s[j]  = (sum_d q[d]*k_j[d], ascending d, FMA from 0) * scale     keys j0..min(p, j0+B-1)
//     m'    = max(m, max_j s[j]);  a = exp(m - m')
//     e[j]  = exp(s[j] - m')                   (masked keys: exp(-inf) = 0)
//     l     = l*a + tree_sum(e);  acc[d] = acc[d]*a, then acc[d] += e[j]*v_j[d] for j ascending
//   out = acc / l
// A row's bits depend on q and keys 0..p only. Work is tiled as (sequence, kv head, row tile)
// so that one gathered key block serves every query row and head of the GQA group; the tile
// decides only who shares loads.
//
// Sliding window W (> 0): the row at p sees keys lo = max(0, p - W + 1) .. p. Its blocks are
// those from floor(lo / B) * B on, the same for every tile holding the row; blocks wholly
// below lo are skipped (the pair counts as padding there), and in the first block keys below
// lo score -inf like the causally masked ones (e = 0; the PV update still runs over them, in
// every path, so the sequence of operations depends on p and W only).
// ----------------------------------------------------------------------------------------

constexpr int64_t kAttnRowTile = 16;

struct AttnTask {
  int64_t seq, row0, rows, kv_head, head0, heads;
};

template <class T>
inline void to_f32(const T* src, float* dst, int64_t n);
template <>
inline void to_f32<float>(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}
template <>
inline void to_f32<at::BFloat16>(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits = static_cast<uint32_t>(s[i]) << 16;
    std::memcpy(dst + i, &bits, 4);
  }
}

// Query (row, head) pairs whose scores are computed together (independent FMA chains).
constexpr int64_t kPairGroup = 4;

// acc[c] = acc[c]*alpha, then acc[c] += e[j]*v_j[c] for j < n, ascending: the one sequence of
// operations every output lane goes through, whether pairs are processed alone or together.
template <class V, int DV, int G>
inline void pv_update(float* const* acc, const float* const* e, const float* alpha,
                      const float* vb, int64_t n, int64_t d) {
  V a[G][DV];
  for (int g = 0; g < G; ++g) {
    const V va = V::set1(alpha[g]);
    for (int c = 0; c < DV; ++c) a[g][c] = V::mul(V::load(acc[g] + c * 16), va);
  }
  for (int64_t j = 0; j < n; ++j) {
    V v[DV];
    for (int c = 0; c < DV; ++c) v[c] = V::load(vb + j * d + c * 16);
    for (int g = 0; g < G; ++g) {
      const V ej = V::set1(e[g][j]);
      for (int c = 0; c < DV; ++c) a[g][c] = V::fma(ej, v[c], a[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DV; ++c) a[g][c].store(acc[g] + c * 16);
}

template <class V, class KV, int NV, int DV>
void attention_impl(const float* q, const KV* kc, const KV* vc, const int32_t* cu_q,
                    const int32_t* q_start, const int32_t* cu_kv, const int32_t* slots,
                    int64_t num_seqs, int64_t hq, int64_t hkv, float scale, int64_t window,
                    float* out) {
  constexpr int64_t kBlock = NV * 16, d = DV * 16;
  // Pairs whose PV update shares each loaded value row (bounded by the vector registers).
  constexpr int kPvGroup = DV <= 4 ? 4 : 2;
  const int64_t group = hq / hkv;
  std::vector<AttnTask> tasks;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t n = cu_q[b + 1] - cu_q[b];
    // Latest (most expensive) tiles first so dynamic scheduling balances the causal triangle.
    for (int64_t r0 = ((n - 1) / kAttnRowTile) * kAttnRowTile; r0 >= 0; r0 -= kAttnRowTile)
      for (int64_t g = 0; g < hkv; ++g)
        tasks.push_back({b, r0, std::min(kAttnRowTile, n - r0), g, g * group, group});
  }
  // Too few tasks to keep the threads busy (small-batch decode): one task per query head.
  if (static_cast<int64_t>(tasks.size()) < 4 * at::get_num_threads() && group > 1) {
    std::vector<AttnTask> split;
    for (const AttnTask& t : tasks)
      for (int64_t h = 0; h < group; ++h)
        split.push_back({t.seq, t.row0, t.rows, t.kv_head, t.head0 + h, 1});
    tasks.swap(split);
  }
  parallel_tasks(static_cast<int64_t>(tasks.size()), [&](int64_t ti) {
    const AttnTask& t = tasks[ti];
    const int64_t pairs = t.rows * t.heads;
    // Pair arrays are padded by one group of inert pairs (position -1, never updated) so a
    // score group can always run full width. Workspace is bounded by the tile size, never by
    // the context length.
    const int64_t padded = pairs + kPairGroup;
    std::vector<float> kt(d * kBlock), vb(kBlock * d), acc(padded * d, 0.f);
    std::vector<float> sc(padded * kBlock), m_run(padded, -kInf), l_run(padded, 0.f);
    std::vector<int64_t> pos(padded, -1);
    std::vector<const float*> qrow(padded);
    for (int64_t r = 0; r < t.rows; ++r)
      for (int64_t h = 0; h < t.heads; ++h) {
        const int64_t p = r * t.heads + h;
        pos[p] = q_start[t.seq] + t.row0 + r;
        qrow[p] = q + ((cu_q[t.seq] + t.row0 + r) * hq + t.head0 + h) * d;
      }
    for (int64_t p = pairs; p < padded; ++p) qrow[p] = qrow[0];
    const int32_t* table = slots + cu_kv[t.seq];
    const int64_t last = pos[pairs - 1];
    // First key each pair sees (0 without a window); padding pairs see none.
    std::vector<int64_t> key_lo(padded, 0);
    if (window > 0)
      for (int64_t p = 0; p < pairs; ++p) key_lo[p] = std::max<int64_t>(0, pos[p] - window + 1);
    float kbuf[d];
    int64_t first_active = 0;  // pairs are sorted by position
    for (int64_t j0 = key_lo[0] / kBlock * kBlock; j0 <= last; j0 += kBlock) {
      const int64_t nk = std::min(kBlock, last + 1 - j0);
      for (int64_t j = 0; j < kBlock; ++j) {
        if (j < nk) {
          const int64_t slot = table[j0 + j];
          to_f32(kc + (slot * hkv + t.kv_head) * d, kbuf, d);
          to_f32(vc + (slot * hkv + t.kv_head) * d, vb.data() + j * d, d);
          for (int64_t e = 0; e < d; ++e) kt[e * kBlock + j] = kbuf[e];
        } else {
          for (int64_t e = 0; e < d; ++e) kt[e * kBlock + j] = 0.f;
        }
      }
      while (pos[first_active] < j0) ++first_active;
      for (int64_t p0 = first_active; p0 < pairs; p0 += kPairGroup) {
        // Raw scores s[g][j] = sum_e q[e]*k_j[e], ascending e, for kPairGroup pairs at once.
        V s[kPairGroup][NV];
        for (int g = 0; g < kPairGroup; ++g)
          for (int i = 0; i < NV; ++i) s[g][i] = V::zero();
        for (int64_t e = 0; e < d; ++e) {
          V kv[NV];
          for (int i = 0; i < NV; ++i) kv[i] = V::load(kt.data() + e * kBlock + i * 16);
          for (int g = 0; g < kPairGroup; ++g) {
            const V qe = V::set1(qrow[p0 + g][e]);
            for (int i = 0; i < NV; ++i) s[g][i] = V::fma(qe, kv[i], s[g][i]);
          }
        }
        const V vscale = V::set1(scale);
        int64_t valid[kPairGroup];
        float alpha[kPairGroup];
        float* accp[kPairGroup];
        const float* ep[kPairGroup];
        bool full = true;
        for (int g = 0; g < kPairGroup; ++g) {
          const int64_t p = p0 + g;
          // Blocks wholly below the pair's window count as padding for it.
          const bool seen = pos[p] >= j0 && key_lo[p] < j0 + kBlock;
          valid[g] = seen ? std::min(kBlock, pos[p] - j0 + 1) : 0;
          accp[g] = acc.data() + p * d;
          float* sp = sc.data() + p * kBlock;
          ep[g] = sp;
          alpha[g] = 1.f;
          full = full && valid[g] == kBlock;
          if (valid[g] == 0) continue;  // padding pair
          for (int i = 0; i < NV; ++i) V::mul(s[g][i], vscale).store(sp + i * 16);
          for (int64_t j = valid[g]; j < kBlock; ++j) sp[j] = -kInf;
          for (int64_t j = 0; j < key_lo[p] - j0; ++j) sp[j] = -kInf;
          V mx = V::load(sp);
          for (int i = 1; i < NV; ++i) mx = V::max(mx, V::load(sp + i * 16));
          const float bmax = mx.reduce_max();
          const float m_old = m_run[p];
          const float m_new = m_old > bmax ? m_old : bmax;
          alpha[g] = sexp<V>(m_old - m_new);
          const V vm = V::set1(m_new);
          V bsum = V::zero();
          for (int i = 0; i < NV; ++i) {
            const V ex = vexp(V::sub(V::load(sp + i * 16), vm));
            ex.store(sp + i * 16);
            bsum = V::add(bsum, ex);
          }
          l_run[p] = l_run[p] * alpha[g] + bsum.reduce_add();
          m_run[p] = m_new;
        }
        if (full) {
          for (int g = 0; g < kPairGroup; g += kPvGroup)
            pv_update<V, DV, kPvGroup>(accp + g, ep + g, alpha + g, vb.data(), kBlock, d);
        } else {
          for (int g = 0; g < kPairGroup; ++g)
            if (valid[g] > 0)
              pv_update<V, DV, 1>(accp + g, ep + g, alpha + g, vb.data(), valid[g], d);
        }
      }
    }
    for (int64_t p = 0; p < pairs; ++p) {
      const V vl = V::set1(l_run[p]);
      const int64_t row = cu_q[t.seq] + t.row0 + p / t.heads;
      float* o = out + (row * hq + t.head0 + p % t.heads) * d;
      for (int64_t c = 0; c < DV; ++c)
        V::div(V::load(acc.data() + p * d + c * 16), vl).store(o + c * 16);
    }
  });
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& cu_q, const at::Tensor& q_start, const at::Tensor& cu_kv,
                     const at::Tensor& slot_table, double scale, int64_t key_block,
                     int64_t window, int64_t simd) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "attention: q must be contiguous fp32 [T, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == v_cache.scalar_type() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "attention: k_cache and v_cache must be contiguous [S, Hkv, D] of one dtype");
  const int64_t hq = q.size(1), d = q.size(2), hkv = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == d && (d == 32 || d == 64 || d == 128),
              "attention: head_dim must be 32, 64 or 128 (and match the cache), got ", d);
  TORCH_CHECK(key_block == 16 || key_block == 32, "attention: key_block=", key_block,
              " must be 16 or 32");
  TORCH_CHECK(hq % hkv == 0, "attention: Hq=", hq, " is not a multiple of Hkv=", hkv);
  TORCH_CHECK(window >= 0, "attention: window=", window, " must be >= 0 (0: no window)");
  for (const at::Tensor* t : {&cu_q, &q_start, &cu_kv, &slot_table})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(),
                "attention: metadata tensors must be contiguous int32");
  const int64_t num_seqs = q_start.size(0);
  TORCH_CHECK(cu_q.size(0) == num_seqs + 1 && cu_kv.size(0) == num_seqs + 1,
              "attention: cu_q / cu_kv must have B+1 entries");
  const int32_t* cq = cu_q.data_ptr<int32_t>();
  const int32_t* qs = q_start.data_ptr<int32_t>();
  const int32_t* ck = cu_kv.data_ptr<int32_t>();
  const int32_t* st = slot_table.data_ptr<int32_t>();
  TORCH_CHECK(cq[num_seqs] == q.size(0), "attention: cu_q[B]=", cq[num_seqs], " but q has ",
              q.size(0), " rows");
  TORCH_CHECK(cq[0] == 0 && ck[0] == 0 && ck[num_seqs] <= slot_table.size(0),
              "attention: cu_q / cu_kv must start at 0 and cu_kv[B] must not exceed the ",
              slot_table.size(0), " slot table entries");
  const int64_t num_slots = k_cache.size(0);
  for (int64_t b = 0; b < num_seqs; ++b) {
    TORCH_CHECK(cq[b + 1] >= cq[b] && ck[b + 1] >= ck[b],
                "attention: cu_q / cu_kv must be non-decreasing (sequence ", b, ")");
    const int64_t kv_len = qs[b] + cq[b + 1] - cq[b];
    TORCH_CHECK(qs[b] >= 0 && ck[b + 1] - ck[b] >= kv_len,
                "attention: sequence ", b, " has fewer slots than keys");
    for (int64_t j = 0; j < kv_len; ++j)
      TORCH_CHECK(st[ck[b] + j] >= 0 && st[ck[b] + j] < num_slots, "attention: slot ",
                  st[ck[b] + j], " outside the cache");
  }
  at::Tensor out = at::empty_like(q);
  if (q.size(0) == 0) return out;
  const float fscale = static_cast<float>(scale);
  dispatch_simd(simd, [&](auto vec) {
    using V = decltype(vec);
    auto run = [&](auto nv_tag, auto dv_tag) {
      constexpr int NV = decltype(nv_tag)::value, DV = decltype(dv_tag)::value;
      if (k_cache.scalar_type() == at::kFloat) {
        attention_impl<V, float, NV, DV>(q.data_ptr<float>(), k_cache.data_ptr<float>(),
                                         v_cache.data_ptr<float>(), cq, qs, ck, st, num_seqs, hq,
                                         hkv, fscale, window, out.data_ptr<float>());
      } else {
        TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16, "attention: cache must be fp32/bf16");
        attention_impl<V, at::BFloat16, NV, DV>(
            q.data_ptr<float>(), k_cache.data_ptr<at::BFloat16>(),
            v_cache.data_ptr<at::BFloat16>(), cq, qs, ck, st, num_seqs, hq, hkv, fscale, window,
            out.data_ptr<float>());
      }
    };
    using Nv1 = std::integral_constant<int, 1>;
    using Nv2 = std::integral_constant<int, 2>;
    using Dv2 = std::integral_constant<int, 2>;
    using Dv4 = std::integral_constant<int, 4>;
    using Dv8 = std::integral_constant<int, 8>;
    if (d == 32) {
      key_block == 16 ? run(Nv1{}, Dv2{}) : run(Nv2{}, Dv2{});
    } else if (d == 64) {
      key_block == 16 ? run(Nv1{}, Dv4{}) : run(Nv2{}, Dv4{});
    } else {
      key_block == 16 ? run(Nv1{}, Dv8{}) : run(Nv2{}, Dv8{});
    }
    return 0;
  });
  return out;
}

// ----------------------------------------------------------------------------------------
// latent_attention: MLA in the absorbed form (DeepSeek-V2/V3), causal and paged. One latent
// "head" per token: cache rows [S, Dk] hold c (the normalized KV latent, the first Dv
// columns) then the rotated RoPE key; a token's key is its whole row and its value the first
// Dv columns of the same row. Every query head attends over the same rows:
//
//   for each query row (position p) and head, for each block j0 = 0, B, ... <= p (B = 32):
//     s[j]  = (sum_e q[e]*row_j[e], ascending e < Dk, FMA from 0) * scale
//     m'    = max(m, max_j s[j]);  a = exp(m - m')
//     e[j]  = exp(s[j] - m')                   (keys past p: exp(-inf) = 0)
//     l     = l*a + tree_sum(e);  acc[c] = acc[c]*a, then acc[c] += e[j]*row_j[c] for
//             j ascending up to p (c < Dv)
//   out = acc / l
//
// the same sequence of operations as `attention`, with keys and values of different widths.
// A row's bits depend on q and rows 0..p only: work is tiled as (sequence, 16 query rows, up
// to 16 heads), and the tile decides only who shares the gathered block. Workspace is a few
// tile-sized buffers per task, never proportional to the context.
// ----------------------------------------------------------------------------------------

constexpr int64_t kLatentBlock = 32;
constexpr int64_t kLatentHeadTile = 16;

template <class V, class KV>
void latent_attention_impl(const float* q, const KV* cache, const int32_t* cu_q,
                           const int32_t* q_start, const int32_t* cu_kv, const int32_t* slots,
                           int64_t num_seqs, int64_t hq, int64_t dk, int64_t dv, float scale,
                           float* out) {
  constexpr int64_t kBlock = kLatentBlock, NV = kBlock / 16;
  std::vector<AttnTask> tasks;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t n = cu_q[b + 1] - cu_q[b];
    for (int64_t r0 = ((n - 1) / kAttnRowTile) * kAttnRowTile; r0 >= 0; r0 -= kAttnRowTile)
      for (int64_t h0 = 0; h0 < hq; h0 += kLatentHeadTile)
        tasks.push_back({b, r0, std::min(kAttnRowTile, n - r0), 0, h0,
                         std::min(kLatentHeadTile, hq - h0)});
  }
  parallel_tasks(static_cast<int64_t>(tasks.size()), [&](int64_t ti) {
    const AttnTask& t = tasks[ti];
    const int64_t pairs = t.rows * t.heads;
    const int64_t padded = pairs + kPairGroup;  // inert pairs so score groups run full width
    std::vector<float> kt(dk * kBlock), rows(kBlock * dk), acc(padded * dv, 0.f);
    std::vector<float> sc(padded * kBlock), m_run(padded, -kInf), l_run(padded, 0.f);
    std::vector<int64_t> pos(padded, -1);
    std::vector<const float*> qrow(padded);
    for (int64_t r = 0; r < t.rows; ++r)
      for (int64_t h = 0; h < t.heads; ++h) {
        const int64_t p = r * t.heads + h;
        pos[p] = q_start[t.seq] + t.row0 + r;
        qrow[p] = q + ((cu_q[t.seq] + t.row0 + r) * hq + t.head0 + h) * dk;
      }
    for (int64_t p = pairs; p < padded; ++p) qrow[p] = qrow[0];
    const int32_t* table = slots + cu_kv[t.seq];
    const int64_t last = pos[pairs - 1];
    int64_t first_active = 0;
    for (int64_t j0 = 0; j0 <= last; j0 += kBlock) {
      const int64_t nk = std::min(kBlock, last + 1 - j0);
      for (int64_t j = 0; j < kBlock; ++j) {
        float* row = rows.data() + j * dk;
        if (j < nk) {
          to_f32(cache + static_cast<int64_t>(table[j0 + j]) * dk, row, dk);
        } else {
          std::fill(row, row + dk, 0.f);
        }
        for (int64_t e = 0; e < dk; ++e) kt[e * kBlock + j] = row[e];
      }
      while (pos[first_active] < j0) ++first_active;
      for (int64_t p0 = first_active; p0 < pairs; p0 += kPairGroup) {
        V s[kPairGroup][NV];
        for (int g = 0; g < kPairGroup; ++g)
          for (int i = 0; i < NV; ++i) s[g][i] = V::zero();
        for (int64_t e = 0; e < dk; ++e) {
          V kv[NV];
          for (int i = 0; i < NV; ++i) kv[i] = V::load(kt.data() + e * kBlock + i * 16);
          for (int g = 0; g < kPairGroup; ++g) {
            const V qe = V::set1(qrow[p0 + g][e]);
            for (int i = 0; i < NV; ++i) s[g][i] = V::fma(qe, kv[i], s[g][i]);
          }
        }
        const V vscale = V::set1(scale);
        for (int g = 0; g < kPairGroup; ++g) {
          const int64_t p = p0 + g;
          if (p >= pairs || pos[p] < j0) continue;  // padding pair, or a block in its future
          const int64_t valid = std::min(kBlock, pos[p] - j0 + 1);
          float* sp = sc.data() + p * kBlock;
          for (int i = 0; i < NV; ++i) V::mul(s[g][i], vscale).store(sp + i * 16);
          for (int64_t j = valid; j < kBlock; ++j) sp[j] = -kInf;
          V mx = V::load(sp);
          for (int i = 1; i < NV; ++i) mx = V::max(mx, V::load(sp + i * 16));
          const float bmax = mx.reduce_max();
          const float m_old = m_run[p];
          const float m_new = m_old > bmax ? m_old : bmax;
          const float alpha = sexp<V>(m_old - m_new);
          const V vm = V::set1(m_new);
          V bsum = V::zero();
          for (int i = 0; i < NV; ++i) {
            const V ex = vexp(V::sub(V::load(sp + i * 16), vm));
            ex.store(sp + i * 16);
            bsum = V::add(bsum, ex);
          }
          l_run[p] = l_run[p] * alpha + bsum.reduce_add();
          m_run[p] = m_new;
          // acc[c] = acc[c]*alpha, then += e[j]*value_j[c] for j ascending; column chunks of
          // 16 lanes are independent, so chunking changes no element's operations.
          float* a = acc.data() + p * dv;
          const V va = V::set1(alpha);
          for (int64_t c = 0; c < dv; c += 16) {
            V x = V::mul(V::load(a + c), va);
            for (int64_t j = 0; j < valid; ++j)
              x = V::fma(V::set1(sp[j]), V::load(rows.data() + j * dk + c), x);
            x.store(a + c);
          }
        }
      }
    }
    for (int64_t p = 0; p < pairs; ++p) {
      const V vl = V::set1(l_run[p]);
      const int64_t row = cu_q[t.seq] + t.row0 + p / t.heads;
      float* o = out + (row * hq + t.head0 + p % t.heads) * dv;
      for (int64_t c = 0; c < dv; c += 16)
        V::div(V::load(acc.data() + p * dv + c), vl).store(o + c);
    }
  });
}

at::Tensor latent_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& cu_q,
                            const at::Tensor& q_start, const at::Tensor& cu_kv,
                            const at::Tensor& slot_table, double scale, int64_t value_dim,
                            int64_t simd) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "latent_attention: q must be contiguous fp32 [T, H, Dk]");
  const int64_t hq = q.size(1), dk = q.size(2), dv = value_dim;
  TORCH_CHECK(cache.dim() == 2 && cache.size(1) == dk && cache.is_contiguous(),
              "latent_attention: the cache must be contiguous [S, Dk] with q's Dk=", dk);
  TORCH_CHECK(dk % 16 == 0 && dv % 16 == 0 && dv >= 16 && dv <= dk,
              "latent_attention: key width ", dk, " and value width ", dv,
              " must be multiples of 16 with the value width at most the key width");
  for (const at::Tensor* t : {&cu_q, &q_start, &cu_kv, &slot_table})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(),
                "latent_attention: metadata tensors must be contiguous int32");
  const int64_t num_seqs = q_start.size(0);
  TORCH_CHECK(cu_q.size(0) == num_seqs + 1 && cu_kv.size(0) == num_seqs + 1,
              "latent_attention: cu_q / cu_kv must have B+1 entries");
  const int32_t* cq = cu_q.data_ptr<int32_t>();
  const int32_t* qs = q_start.data_ptr<int32_t>();
  const int32_t* ck = cu_kv.data_ptr<int32_t>();
  const int32_t* st = slot_table.data_ptr<int32_t>();
  TORCH_CHECK(cq[0] == 0 && cq[num_seqs] == q.size(0) && ck[0] == 0 &&
                  ck[num_seqs] <= slot_table.size(0),
              "latent_attention: cu_q must run from 0 to the ", q.size(0),
              " query rows and cu_kv from 0 within the slot table");
  const int64_t num_slots = cache.size(0);
  for (int64_t b = 0; b < num_seqs; ++b) {
    TORCH_CHECK(cq[b + 1] >= cq[b] && ck[b + 1] >= ck[b],
                "latent_attention: cu_q / cu_kv must be non-decreasing (sequence ", b, ")");
    const int64_t kv_len = qs[b] + cq[b + 1] - cq[b];
    TORCH_CHECK(qs[b] >= 0 && ck[b + 1] - ck[b] >= kv_len,
                "latent_attention: sequence ", b, " has fewer slots than keys");
    for (int64_t j = 0; j < kv_len; ++j)
      TORCH_CHECK(st[ck[b] + j] >= 0 && st[ck[b] + j] < num_slots, "latent_attention: slot ",
                  st[ck[b] + j], " outside the cache");
  }
  at::Tensor out = at::empty({q.size(0), hq, dv}, q.options());
  if (q.size(0) == 0) return out;
  const float fscale = static_cast<float>(scale);
  dispatch_simd(simd, [&](auto vec) {
    using V = decltype(vec);
    if (cache.scalar_type() == at::kFloat) {
      latent_attention_impl<V, float>(q.data_ptr<float>(), cache.data_ptr<float>(), cq, qs, ck,
                                      st, num_seqs, hq, dk, dv, fscale, out.data_ptr<float>());
    } else {
      TORCH_CHECK(cache.scalar_type() == at::kBFloat16,
                  "latent_attention: the cache must be fp32 or bf16");
      latent_attention_impl<V, at::BFloat16>(q.data_ptr<float>(),
                                             cache.data_ptr<at::BFloat16>(), cq, qs, ck, st,
                                             num_seqs, hq, dk, dv, fscale, out.data_ptr<float>());
    }
    return 0;
  });
  return out;
}

// ----------------------------------------------------------------------------------------
// sampling noise: bit for bit lockstep.engine.sampler.gumbel_noise_reference (float64 basic
// operations in the same sequence; frexp by bit fields so that the column loop vectorizes)
// ----------------------------------------------------------------------------------------

constexpr int kLogTerms = 30;
constexpr uint64_t kMask32 = 0xFFFFFFFFULL;
constexpr int64_t kSamplerTask = 4096;  // elements (columns of a row) per task
constexpr int64_t kNoiseBlock = 256;  // columns per vectorized pass

// The reference's 32-bit mixer (x < 2**32); the reference's int64 values are the same bits.
inline uint64_t hash32(uint64_t x) {
  x = ((x >> 16) ^ x) * 0x45D9F3BULL & kMask32;
  x = ((x >> 16) ^ x) * 0x45D9F3BULL & kMask32;
  return (x >> 16) ^ x;
}

// x[i] = log(x[i]), x >= 0: x = m 2^e with m in [0.5, 1), frexp(+-0) = (+-0, 0) as torch's,
// z = (m-1)/(m+1), then 2 z sum(z^2i / (2i+1)) + e ln2, the series in Horner order with
// coef[] from 1/59 to 1. frexp by bit fields and selects, no branches, so that the loop
// vectorizes (the unrolled series is the same operations).
inline void basic_log(double* x, int64_t n, const double* coef, double ln2) {
  for (int64_t i = 0; i < n; ++i) {
    const double xv = x[i];
    uint64_t bits;
    std::memcpy(&bits, &xv, sizeof bits);
    const uint64_t zero = uint64_t{0} - static_cast<uint64_t>(xv == 0.0);  // all ones if zero
    const int64_t e =
        (static_cast<int64_t>((bits >> 52) & 0x7FF) - 1022) & ~static_cast<int64_t>(zero);
    const uint64_t mbits =
        (((bits & 0xFFFFFFFFFFFFFULL) | 0x3FE0000000000000ULL) & ~zero) | (bits & zero);
    double m;
    std::memcpy(&m, &mbits, sizeof m);
    const double z = (m - 1.0) / (m + 1.0);
    const double z2 = z * z;
    double total = 0.0;
#pragma GCC unroll 30
    for (int k = 0; k < kLogTerms; ++k) total = total * z2 + coef[k];
    x[i] = 2.0 * z * total + static_cast<double>(e) * ln2;
  }
}

at::Tensor gumbel_noise(const at::Tensor& seeds, const at::Tensor& positions, int64_t n) {
  TORCH_CHECK(seeds.dim() == 1 && seeds.scalar_type() == at::kLong && positions.sizes() ==
                  seeds.sizes() && positions.scalar_type() == at::kLong,
              "gumbel_noise: seeds and positions must be int64 [R]");
  const at::Tensor sd = seeds.contiguous(), ps = positions.contiguous();
  const int64_t rows = sd.size(0);
  at::Tensor out = at::empty({rows, n}, sd.options().dtype(at::kDouble));
  double coef[kLogTerms];
  for (int i = 0; i < kLogTerms; ++i) coef[i] = 1.0 / (2 * (kLogTerms - 1 - i) + 1);
  const double ln2 = 0.6931471805599453;
  const int64_t* seed_p = sd.data_ptr<int64_t>();
  const int64_t* pos_p = ps.data_ptr<int64_t>();
  double* op = out.data_ptr<double>();
  const int64_t chunks = (n + kSamplerTask - 1) / kSamplerTask;
  parallel_tasks(rows * chunks, [&](int64_t task) {
    const int64_t r = task / chunks, lo = task % chunks * kSamplerTask;
    const int64_t hi = std::min(n, lo + kSamplerTask);
    const uint64_t seed = static_cast<uint64_t>(seed_p[r]);
    uint64_t key = hash32(static_cast<uint64_t>(pos_p[r]) & kMask32);
    key = hash32(key ^ ((seed >> 32) & kMask32));
    key = hash32(key ^ (seed & kMask32));
    double* o = op + r * n;
    alignas(64) double buf[kNoiseBlock];
    for (int64_t c0 = lo; c0 < hi; c0 += kNoiseBlock) {
      const int64_t m = std::min(kNoiseBlock, hi - c0);
      for (int64_t i = 0; i < m; ++i) {
        const uint64_t a = hash32(hash32(static_cast<uint64_t>(c0 + i)) ^ key);
        const uint64_t b = hash32(a ^ 0x5BD1E995ULL);
        // 53 random bits (32 from a, 21 from b), +0.5: strictly inside (0, 1)
        const double bits = static_cast<double>(a) * 2097152.0 + static_cast<double>(b >> 11);
        buf[i] = (bits + 0.5) / 9007199254740992.0;
      }
      basic_log(buf, m, coef, ln2);
      for (int64_t i = 0; i < m; ++i) buf[i] = -buf[i];
      basic_log(buf, m, coef, ln2);
      for (int64_t i = 0; i < m; ++i) o[c0 + i] = -buf[i];
    }
  });
  return out;
}

// Top-p's fixed-point probabilities: bit for bit lockstep.engine.sampler.
// probability_units_reference, trunc(exp(max(x, -64)) * unit_scale) (NaN counts as -64) with
// the reference's exp: k = x / ln2 rounded half to even (adding and subtracting 2**52:
// |x / ln2| < 93), r = x - k ln2, 17 Taylor terms, then times 2**k from its bit fields
// (k >= -93: exact, as ldexp).
inline int64_t probability_unit(double x, double unit_scale) {
  const double ln2 = 0.6931471805599453, magic = 4503599627370496.0;
  const double v = x >= -64.0 ? x : -64.0;  // NaN too, as the reference
  const double k = (v / ln2 - magic) + magic;
  const double r = v - k * ln2;
  double term = 1.0, total = 1.0;
#pragma GCC unroll 17
  for (int t = 1; t < 18; ++t) {
    term = term * r / static_cast<double>(t);
    total = total + term;
  }
  const uint64_t sbits = static_cast<uint64_t>(static_cast<int64_t>(k) + 1023) << 52;
  double scale;
  std::memcpy(&scale, &sbits, sizeof scale);
  return static_cast<int64_t>(total * scale * unit_scale);
}

at::Tensor probability_units(const at::Tensor& x, int64_t unit_bits) {
  TORCH_CHECK(x.scalar_type() == at::kDouble && x.is_contiguous(),
              "probability_units: x must be contiguous float64");
  TORCH_CHECK(unit_bits >= 0 && unit_bits <= 100, "probability_units: unit_bits in [0, 100]");
  const double unit_scale = std::ldexp(1.0, static_cast<int>(unit_bits));
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kLong));
  const double* xp = x.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t n = x.numel();
  parallel_tasks((n + kSamplerTask - 1) / kSamplerTask, [&](int64_t task) {
    const int64_t lo = task * kSamplerTask, hi = std::min(n, lo + kSamplerTask);
    for (int64_t i = lo; i < hi; ++i) op[i] = probability_unit(xp[i], unit_scale);
  });
  return out;
}

// Top-p's cutoff without sorting: lockstep.engine.sampler._top_p_cutoff_by_sort's result
// (count, and the value at that rank) for each row of masked scores [P, V] (float64, -inf =
// dropped), best [P, 1], top_p [P] and the units' bits (sampler.UNIT_BITS). With u(v) = units
// of v - best and S(>= v) the units of the tokens scoring at least v: target = min(ceil(T *
// top_p) as a double product, T), T = S(>= -inf); the kept value v* is the largest token
// value with S(>= v*) >= target (a weighted selection, expected O(V), over the tokens with
// units: the sorted prefix reaches target at one of them); count = #(> v*) + ceil((target -
// S(> v*)) / u(v*)), the first position of the sorted values where the prefix sum reaches
// target. Exact integers throughout, so equal to the sort's answer.
std::vector<at::Tensor> top_p_cutoff(const at::Tensor& masked, const at::Tensor& best,
                                     const at::Tensor& top_p, int64_t unit_bits) {
  TORCH_CHECK(masked.dim() == 2 && masked.scalar_type() == at::kDouble && masked.is_contiguous(),
              "top_p_cutoff: masked must be contiguous float64 [P, V]");
  const int64_t rows = masked.size(0), vocab = masked.size(1);
  TORCH_CHECK(best.scalar_type() == at::kDouble && best.numel() == rows &&
                  top_p.scalar_type() == at::kDouble && top_p.numel() == rows,
              "top_p_cutoff: best [P, 1] and top_p [P] must be float64");
  const at::Tensor bc = best.contiguous(), pc = top_p.contiguous();
  at::Tensor counts = at::empty({rows, 1}, masked.options().dtype(at::kLong));
  at::Tensor kth = at::empty({rows, 1}, masked.options());
  const double* mp = masked.data_ptr<double>();
  const double* bp = bc.data_ptr<double>();
  const double* pp = pc.data_ptr<double>();
  int64_t* cp = counts.data_ptr<int64_t>();
  double* kp = kth.data_ptr<double>();
  TORCH_CHECK(unit_bits >= 0 && unit_bits <= 62, "top_p_cutoff: unit_bits in [0, 62]");
  const double unit_scale = std::ldexp(1.0, static_cast<int>(unit_bits));
  parallel_tasks(rows, [&](int64_t r) {
    const double* x = mp + r * vocab;
    const double b = bp[r];
    std::vector<int64_t> units(vocab);
    for (int64_t i = 0; i < vocab; ++i) units[i] = probability_unit(x[i] - b, unit_scale);
    std::vector<std::pair<double, int64_t>> cand;  // (value, units) of tokens with units
    int64_t total = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      total += units[i];
      if (units[i] > 0) cand.emplace_back(x[i], units[i]);
    }
    const int64_t target = std::min(  // at most T, as the sort path's guard
        static_cast<int64_t>(std::ceil(static_cast<double>(total) * pp[r])), total);
    // Weighted selection: [lo, hi) holds the candidates below every value already passed
    // over; `above` is the units of those passed over (all larger).
    int64_t lo = 0, hi = static_cast<int64_t>(cand.size()), above = 0;
    double found = cand.empty() ? -kInf : cand[0].first;
    while (lo < hi) {
      const double pivot = cand[lo + (hi - lo) / 2].first;
      // Three-way partition: larger first, then equal, then smaller.
      int64_t gt = lo, i = lo, lt = hi;
      while (i < lt) {
        if (cand[i].first > pivot) {
          std::swap(cand[i++], cand[gt++]);
        } else if (cand[i].first < pivot) {
          std::swap(cand[i], cand[--lt]);
        } else {
          ++i;
        }
      }
      int64_t w_gt = 0, w_eq = 0;
      for (int64_t j = lo; j < gt; ++j) w_gt += cand[j].second;
      for (int64_t j = gt; j < lt; ++j) w_eq += cand[j].second;
      if (above + w_gt >= target) {
        hi = gt;  // the kept value is larger than the pivot
      } else if (above + w_gt + w_eq >= target) {
        found = pivot;
        break;
      } else {
        above += w_gt + w_eq;
        lo = lt;
      }
    }
    int64_t n_gt = 0, s_gt = 0, u_star = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      if (x[i] > found) {
        ++n_gt;
        s_gt += units[i];
      } else if (x[i] == found) {
        u_star = units[i];  // equal values, equal units
      }
    }
    const int64_t need = target - s_gt;  // > 0, and at most the ties' units
    cp[r] = n_gt + (u_star > 0 ? (need + u_star - 1) / u_star : 1);
    kp[r] = found;
  });
  return {counts, kth};
}


// ----------------------------------------------------------------------------------------
// Gated DeltaNet (linear attention): element-wise gates and activations, and the gated delta
// rule over a sequence's rows in chunks of C at absolute positions 0, C, 2C, ...
// ----------------------------------------------------------------------------------------

constexpr int64_t kElemTask = 4096;  // elements per task of the element-wise kernels

// out[i] = fn(a[i], b[i]) for every element, 16 lanes at a time (the tail through the same
// lane-wise formula), so an element's bits never depend on its index in the call.
template <class V, class F>
void elementwise2(const float* a, const float* b, float* out, int64_t n, const F& fn) {
  parallel_tasks((n + kElemTask - 1) / kElemTask, [&](int64_t task) {
    const int64_t end = std::min(n, (task + 1) * kElemTask);
    int64_t i = task * kElemTask;
    for (; i + 16 <= end; i += 16) fn(V::load(a + i), V::load(b + i)).store(out + i);
    if (i < end) {
      const V av = load_partial<V>(a + i, end - i, 0.f), bv = load_partial<V>(b + i, end - i, 0.f);
      store_partial(fn(av, bv), out + i, end - i);
    }
  });
}

template <class V>
inline V sigmoid_vec(const V& x) {
  return V::div(V::set1(1.f), V::add(V::set1(1.f), vexp(V::sub(V::zero(), x))));
}

// mode 0: x * sigmoid(gate) (the attention output gate); mode 1: x * silu(gate) (the gated
// RMSNorm), silu(g) = g / (1 + exp(-g)) as in silu_mul.
at::Tensor gate_activation(const at::Tensor& x, const at::Tensor& gate, int64_t mode,
                           int64_t simd) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && gate.sizes() == x.sizes() &&
                  gate.scalar_type() == at::kFloat && gate.is_contiguous(),
              "gate_activation: x and gate must be contiguous fp32 of one shape");
  TORCH_CHECK(mode == 0 || mode == 1, "gate_activation: mode must be 0 or 1");
  at::Tensor out = at::empty_like(x);
  dispatch_simd(simd, [&](auto vec) {
    using V = decltype(vec);
    if (mode == 0) {
      elementwise2<V>(x.data_ptr<float>(), gate.data_ptr<float>(), out.data_ptr<float>(),
                      x.numel(), [](const V& a, const V& g) { return V::mul(a, sigmoid_vec(g)); });
    } else {
      elementwise2<V>(x.data_ptr<float>(), gate.data_ptr<float>(), out.data_ptr<float>(),
                      x.numel(), [](const V& a, const V& g) {
                        const V e = vexp(V::sub(V::zero(), g));
                        return V::mul(a, V::div(g, V::add(V::set1(1.f), e)));
                      });
    }
    return 0;
  });
  return out;
}

// log(y) for y >= 1 in double, by basic_log's series (a fixed formula, no libm).
inline double series_log(double y) {
  double coef[kLogTerms];
  for (int i = 0; i < kLogTerms; ++i) coef[i] = 1.0 / (2 * (kLogTerms - 1 - i) + 1);
  basic_log(&y, 1, coef, 0.6931471805599453);
  return y;
}

// g = -exp(A_log[h]) * softplus(a + dt_bias[h]),  beta = sigmoid(b), per element of [T, H].
// softplus(x) = x above 20 (torch's threshold), exp(x) below -15 (log1p(y) = y to fp32
// precision there), else log(1 + exp(x)) with the sum and the log in double.
std::vector<at::Tensor> gdn_gates(const at::Tensor& a, const at::Tensor& b,
                                  const at::Tensor& a_log, const at::Tensor& dt_bias,
                                  int64_t simd) {
  TORCH_CHECK(a.dim() == 2 && a.scalar_type() == at::kFloat && a.is_contiguous() &&
                  b.sizes() == a.sizes() && b.scalar_type() == at::kFloat && b.is_contiguous(),
              "gdn_gates: a and b must be contiguous fp32 [T, H]");
  const int64_t t = a.size(0), h = a.size(1);
  TORCH_CHECK(a_log.numel() == h && dt_bias.numel() == h && a_log.is_contiguous() &&
                  dt_bias.is_contiguous() && a_log.scalar_type() == at::kFloat &&
                  dt_bias.scalar_type() == at::kFloat,
              "gdn_gates: A_log and dt_bias must be contiguous fp32 [H]");
  at::Tensor g = at::empty_like(a), beta = at::empty_like(b);
  const float *ap = a.data_ptr<float>(), *bp = b.data_ptr<float>();
  const float *lp = a_log.data_ptr<float>(), *dp = dt_bias.data_ptr<float>();
  float *gp = g.data_ptr<float>(), *betap = beta.data_ptr<float>();
  dispatch_simd(simd, [&](auto vec) {
    using V = decltype(vec);
    for (int64_t i = 0; i < t * h; ++i) {
      const int64_t head = i % h;
      const float x = ap[i] + dp[head];
      float sp;
      if (x > 20.f) {
        sp = x;
      } else if (x < -15.f) {
        sp = sexp<V>(x);
      } else {
        sp = static_cast<float>(series_log(1.0 + static_cast<double>(sexp<V>(x))));
      }
      gp[i] = -(sexp<V>(lp[head]) * sp);
      betap[i] = 1.f / (1.f + sexp<V>(-bp[i]));
    }
    return 0;
  });
  return {g, beta};
}

// out = x * (1 / sqrt(sum(x^2) + eps)) * scale per row of [R, D] (sum in the lane-partial +
// tree order; two separate multiplies).
at::Tensor l2_normalize(const at::Tensor& x, double eps, double scale, int64_t simd) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "l2_normalize: x must be contiguous fp32 [R, D]");
  const int64_t r = x.size(0), d = x.size(1);
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps), fscale = static_cast<float>(scale);
  dispatch_simd(simd, [&](auto vec) {
    using V = decltype(vec);
    parallel_tasks((r + kRowGrain - 1) / kRowGrain, [&](int64_t task) {
      const int64_t end = std::min(r, (task + 1) * kRowGrain);
      for (int64_t i = task * kRowGrain; i < end; ++i) {
        const float inv = 1.f / std::sqrt(sum_squares<V>(xp + i * d, d) + feps);
        for (int64_t j = 0; j < d; ++j) op[i * d + j] = (xp[i * d + j] * inv) * fscale;
      }
    });
    return 0;
  });
  return out;
}

// sum(a[i] * b[i]) over i < n in the lane-partial + tree order.
template <class V>
inline float dot(const float* a, const float* b, int64_t n) {
  V acc = V::zero();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = V::fma(V::load(a + i), V::load(b + i), acc);
  if (i < n) acc = V::fma(load_partial<V>(a + i, n - i, 0.f), load_partial<V>(b + i, n - i, 0.f),
                          acc);
  return acc.reduce_add();
}

// out[0..n) = S^T x: out[e] = sum over d ascending of S[d][e] * x[d] (FMA from 0).
template <class V>
inline void state_times(const float* s, const float* x, float* out, int64_t dk, int64_t dv) {
  for (int64_t e = 0; e < dv; e += 16) {
    const int64_t w = std::min<int64_t>(16, dv - e);
    V acc = V::zero();
    for (int64_t d = 0; d < dk; ++d)
      acc = V::fma(load_partial<V>(s + d * dv + e, w, 0.f), V::set1(x[d]), acc);
    store_partial(acc, out + e, w);
  }
}

// The gated delta rule over rows start..start+n-1 of one sequence, for one layer. With the
// chunk c = floor(p / C) of position p, its offset r = p - cC, the state S at cC (S_0 = 0),
// gamma_r = g_cC + ... + g_p (ascending) and, for j <= r, d_j = exp(gamma_r - gamma_j):
//   u_r    = beta_r * (v_r - exp(gamma_r) * S^T k_r) - sum_{j<r} (beta_r (k_r.k_j) d_j) u_j
//   out_p  = exp(gamma_r) * S^T q_r + sum_{j<=r} ((q_r.k_j) d_j) u_j
// (j ascending; dots in the lane-partial + tree order), and after the chunk's last row
//   S'     = exp(gamma_{C-1}) * S + sum_j (exp(gamma_{C-1} - gamma_j) k_j) u_j^T.
// A row's bits depend only on S and the chunk's rows up to it, so any split of the sequence
// (prefill chunks, one-row decode steps, a resume from a boundary) gives the same bits.
// state [Hv, Dk, Dv] is S of the chunk holding `start`; open_k [C, Hk, Dk], open_gamma
// [C, Hv] and open_u [C, Hv, Dv] hold that chunk's rows before `start`. All are updated to
// the chunk holding start + n. Returns out [n, Hv, Dv] and S at every multiple of C in
// (start, start + n], in order [B, Hv, Dk, Dv].
std::vector<at::Tensor> gdn_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& g, const at::Tensor& beta, at::Tensor state,
                                 at::Tensor open_k, at::Tensor open_gamma, at::Tensor open_u,
                                 int64_t start, int64_t simd) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{
           &q, &k, &v, &g, &beta, &state, &open_k, &open_gamma, &open_u})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(),
                "gdn_rule: every tensor must be contiguous fp32");
  const int64_t n = q.size(0), hk = q.size(1), dk = q.size(2);
  const int64_t hv = v.size(1), dv = v.size(2), chunk = open_k.size(0);
  TORCH_CHECK(k.sizes() == q.sizes() && v.size(0) == n && g.size(0) == n && g.size(1) == hv &&
                  beta.sizes() == g.sizes() && hv % hk == 0,
              "gdn_rule: q, k [n, Hk, Dk], v [n, Hv, Dv], g and beta [n, Hv] with Hv % Hk == 0");
  TORCH_CHECK(state.dim() == 3 && state.size(0) == hv && state.size(1) == dk &&
                  state.size(2) == dv && open_k.size(1) == hk && open_k.size(2) == dk &&
                  open_gamma.size(0) == chunk && open_gamma.size(1) == hv &&
                  open_u.size(0) == chunk && open_u.size(1) == hv && open_u.size(2) == dv,
              "gdn_rule: state [Hv, Dk, Dv], open_k [C, Hk, Dk], open_gamma [C, Hv], "
              "open_u [C, Hv, Dv]");
  const int64_t first_boundary = (start / chunk + 1) * chunk;
  const int64_t num_boundaries =
      start + n >= first_boundary ? (start + n - first_boundary) / chunk + 1 : 0;
  at::Tensor out = at::empty({n, hv, dv}, q.options());
  at::Tensor boundaries = at::empty({num_boundaries, hv, dk, dv}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float *sp = state.data_ptr<float>(), *okp = open_k.data_ptr<float>();
  float *ogp = open_gamma.data_ptr<float>(), *oup = open_u.data_ptr<float>();
  float *outp = out.data_ptr<float>(), *bnd = boundaries.data_ptr<float>();
  const int64_t group = hv / hk;
  dispatch_simd(simd, [&](auto vec) {
    using V = decltype(vec);
    parallel_tasks(hv, [&](int64_t h) {
      const int64_t kh = h / group;
      float* s = sp + h * dk * dv;
      std::vector<float> ks(dv), qs(dv), u(dv);
      // Key of chunk row j (position chunk_start + j): this call's input or the open rows.
      auto key = [&](int64_t pos, int64_t j) -> const float* {
        return pos >= start ? kp + ((pos - start) * hk + kh) * dk : okp + (j * hk + kh) * dk;
      };
      for (int64_t i = 0; i < n; ++i) {
        const int64_t p = start + i, r = p % chunk, c0 = p - r;
        const float* qi = qp + (i * hk + kh) * dk;
        const float* ki = kp + (i * hk + kh) * dk;
        const float* vi = vp + (i * hv + h) * dv;
        const float bi = bp[i * hv + h];
        const float gam = r == 0 ? gp[i * hv + h] : ogp[(r - 1) * hv + h] + gp[i * hv + h];
        ogp[r * hv + h] = gam;
        const float e = sexp<V>(gam);
        state_times<V>(s, ki, ks.data(), dk, dv);
        state_times<V>(s, qi, qs.data(), dk, dv);
        for (int64_t x = 0; x < dv; ++x) u[x] = bi * (vi[x] - e * ks[x]);
        for (int64_t j = 0; j < r; ++j) {
          const float a = (bi * dot<V>(ki, key(c0 + j, j), dk)) * sexp<V>(gam - ogp[j * hv + h]);
          const float* uj = oup + (j * hv + h) * dv;
          for (int64_t x = 0; x < dv; ++x) u[x] = u[x] - a * uj[x];
        }
        float* ur = oup + (r * hv + h) * dv;
        std::copy(u.begin(), u.end(), ur);
        float* o = outp + (i * hv + h) * dv;
        for (int64_t x = 0; x < dv; ++x) o[x] = e * qs[x];
        for (int64_t j = 0; j <= r; ++j) {
          const float a = dot<V>(qi, key(c0 + j, j), dk) * sexp<V>(gam - ogp[j * hv + h]);
          const float* uj = oup + (j * hv + h) * dv;
          for (int64_t x = 0; x < dv; ++x) o[x] = o[x] + a * uj[x];
        }
        if (r == chunk - 1) {
          for (int64_t x = 0; x < dk * dv; ++x) s[x] = s[x] * e;
          for (int64_t j = 0; j < chunk; ++j) {
            const float w = sexp<V>(gam - ogp[j * hv + h]);
            const float* kj = key(c0 + j, j);
            const float* uj = oup + (j * hv + h) * dv;
            for (int64_t d = 0; d < dk; ++d) {
              const float coef = w * kj[d];
              float* row = s + d * dv;
              for (int64_t x = 0; x < dv; ++x) row[x] = row[x] + coef * uj[x];
            }
          }
          const int64_t b = (p + 1 - first_boundary) / chunk;
          std::copy(s, s + dk * dv, bnd + (b * hv + h) * dk * dv);
        }
      }
    });
    return 0;
  });
  // The open chunk's keys from this call (the loop above read them from the input).
  const int64_t end = start + n, open_start = std::max(start, end - end % chunk);
  for (int64_t p = open_start; p < end; ++p)
    std::copy(kp + (p - start) * hk * dk, kp + (p - start + 1) * hk * dk,
              okp + (p % chunk) * hk * dk);
  return {out, boundaries};
}

}  // namespace lockstep

// Every kernel runs without the GIL: a server's event loop (health checks, new requests)
// must not wait for a prefill's matmuls, and no kernel touches a Python object.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto release = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("simd_variants", &lockstep::simd_variants, release);
  m.def("linear", &lockstep::linear, release);
  m.def("rms_norm", &lockstep::rms_norm, release);
  m.def("gated_act_mul", &lockstep::gated_act_mul, release);
  m.def("log_softmax", &lockstep::log_softmax, release);
  m.def("softcap", &lockstep::softcap, release);
  m.def("moe_route", &lockstep::moe_route, release);
  m.def("rope", &lockstep::rope, release);
  m.def("attention", &lockstep::attention, release);
  m.def("latent_attention", &lockstep::latent_attention, release);
  m.def("gumbel_noise", &lockstep::gumbel_noise, release);
  m.def("probability_units", &lockstep::probability_units, release);
  m.def("top_p_cutoff", &lockstep::top_p_cutoff, release);
  m.def("gate_activation", &lockstep::gate_activation, release);
  m.def("gdn_gates", &lockstep::gdn_gates, release);
  m.def("l2_normalize", &lockstep::l2_normalize, release);
  m.def("gdn_rule", &lockstep::gdn_rule, release);
}
