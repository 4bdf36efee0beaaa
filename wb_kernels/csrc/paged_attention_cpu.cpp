// Compiled CPU ops of the real model, float32 and bfloat16 (math in float32, loads/stores in the tensor's
// dtype):
//
// * paged_attention_decode: one query token per sequence; reads K/V blocks in place through the block
//   table (no gather copy). One task per sequence computes the scores of every query head (grouped over
//   its KV head), a max-subtracted softmax (vectorizable exp), and the weighted sum of V.
// * paged_attention_prefill_varlen: every prefill chunk of a step in one call, each chunk attending to its
//   cached context and causally within itself, flash-style (see the section's comment).
// * fused_add_rms_norm, rope_inplace, silu_and_mul: the elementwise ops of a layer, one pass each.
//
// bfloat16 is held as its raw 16 bits (uint16_t) so that conversions are plain integer shifts the
// compiler vectorizes; float -> bfloat16 rounds to nearest even, as torch does.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
// bfloat16 pair dot products in hardware (vdpbf16ps: 2 products per fp32 lane, accumulated in fp32)
#define WB_DPBF16 1
#endif

namespace {

// ------------------------------------------------------------------------------------------ element types

using bf16_t = uint16_t;  // bfloat16 storage: the upper 16 bits of a float32

inline float to_float(float x) { return x; }
inline float to_float(bf16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// float -> storage type; bfloat16 rounds to nearest even and keeps NaN a (quiet) NaN, as c10::BFloat16
template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline bf16_t from_float<bf16_t>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return x != x ? bf16_t(0x7fc0) : static_cast<bf16_t>(rounded);
}

// x rounded to the storage type and back (what a torch op in that dtype stores)
template <typename T>
inline float round_to(float x) { return to_float(from_float<T>(x)); }

// Runs f(T{}) with T the storage type of a float32 or bfloat16 tensor; other dtypes are a one-line error.
template <typename F>
void dispatch_float(const torch::Tensor& t, const char* op, F&& f) {
  if (t.scalar_type() == torch::kFloat32) {
    f(float{});
  } else if (t.scalar_type() == torch::kBFloat16) {
    f(bf16_t{});
  } else {
    TORCH_CHECK(false, op, ": float32 or bfloat16 tensors only, got ", t.scalar_type());
  }
}

template <typename T>
const T* cptr(const torch::Tensor& t) { return reinterpret_cast<const T*>(t.data_ptr()); }
template <typename T>
T* mptr(torch::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

void check_same_dtype(const torch::Tensor& a, const torch::Tensor& b, const char* op, const char* what) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), op, ": ", what, " must have the same dtype (", a.scalar_type(),
              " vs ", b.scalar_type(), ")");
}

// exp(x) for x in [-87, 88] (clamped): Cephes-style range reduction and polynomial, relative error
// about 2e-7; written without library calls so loops over it vectorize.
inline float fast_exp(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float k = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// ------------------------------------------------------------------------------------------ decode

// Blocks of a sequence lie anywhere in the cache, so the hardware prefetcher loses the stream at every
// block boundary: the decode loops ask for the token row kPrefetchTokens ahead (a row is all KV heads of
// one token, KVH * D elements). On a 2-core AMD EPYC, 64 sequences x 300 tokens in shuffled blocks (SmolLM2's
// 9/3 heads, float32) took 3.0 ms without it (10 GB/s of K/V) and 1.2 ms with it (25 GB/s); 4, 16 and 32
// tokens ahead were within noise of each other, 64 was slower.
constexpr int64_t kPrefetchTokens = 16;

template <typename T>
inline void prefetch_row(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64) __builtin_prefetch(c + i, 0, 3);
}

// One sequence, all heads: token rows (all KV heads, contiguous in a block) are read once each for
// K and once for V, in block order, so memory is streamed contiguously. qb is the query in float32.
template <typename T, int DC>
void attend_seq(const float* __restrict qb, const T* __restrict kp, const T* __restrict vp,
                const int64_t* __restrict table, int64_t ctx, int64_t bs, int64_t KVH, int64_t G, int64_t Drt,
                float sc, std::vector<int64_t>& off, std::vector<float>& scores, std::vector<float>& acc,
                T* __restrict ob) {
  const int64_t D = DC > 0 ? DC : Drt;
  const int64_t H = KVH * G, tok_stride = KVH * D;
  off.resize(ctx);
  for (int64_t t = 0, blk = 0; t < ctx; ++blk) {
    const int64_t base = table[blk] * bs * tok_stride;
    const int64_t n = std::min(bs, ctx - t);
    for (int64_t i = 0; i < n; ++i) off[t + i] = base + i * tok_stride;
    t += n;
  }
  scores.resize(H * ctx);
  float* __restrict s = scores.data();
  for (int64_t t = 0; t < ctx; ++t) {
    const T* __restrict krow = kp + off[t];
    if (t + kPrefetchTokens < ctx) prefetch_row(kp + off[t + kPrefetchTokens], tok_stride);
    for (int64_t h = 0; h < KVH; ++h) {
      const T* __restrict kt = krow + h * D;
      for (int64_t g = 0; g < G; ++g) {
        const float* __restrict qg = qb + (h * G + g) * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * to_float(kt[d]);
        s[(h * G + g) * ctx + t] = dot * sc;
      }
    }
  }
  for (int64_t j = 0; j < H; ++j) {
    float* __restrict sg = s + j * ctx;
    float m = -INFINITY;
    for (int64_t t = 0; t < ctx; ++t) m = sg[t] > m ? sg[t] : m;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < ctx; ++t) {
      const float e = fast_exp(sg[t] - m);
      sg[t] = e;
      sum += e;
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t t = 0; t < ctx; ++t) sg[t] *= inv;
  }
  acc.assign(H * D, 0.f);
  float* __restrict a = acc.data();
  for (int64_t t = 0; t < ctx; ++t) {
    const T* __restrict vrow = vp + off[t];
    if (t + kPrefetchTokens < ctx) prefetch_row(vp + off[t + kPrefetchTokens], tok_stride);
    for (int64_t h = 0; h < KVH; ++h) {
      const T* __restrict vt = vrow + h * D;
      for (int64_t g = 0; g < G; ++g) {
        const float p = s[(h * G + g) * ctx + t];
        float* __restrict ag = a + (h * G + g) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] += p * to_float(vt[d]);
      }
    }
  }
  for (int64_t i = 0; i < H * D; ++i) ob[i] = from_float<T>(a[i]);
}

// ------------------------------------------------------------------------------------------ varlen prefill
//
// Work: tasks (chunk, KV head, row tile). A chunk's rows are its (query token, query head of the KV
// head's group) pairs, row f = token * G + head-in-group, so one task serves all G query heads that
// read the same K/V and a tile is never padded to a multiple of G. A task walks its keys in tiles of
// KEY_TILE positions, from position 0 to its last row's position (keys past a row's position are masked
// in the diagonal tiles only), and keeps a running max / sum / output per row (online softmax, as
// FlashAttention): K and V are read once per task, straight from the cache blocks through the block
// table (float32) or converted once per key tile to a float32 tile (bfloat16). On a CPU with avx512_bf16,
// bfloat16 scores come from vdpbf16ps instead, keys read in place (qk_micro_bf16: half the instructions of
// the float32 scores and no K conversion; one 1,024-token bfloat16 prompt's 30 layers of attention took
// 188 ms against 246 with float32 keys, 2-core AMD EPYC, benchmarks/prefill_attention.py); values are still
// converted, so the probabilities stay float32.
//
// Layout: everything a task computes is transposed so that vector lanes run over rows (queries):
// Qt[d][r] (the query tile, times scale * log2(e), so that the softmax runs on exp2), S[key][r] (scores,
// then probabilities), Ot[d][r] (the output accumulator). Scores are then K[key] . Qt: a broadcast of one K element times a vector of
// rows; the output is Ot[d] += V[key][d] (broadcast) * P[key] (vector of rows); the softmax's max and
// sum over keys are element-wise over row vectors. No K or V transpose or copy is needed, and the two
// products are register-blocked micro-kernels (QK_NR keys x RV row vectors, PV_DR dims x RV row
// vectors of accumulators) that are bound by the FMA units; the score micro-kernel also masks and
// takes the running max in its epilogue, so the softmax is one exp2 pass. The rows of a task are
// processed in blocks of RB = RV * VW rows (a row block's Qt, S and Ot: 16 KB each at head_dim 64).
//
// Tasks are sorted by cost (rows x keys) and handed out longest first from an atomic counter, so the
// causal triangle (late tiles of a chunk read more keys) does not leave a thread idle.

// Vector width in floats: the widest the compile target has (-march=native); the micro-kernels use GCC
// vector extensions, which lower to AVX-512, AVX2, SSE or NEON instructions as available.
#if defined(__AVX512F__)
constexpr int VW = 16;
#elif defined(__AVX__)
constexpr int VW = 8;
#else
constexpr int VW = 4;
#endif
typedef float vfloat __attribute__((vector_size(VW * sizeof(float))));

// Register blocking: AVX-512 has 32 vector registers (4 x 4 accumulators + 4 operands), AVX2 16.
constexpr int RV = VW == 16 ? 4 : 2;  // row vectors per micro-tile
constexpr int RB = RV * VW;           // rows per row block
constexpr int QK_NR = 4;              // keys per score micro-tile
constexpr int PV_DR = 4;              // head-dim values per output micro-tile
constexpr int ROW_TILE = 128;         // rows per task (a multiple of RB)
constexpr int KEY_TILE = 64;          // keys per step of the online softmax (a multiple of QK_NR)
static_assert(ROW_TILE % RB == 0 && KEY_TILE % QK_NR == 0, "tile sizes");

inline vfloat vload(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void vstore(float* p, const vfloat& v) { std::memcpy(p, &v, sizeof(v)); }
// {x, x, ...}: x - 0 is x for every float (unlike x + 0 for -0), so the compiler keeps the broadcast only
inline vfloat vsplat(float x) { return x - vfloat{}; }

// Keeps a loaded vector in a register: without it GCC folds the load into every FMA that uses it, which
// makes the micro-kernels bound by loads (one per FMA) instead of by the FMA units.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define WB_IN_REGISTER(x) asm("" : "+v"(x))
#else
#define WB_IN_REGISTER(x) (void)0
#endif

typedef int32_t vint __attribute__((vector_size(VW * sizeof(int32_t))));

inline vint vload_int(const int32_t* p) {
  vint v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vfloat vmax(const vfloat& a, const vfloat& b) { return a > b ? a : b; }

// 2^x for x <= 0 (below -126 it returns 2^-126 times ~1): x = k + r with k an integer and |r| <= 1/2,
// 2^r by a degree-5 polynomial (relative error 2.4e-7), 2^k through the exponent bits; no library calls,
// so loops over it vectorize.
inline float exp2_neg(float x) {
  x = x < -126.f ? -126.f : x;
  const float k = std::floor(x + 0.5f);
  const float r = x - k;
  float p = 1.3390863314e-3f;
  p = p * r + 9.6760317683e-3f;
  p = p * r + 5.5503569543e-2f;
  p = p * r + 2.4022106826e-1f;
  p = p * r + 6.9314718246e-1f;
  p = p * r + 1.0000001192f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// The score micro-kernels' epilogue: s[j * RB + r] = acc[j][r] (-inf with MASKED where key j, at position
// kpos0 + j or past the block's keys when j >= nvalid, is after row r's position qpos[r]); tmax[r] becomes
// the max of itself and the scores stored.
template <int RVk, bool MASKED>
inline void qk_store(const vfloat (&acc)[QK_NR][RVk], float* __restrict s, int64_t kpos0, int64_t nvalid,
                     const int32_t* __restrict qpos, float* __restrict tmax) {
  vfloat mx[RVk];
#pragma GCC unroll 4
  for (int v = 0; v < RVk; ++v) mx[v] = vload(tmax + v * VW);
#pragma GCC unroll 8
  for (int j = 0; j < QK_NR; ++j) {
    const int32_t kp = j < nvalid ? static_cast<int32_t>(kpos0 + j) : INT32_MAX;
#pragma GCC unroll 4
    for (int v = 0; v < RVk; ++v) {
      vfloat a = acc[j][v];
      if (MASKED) a = (kp > vload_int(qpos + v * VW)) ? vsplat(-INFINITY) : a;
      vstore(s + j * RB + v * VW, a);
      mx[v] = vmax(mx[v], a);
    }
  }
#pragma GCC unroll 4
  for (int v = 0; v < RVk; ++v) vstore(tmax + v * VW, mx[v]);
}

// Scores of QK_NR keys j against the RVk * VW rows r of a row block:
//   s[j * RB + r] = sum_d krow[j][d] * qt[d * RB + r]
// (log2-domain scores: q carries scale * log2(e)). With MASKED, key j (position kpos0 + j, or past the
// block's keys when j >= nvalid) gets -inf where it is after row r's position qpos[r]. tmax[r] becomes the
// max over the scores stored.
template <int RVk, bool MASKED>
inline void qk_micro(const float* const* krow, const float* __restrict qt, int64_t D, float* __restrict s,
                     int64_t kpos0, int64_t nvalid, const int32_t* __restrict qpos, float* __restrict tmax) {
  const float* kr[QK_NR];
  vfloat acc[QK_NR][RVk];
#pragma GCC unroll 8
  for (int j = 0; j < QK_NR; ++j) {
    kr[j] = krow[j];
#pragma GCC unroll 4
    for (int v = 0; v < RVk; ++v) acc[j][v] = vfloat{};
  }
  for (int64_t d = 0; d < D; ++d) {
    vfloat qv[RVk];
#pragma GCC unroll 4
    for (int v = 0; v < RVk; ++v) {
      qv[v] = vload(qt + d * RB + v * VW);
      WB_IN_REGISTER(qv[v]);
    }
#pragma GCC unroll 8
    for (int j = 0; j < QK_NR; ++j) {
      const vfloat b = vsplat(kr[j][d]);
#pragma GCC unroll 4
      for (int v = 0; v < RVk; ++v) acc[j][v] += b * qv[v];
    }
  }
  qk_store<RVk, MASKED>(acc, s, kpos0, nvalid, qpos, tmax);
}

#ifdef WB_DPBF16
// qk_micro for bfloat16 keys read in place from the cache, with vdpbf16ps: qt2 holds the unscaled
// bfloat16 query tile as pairs, qt2[(d / 2) * RB + r] = (q[r][d], q[r][d + 1]) in one 32-bit lane, and
// each key's pair (k[j][d], k[j][d + 1]) is one 32-bit broadcast, so one instruction adds both products
// of a pair to the fp32 score of every row of a vector: half the instructions of the fp32 path and no
// conversion of K. The products of two bfloat16 values are exact in fp32 (8-bit significands), so only
// the order of the fp32 additions differs from the fp32 path; the scores are then multiplied by kscale
// (scale * log2(e)), which the fp32 path folds into its query tile instead. D must be even.
template <int RVk, bool MASKED>
inline void qk_micro_bf16(const bf16_t* const* krow, const uint32_t* __restrict qt2, int64_t D, float kscale,
                          float* __restrict s, int64_t kpos0, int64_t nvalid, const int32_t* __restrict qpos,
                          float* __restrict tmax) {
  const bf16_t* kr[QK_NR];
  __m512 acc[QK_NR][RVk];
#pragma GCC unroll 8
  for (int j = 0; j < QK_NR; ++j) {
    kr[j] = krow[j];
#pragma GCC unroll 4
    for (int v = 0; v < RVk; ++v) acc[j][v] = _mm512_setzero_ps();
  }
  for (int64_t d2 = 0; d2 < D / 2; ++d2) {
    __m512bh qv[RVk];
#pragma GCC unroll 4
    for (int v = 0; v < RVk; ++v) qv[v] = (__m512bh)_mm512_loadu_si512(qt2 + d2 * RB + v * VW);
#pragma GCC unroll 8
    for (int j = 0; j < QK_NR; ++j) {
      uint32_t pair;
      std::memcpy(&pair, kr[j] + 2 * d2, sizeof(pair));
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair));
#pragma GCC unroll 4
      for (int v = 0; v < RVk; ++v) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], qv[v], b);
    }
  }
  const vfloat ks = vsplat(kscale);
  vfloat scores[QK_NR][RVk];
#pragma GCC unroll 8
  for (int j = 0; j < QK_NR; ++j) {
#pragma GCC unroll 4
    for (int v = 0; v < RVk; ++v) scores[j][v] = (vfloat)acc[j][v] * ks;
  }
  qk_store<RVk, MASKED>(scores, s, kpos0, nvalid, qpos, tmax);
}
#endif

// ot[(d0 + i) * RB + r] = ot[...] * alpha[r] + sum_j vrow[j][d0 + i] * p[j * RB + r] for DRk dims i,
// the RVk * VW rows r and the nk keys j.
template <int DRk, int RVk>
inline void pv_micro(const float* const* vrow, int64_t nk, int64_t d0, const float* __restrict p,
                     const float* __restrict alpha, float* __restrict ot) {
  vfloat acc[DRk][RVk];
#pragma GCC unroll 4
  for (int v = 0; v < RVk; ++v) {
    const vfloat al = vload(alpha + v * VW);
#pragma GCC unroll 4
    for (int i = 0; i < DRk; ++i) acc[i][v] = vload(ot + (d0 + i) * RB + v * VW) * al;
  }
  for (int64_t j = 0; j < nk; ++j) {
    vfloat pv[RVk];
#pragma GCC unroll 4
    for (int v = 0; v < RVk; ++v) {
      pv[v] = vload(p + j * RB + v * VW);
      WB_IN_REGISTER(pv[v]);
    }
    const float* __restrict vr = vrow[j] + d0;
#pragma GCC unroll 4
    for (int i = 0; i < DRk; ++i) {
      const vfloat b = vsplat(vr[i]);
#pragma GCC unroll 4
      for (int v = 0; v < RVk; ++v) acc[i][v] += b * pv[v];
    }
  }
#pragma GCC unroll 4
  for (int v = 0; v < RVk; ++v) {
#pragma GCC unroll 4
    for (int i = 0; i < DRk; ++i) vstore(ot + (d0 + i) * RB + v * VW, acc[i][v]);
  }
}

// One key tile of a row block with RVk row vectors: scores (masked past each row's position when
// MASKED), the online-softmax update of the running max m and sum l (alpha: the factor the running
// output is rescaled by), probabilities in s, then the output update. KT is the keys' element type:
// float32 keys (qt: the scaled query tile) or, with vdpbf16ps, bfloat16 keys in place (qt: the pair-packed
// unscaled bfloat16 tile of qk_micro_bf16, kscale its score scale).
template <typename KT, int RVk, bool MASKED>
void block_step(const KT* const* krow, const float* const* vrow, int64_t nk, int64_t kpos0, const float* qt,
                const int32_t* qpos, int64_t D, float* __restrict s, float* __restrict m, float* __restrict l,
                float* __restrict alpha, float* __restrict tmax, float* ot, float kscale) {
  constexpr int lanes = RVk * VW;
  const int64_t nk_pad = (nk + QK_NR - 1) / QK_NR * QK_NR;
  for (int r = 0; r < lanes; ++r) tmax[r] = m[r];
  for (int64_t j = 0; j < nk_pad; j += QK_NR) {
#ifdef WB_DPBF16
    if constexpr (std::is_same<KT, bf16_t>::value) {
      qk_micro_bf16<RVk, MASKED>(krow + j, reinterpret_cast<const uint32_t*>(qt), D, kscale, s + j * RB, kpos0 + j,
                                 nk - j, qpos, tmax);
    } else
#endif
    {
      static_assert(std::is_same<KT, float>::value, "bfloat16 keys in place need vdpbf16ps");
      (void)kscale;
      qk_micro<RVk, MASKED>(krow + j, qt, D, s + j * RB, kpos0 + j, nk - j, qpos, tmax);
    }
  }
  float sum[lanes];
#pragma omp simd
  for (int r = 0; r < lanes; ++r) sum[r] = 0.f;
  for (int64_t j = 0; j < nk_pad; ++j) {
    float* __restrict sj = s + j * RB;
#pragma omp simd
    for (int r = 0; r < lanes; ++r) {
      float e = exp2_neg(sj[r] - tmax[r]);
      if (MASKED) e = sj[r] == -INFINITY ? 0.f : e;  // a masked key weighs exactly 0
      sj[r] = e;
      sum[r] += e;
    }
  }
#pragma omp simd
  for (int r = 0; r < lanes; ++r) {
    alpha[r] = exp2_neg(m[r] - tmax[r]);  // the first tile: m = -inf, alpha ~ 0 times a zero output
    l[r] = l[r] * alpha[r] + sum[r];
    m[r] = tmax[r];
  }
  int64_t d0 = 0;
  for (; d0 + PV_DR <= D; d0 += PV_DR) pv_micro<PV_DR, RVk>(vrow, nk_pad, d0, s, alpha, ot);
  switch (D - d0) {  // head_dim not a multiple of PV_DR
    case 3: pv_micro<3, RVk>(vrow, nk_pad, d0, s, alpha, ot); break;
    case 2: pv_micro<2, RVk>(vrow, nk_pad, d0, s, alpha, ot); break;
    case 1: pv_micro<1, RVk>(vrow, nk_pad, d0, s, alpha, ot); break;
    default: break;
  }
}

// block_step for nv (1..RV) row vectors.
template <typename KT, bool MASKED>
void block_step_nv(int nv, const KT* const* krow, const float* const* vrow, int64_t nk, int64_t kpos0,
                   const float* qt, const int32_t* qpos, int64_t D, float* s, float* m, float* l, float* alpha,
                   float* tmax, float* ot, float kscale) {
  switch (nv) {
    case 1: block_step<KT, 1, MASKED>(krow, vrow, nk, kpos0, qt, qpos, D, s, m, l, alpha, tmax, ot, kscale); break;
    case 2: block_step<KT, 2, MASKED>(krow, vrow, nk, kpos0, qt, qpos, D, s, m, l, alpha, tmax, ot, kscale); break;
    case 3: block_step<KT, 3, MASKED>(krow, vrow, nk, kpos0, qt, qpos, D, s, m, l, alpha, tmax, ot, kscale); break;
    default: block_step<KT, RV, MASKED>(krow, vrow, nk, kpos0, qt, qpos, D, s, m, l, alpha, tmax, ot, kscale);
  }
}

struct PrefillTask {
  int64_t chunk, kv_head, row0, rows, cost;
};

// Per-thread scratch of the prefill kernel (float32, sized once per call).
struct PrefillScratch {
  std::vector<float> qt, ot, s, m, l, alpha, tmax, kf, vf;
  std::vector<int32_t> qpos;
  std::vector<const float*> krow, vrow;
  std::vector<const bf16_t*> krow16;  // bfloat16 keys read in place (vdpbf16ps path)
  PrefillScratch(int64_t D, bool convert)
      : qt(ROW_TILE * D), ot(ROW_TILE * D), s(KEY_TILE * RB), m(ROW_TILE), l(ROW_TILE), alpha(RB), tmax(RB),
        kf(convert ? KEY_TILE * D : 0), vf(convert ? KEY_TILE * D : 0), qpos(ROW_TILE), krow(KEY_TILE),
        vrow(KEY_TILE), krow16(convert ? KEY_TILE : 0) {}
};

// ------------------------------------------------------------------------------------------ decode, vectorized
//
// The decode kernel for head dims that are a multiple of VW and groups of up to 4 query heads per KV head
// (SmolLM2: 64 and 3). It walks the sequence block by block, and within a block KV head by KV head, keeping
// the head's G query vectors (scores) or G output accumulators (values) in registers, so each K or V head
// row is loaded once for all G query heads and the outputs are not stored and reloaded per token as in
// attend_seq; the block's tokens are contiguous, so the later heads' passes find them in cache, and the
// next block is prefetched row by row during the first head's pass. Against attend_seq with the row
// prefetch, on a 2-core AMD EPYC, 64 sequences of 150-300 tokens in shuffled blocks: float32 1.05 -> 0.74 ms,
// bfloat16 3.1 -> 1.6 ms; 256 sequences (memory-bound in float32) 4.8 -> 5.1 ms and 4.1 -> 2.0 ms.

// one head row of DC elements as DC / VW float vectors
template <int NV>
inline void load_head(const float* p, vfloat (&v)[NV]) {
  for (int i = 0; i < NV; ++i) v[i] = vload(p + i * VW);
}
template <int NV>
inline void load_head(const bf16_t* p, vfloat (&v)[NV]) {
  typedef uint16_t vu16 __attribute__((vector_size(VW * sizeof(uint16_t))));
  typedef uint32_t vu32 __attribute__((vector_size(VW * sizeof(uint32_t))));
  for (int i = 0; i < NV; ++i) {
    vu16 h;
    std::memcpy(&h, p + i * VW, sizeof(h));
    const vu32 w = __builtin_convertvector(h, vu32) << 16;
    std::memcpy(&v[i], &w, sizeof(w));
  }
}

// sum of a vector's lanes, as a tree of shuffles
inline float hsum(vfloat v) {
#if defined(__AVX512F__)
  v += __builtin_shuffle(v, vint{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, vint{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  v += __builtin_shuffle(v, vint{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  v += __builtin_shuffle(v, vint{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
#elif defined(__AVX__)
  v += __builtin_shuffle(v, vint{4, 5, 6, 7, 0, 1, 2, 3});
  v += __builtin_shuffle(v, vint{2, 3, 0, 1, 6, 7, 4, 5});
  v += __builtin_shuffle(v, vint{1, 0, 3, 2, 5, 4, 7, 6});
#else
  v += __builtin_shuffle(v, vint{2, 3, 0, 1});
  v += __builtin_shuffle(v, vint{1, 0, 3, 2});
#endif
  return v[0];
}

template <typename T>
inline void prefetch_head(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64) __builtin_prefetch(c + i, 0, 3);
}

// Block blk of a sequence in a K or V cache: its first token row, its first token's position and token
// count, and the next block's first row and token count (nullptr / 0 after the last block).
template <typename T>
struct SeqBlock {
  const T* rows;
  int64_t t0, n;
  const T* next;
  int64_t nnext;
};
template <typename T>
inline SeqBlock<T> seq_block(const T* cache, const int64_t* table, int64_t blk, int64_t ctx, int64_t bs,
                             int64_t tok_stride) {
  const int64_t t0 = blk * bs, nblk = (ctx + bs - 1) / bs;
  const bool more = blk + 1 < nblk;
  return {cache + table[blk] * bs * tok_stride, t0, std::min(bs, ctx - t0),
          more ? cache + table[blk + 1] * bs * tok_stride : nullptr, more ? std::min(bs, ctx - t0 - bs) : 0};
}

// One sequence's decode attention over its context blocks [blk0, blk1): with ``ob``, the whole context
// (blk0 0, blk1 every block), normalized into ``ob`` [H][DC]; without, one part of a split context: its
// per-head running max, sum of exp and unnormalized weighted V into ``part`` ([H] max, [H] sum, [H][DC]),
// combined by combine_parts.
template <typename T, int DC, int GC>
void attend_seq_vec(const float* __restrict qb, const T* __restrict kp, const T* __restrict vp,
                    const int64_t* __restrict table, int64_t ctx, int64_t blk0, int64_t blk1, int64_t bs,
                    int64_t KVH, float sc, std::vector<float>& scores, std::vector<float>& acc,
                    T* __restrict ob, float* __restrict part) {
  constexpr int NV = DC / VW;
  const int64_t tok_stride = KVH * DC, H = KVH * GC;
  const int64_t base = blk0 * bs, len = std::min(blk1 * bs, ctx) - base;
  scores.resize(H * len);
  float* __restrict s = scores.data();  // [H][len]
  // scores, block by block: a block's tokens are contiguous (bs x KVH x DC), so every KV head's pass over
  // them finds them in cache once the first has loaded them; the next block is prefetched meanwhile
  for (int64_t blk = blk0; blk < blk1; ++blk) {
    const SeqBlock<T> b = seq_block(kp, table, blk, ctx, bs, tok_stride);
    for (int64_t h = 0; h < KVH; ++h) {
      vfloat q[GC][NV];
      for (int g = 0; g < GC; ++g) load_head<NV>(qb + (h * GC + g) * DC, q[g]);
      for (int64_t i = 0; i < b.n; ++i) {
        if (h == 0 && i < b.nnext) prefetch_head(b.next + i * tok_stride, tok_stride);
        vfloat k[NV];
        load_head<NV>(b.rows + i * tok_stride + h * DC, k);
        for (int g = 0; g < GC; ++g) {
          vfloat a = q[g][0] * k[0];
          for (int j = 1; j < NV; ++j) a += q[g][j] * k[j];
          s[(h * GC + g) * len + b.t0 - base + i] = hsum(a) * sc;
        }
      }
    }
  }
  float mx[64], sums[64];
  for (int64_t j = 0; j < H; ++j) {
    float* __restrict sg = s + j * len;
    float m = -INFINITY;
    for (int64_t t = 0; t < len; ++t) m = sg[t] > m ? sg[t] : m;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      const float e = fast_exp(sg[t] - m);
      sg[t] = e;
      sum += e;
    }
    mx[j] = m;
    sums[j] = sum;
  }
  float* __restrict a;  // [H][DC]
  if (ob) {
    acc.assign(H * DC, 0.f);
    a = acc.data();
  } else {
    a = part + 2 * H;
    std::fill(a, a + H * DC, 0.f);
  }
  for (int64_t blk = blk0; blk < blk1; ++blk) {
    const SeqBlock<T> b = seq_block(vp, table, blk, ctx, bs, tok_stride);
    for (int64_t h = 0; h < KVH; ++h) {
      vfloat o[GC][NV];
      for (int g = 0; g < GC; ++g) load_head<NV>(a + (h * GC + g) * DC, o[g]);
      for (int64_t i = 0; i < b.n; ++i) {
        if (h == 0 && i < b.nnext) prefetch_head(b.next + i * tok_stride, tok_stride);
        vfloat v[NV];
        load_head<NV>(b.rows + i * tok_stride + h * DC, v);
        for (int g = 0; g < GC; ++g) {
          const vfloat pg = vsplat(s[(h * GC + g) * len + b.t0 - base + i]);
          for (int j = 0; j < NV; ++j) o[g][j] += pg * v[j];
        }
      }
      for (int g = 0; g < GC; ++g)
        for (int j = 0; j < NV; ++j) vstore(a + (h * GC + g) * DC + j * VW, o[g][j]);
    }
  }
  if (!ob) {
    std::copy(mx, mx + H, part);
    std::copy(sums, sums + H, part + H);
    return;
  }
  for (int64_t j = 0; j < H; ++j) {
    const float inv = 1.f / sums[j];
    for (int64_t d = 0; d < DC; ++d) ob[j * DC + d] = from_float<T>(a[j * DC + d] * inv);
  }
}

// The parts of one split context (each [H] max, [H] sum of exp, [H][D] weighted V, as attend_seq_vec
// writes them) into the normalized output ``ob`` [H][D]: each part's terms rescaled to the largest max.
template <typename T>
void combine_parts(const float* parts, int64_t nparts, int64_t H, int64_t D, T* ob) {
  const int64_t stride = H * (D + 2);
  std::vector<float> w(nparts), o(D);
  for (int64_t j = 0; j < H; ++j) {
    float m = -INFINITY;
    for (int64_t p = 0; p < nparts; ++p) m = std::max(m, parts[p * stride + j]);
    float sum = 0.f;
    for (int64_t p = 0; p < nparts; ++p) {
      w[p] = std::exp(parts[p * stride + j] - m);
      sum += parts[p * stride + H + j] * w[p];
    }
    std::fill(o.begin(), o.end(), 0.f);
    for (int64_t p = 0; p < nparts; ++p) {
      const float* ap = parts + p * stride + 2 * H + j * D;
      for (int64_t d = 0; d < D; ++d) o[d] += ap[d] * w[p];
    }
    const float inv = 1.f / sum;
    for (int64_t d = 0; d < D; ++d) ob[j * D + d] = from_float<T>(o[d] * inv);
  }
}

// A context split for the decode kernel's threads: parts of at least this many tokens (whole blocks).
constexpr int64_t MIN_PART_TOKENS = 256;

struct DecodeTask {
  int64_t seq, blk0, blk1, part;  // part: index into the part buffers, -1 for a whole context
};

template <typename T>
void decode_impl(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                 const torch::Tensor& bt, const torch::Tensor& cl, float sc, torch::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t G = H / KVH, MB = bt.size(1);
  const T* qp = cptr<T>(q);
  const T* kp = cptr<T>(k_cache);
  const T* vp = cptr<T>(v_cache);
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int64_t* clp = cl.data_ptr<int64_t>();
  T* op = mptr<T>(out);
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const bool vec = H <= 64 && ((D == 64 && G >= 1 && G <= 4) || (D == 128 && (G == 1 || G == 2 || G == 4)) ||
                               (D == 32 && G == 3));
  // Work is dealt in tasks taken longest first from a shared counter by whichever thread is free (as the
  // prefill kernel's): a plain split of the batch into consecutive ranges left one thread with most of the
  // context whenever the long ones sat together (a running engine lists its oldest, longest requests first;
  // on a 2-core AVX-512 CPU, 48 rows of 280 then 48 of 40 context took 1.16x as long as 96 rows of 160). A
  // context longer than the batch's fair share per thread is split into parts of whole blocks, combined
  // after (flash-decoding's split over the keys), so that one long sequence does not run on one thread
  // while the others wait: a single decode row of 1,024 context ran 1.12-1.24x its profile's prediction.
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += clp[b];
  const int64_t share = (total + 2 * threads - 1) / (2 * threads);
  const int64_t part_blocks = (std::max(MIN_PART_TOKENS, share) + bs - 1) / bs;
  std::vector<DecodeTask> tasks;
  std::vector<int64_t> first_part(B, -1), num_parts(B, 0);
  int64_t nparts = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nblk = (clp[b] + bs - 1) / bs;
    if (threads == 1 || !vec || clp[b] <= 0 || nblk <= part_blocks) {
      tasks.push_back({b, 0, nblk, -1});
      continue;
    }
    first_part[b] = nparts;
    for (int64_t k0 = 0; k0 < nblk; k0 += part_blocks) {
      tasks.push_back({b, k0, std::min(nblk, k0 + part_blocks), nparts++});
      ++num_parts[b];
    }
  }
  const int64_t part_stride = H * (D + 2);
  std::vector<float> parts(nparts * part_stride);
  auto tokens = [&](const DecodeTask& t) { return std::min(t.blk1 * bs, clp[t.seq]) - t.blk0 * bs; };
  std::stable_sort(tasks.begin(), tasks.end(),
                   [&](const DecodeTask& x, const DecodeTask& y) { return tokens(x) > tokens(y); });
  const int64_t ntasks = static_cast<int64_t>(tasks.size());
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(threads, ntasks);
  at::parallel_for(0, std::max<int64_t>(1, workers), 1, [&](int64_t, int64_t) {
    std::vector<int64_t> off;
    std::vector<float> scores, acc, qf(H * D);
    for (int64_t k = next.fetch_add(1); k < ntasks; k = next.fetch_add(1)) {
      const DecodeTask& task = tasks[k];
      const int64_t b = task.seq;
      for (int64_t i = 0; i < H * D; ++i) qf[i] = to_float(qp[b * H * D + i]);
      T* ob = task.part < 0 ? op + b * H * D : nullptr;
      float* part = task.part < 0 ? nullptr : parts.data() + task.part * part_stride;
      const int64_t* table = btp + b * MB;
      const int64_t ctx = clp[b];
#define WB_VEC(DC, GC) \
  attend_seq_vec<T, DC, GC>(qf.data(), kp, vp, table, ctx, task.blk0, task.blk1, bs, KVH, sc, scores, acc, ob, part)
#define WB_CALL(DC) attend_seq<T, DC>(qf.data(), kp, vp, table, ctx, bs, KVH, G, D, sc, off, scores, acc, ob)
      if (ctx > 0 && H > 64) WB_CALL(0);
      else if (ctx > 0 && D == 64 && G == 3) WB_VEC(64, 3);
      else if (ctx > 0 && D == 64 && G == 1) WB_VEC(64, 1);
      else if (ctx > 0 && D == 64 && G == 2) WB_VEC(64, 2);
      else if (ctx > 0 && D == 64 && G == 4) WB_VEC(64, 4);
      else if (ctx > 0 && D == 128 && G == 1) WB_VEC(128, 1);
      else if (ctx > 0 && D == 128 && G == 2) WB_VEC(128, 2);
      else if (ctx > 0 && D == 128 && G == 4) WB_VEC(128, 4);
      else if (ctx > 0 && D == 32 && G == 3) WB_VEC(32, 3);
      else {
        switch (D) {
          case 64: WB_CALL(64); break;
          case 128: WB_CALL(128); break;
          case 32: WB_CALL(32); break;
          case 16: WB_CALL(16); break;
          default: WB_CALL(0);
        }
      }
#undef WB_CALL
#undef WB_VEC
    }
  });
  for (int64_t b = 0; b < B; ++b)
    if (num_parts[b]) combine_parts<T>(parts.data() + first_part[b] * part_stride, num_parts[b], H, D, op + b * H * D);
}

struct PrefillArgs {
  const void* q;
  int64_t q_stride_t, q_stride_h;  // elements
  const void* k_cache;
  const void* v_cache;
  void* out;  // [T, H, D] contiguous
  const int64_t* tables;
  int64_t table_width;
  const int64_t* query_start;
  const int64_t* start_pos;
  int64_t H, KVH, G, D, bs;
  float scale;
  bool no_dpbf16;  // WORKBENCH_PREFILL_FP32_KEYS=1: bfloat16 keys converted to float32 even with vdpbf16ps
};

// One task: rows [row0, row0 + rows) of a chunk (row f = token f / G, query head kv_head * G + f % G).
// KT: the element type the score micro-kernel reads keys in (see block_step).
template <typename T, typename KT>
void prefill_task_keys(const PrefillArgs& a, const PrefillTask& task, PrefillScratch& w) {
  constexpr bool keys16 = std::is_same<KT, bf16_t>::value;
  static_assert(!keys16 || std::is_same<T, bf16_t>::value, "bfloat16 keys come from a bfloat16 cache");
  const int64_t D = a.D, G = a.G, KVH = a.KVH;
  const int64_t q0 = a.query_start[task.chunk], start = a.start_pos[task.chunk];
  const int64_t* table = a.tables + task.chunk * a.table_width;
  const int64_t nr = task.rows, nblocks = (nr + RB - 1) / RB;
  const T* q = static_cast<const T*>(a.q);
  const T* kc = static_cast<const T*>(a.k_cache);
  const T* vc = static_cast<const T*>(a.v_cache);
  float* qt = w.qt.data();
  float* ot = w.ot.data();
  // pack the query tile transposed, times scale * log2(e) so that scores are in log2 units (exp2 is cheaper
  // than exp); rows past nr are zero, at the last row's position. With bfloat16 keys the tile holds the
  // unscaled bfloat16 query as pairs (qk_micro_bf16), at the same per-block offsets.
  const float scale2 = a.scale * 1.44269504088896341f;
  for (int64_t r = 0; r < nblocks * RB; ++r) {
    const int64_t f = task.row0 + std::min(r, nr - 1);
    const int64_t tok = f / G, head = task.kv_head * G + f % G;
    w.qpos[r] = static_cast<int32_t>(start + tok);
    const T* qr = q + (q0 + tok) * a.q_stride_t + head * a.q_stride_h;
    float* col = qt + (r / RB) * RB * D + r % RB;
    if constexpr (keys16) {
      uint32_t* col2 = reinterpret_cast<uint32_t*>(col);
      for (int64_t d = 0; d < D; d += 2) {
        col2[(d / 2) * RB] = r < nr ? static_cast<uint32_t>(qr[d]) | (static_cast<uint32_t>(qr[d + 1]) << 16) : 0u;
      }
    } else {
      for (int64_t d = 0; d < D; ++d) col[d * RB] = r < nr ? to_float(qr[d]) * scale2 : 0.f;
    }
  }
  std::fill(ot, ot + nblocks * RB * D, 0.f);
  std::fill(w.m.begin(), w.m.end(), -INFINITY);
  std::fill(w.l.begin(), w.l.end(), 0.f);
  const int64_t kend = w.qpos[nr - 1] + 1;  // keys 0 .. the last row's position
  const int64_t tok_stride = KVH * D;
  for (int64_t k0 = 0; k0 < kend; k0 += KEY_TILE) {
    const int64_t nk = std::min<int64_t>(KEY_TILE, kend - k0);
    const int64_t nk_pad = (nk + QK_NR - 1) / QK_NR * QK_NR;
    for (int64_t j = 0; j < nk_pad; ++j) {  // padding keys point at key k0 (finite; masked to weight 0)
      const int64_t pos = k0 + (j < nk ? j : 0);
      const int64_t off = ((table[pos / a.bs] * a.bs + pos % a.bs) * KVH + task.kv_head) * D;
      if constexpr (std::is_same<T, float>::value) {
        w.krow[j] = kc + off;
        w.vrow[j] = vc + off;
      } else if constexpr (keys16) {  // keys in place, values converted
        float* vd = w.vf.data() + j * D;
        const T* vs = vc + off;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) vd[d] = to_float(vs[d]);
        w.krow16[j] = kc + off;
        w.vrow[j] = vd;
      } else {
        float* kd = w.kf.data() + j * D;
        float* vd = w.vf.data() + j * D;
        const T* ks = kc + off;
        const T* vs = vc + off;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) {
          kd[d] = to_float(ks[d]);
          vd[d] = to_float(vs[d]);
        }
        w.krow[j] = kd;
        w.vrow[j] = vd;
      }
    }
    for (int64_t b = 0; b < nblocks; ++b) {
      const int32_t* qpos = w.qpos.data() + b * RB;
      const int64_t last = std::min(nr - 1, b * RB + RB - 1) - b * RB;  // the block's last real row
      if (k0 > qpos[last]) continue;  // this block's rows are all before the tile
      const int nv = static_cast<int>((last + VW) / VW);
      const int64_t nkb = std::min<int64_t>(nk, qpos[last] + 1 - k0);  // the keys this block's rows reach
      const bool masked = k0 + nkb - 1 > qpos[0] || nkb % QK_NR;   // a key past a row, or padding keys
      float* m = w.m.data() + b * RB;
      float* l = w.l.data() + b * RB;
      auto step = masked ? block_step_nv<KT, true> : block_step_nv<KT, false>;
      const KT* const* krow;
      if constexpr (keys16) {
        krow = w.krow16.data();
      } else {
        krow = w.krow.data();
      }
      step(nv, krow, w.vrow.data(), nkb, k0, qt + b * RB * D, qpos, D, w.s.data(), m, l, w.alpha.data(),
           w.tmax.data(), ot + b * RB * D, scale2);
    }
  }
  T* out = static_cast<T*>(a.out);
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t f = task.row0 + r, tok = f / G, head = task.kv_head * G + f % G;
    const float inv = 1.f / w.l[r];
    const float* col = ot + (r / RB) * RB * D + r % RB;
    T* orow = out + ((q0 + tok) * a.H + head) * D;
    for (int64_t d = 0; d < D; ++d) orow[d] = from_float<T>(col[d * RB] * inv);
  }
}

// prefill_task_keys with bfloat16 keys in place where the CPU has vdpbf16ps (and head_dim is even), float32
// keys otherwise.
template <typename T>
void prefill_task(const PrefillArgs& a, const PrefillTask& task, PrefillScratch& w) {
#ifdef WB_DPBF16
  if constexpr (std::is_same<T, bf16_t>::value) {
    if (a.D % 2 == 0 && !a.no_dpbf16) return prefill_task_keys<T, bf16_t>(a, task, w);
  }
#endif
  prefill_task_keys<T, float>(a, task, w);
}

// The step's tasks, most expensive first.
std::vector<PrefillTask> prefill_tasks(const PrefillArgs& a, int64_t P) {
  std::vector<PrefillTask> tasks;
  for (int64_t p = 0; p < P; ++p) {
    const int64_t n = a.query_start[p + 1] - a.query_start[p], rows = n * a.G;
    for (int64_t h = 0; h < a.KVH; ++h) {
      for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
        const int64_t nr = std::min<int64_t>(ROW_TILE, rows - r0);
        const int64_t keys = a.start_pos[p] + (r0 + nr - 1) / a.G + 1;
        tasks.push_back({p, h, r0, nr, nr * keys});
      }
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const PrefillTask& x, const PrefillTask& y) { return x.cost > y.cost; });
  return tasks;
}

template <typename T>
void prefill_impl(const PrefillArgs& a, int64_t P) {
  const std::vector<PrefillTask> tasks = prefill_tasks(a, P);
  const int64_t ntasks = static_cast<int64_t>(tasks.size());
  if (ntasks == 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), ntasks);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    PrefillScratch w(a.D, !std::is_same<T, float>::value);
    for (int64_t i = next.fetch_add(1); i < ntasks; i = next.fetch_add(1)) prefill_task<T>(a, tasks[i], w);
  });
}

}  // namespace

torch::Tensor paged_attention_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  check_same_dtype(q, k_cache, "paged_attention_decode", "q and k_cache");
  check_same_dtype(q, v_cache, "paged_attention_decode", "q and v_cache");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention_decode: tensors must be contiguous");
  auto bt = block_tables.to(torch::kInt64).contiguous();
  auto cl = context_lens.to(torch::kInt64).contiguous();
  auto out = torch::empty_like(q);
  dispatch_float(q, "paged_attention_decode", [&](auto tag) {
    decode_impl<decltype(tag)>(q, k_cache, v_cache, bt, cl, static_cast<float>(scale), out);
  });
  return out;
}

// WORKBENCH_PREFILL_FP32_KEYS=1 turns the vdpbf16ps score path off (read per call: a benchmark or test
// compares both paths in one process).
static bool fp32_keys_forced() {
  const char* v = std::getenv("WORKBENCH_PREFILL_FP32_KEYS");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

// Every prefill chunk of a step: q [T, H, D] (rows of chunk p at cu_seqlens_q[p] .. cu_seqlens_q[p+1]-1,
// last dim contiguous), caches [NB, bs, KVH, D] with the chunks' K/V written, block_tables [P, MB],
// start_pos [P] (tokens cached before each chunk). Returns [T, H, D] in q's dtype.
torch::Tensor paged_attention_prefill_varlen(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                             torch::Tensor block_tables, torch::Tensor cu_seqlens_q,
                                             torch::Tensor start_pos, double scale) {
  const char* op = "paged_attention_prefill_varlen";
  check_same_dtype(q, k_cache, op, "q and k_cache");
  check_same_dtype(q, v_cache, op, "q and v_cache");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, op, ": q must be [tokens, heads, head_dim] with a contiguous last dim");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              op, ": k_cache and v_cache must be contiguous [num_blocks, block_size, kv_heads, head_dim] of one shape");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t NB = k_cache.size(0), bs = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, op, ": head_dim of q (", D, ") and the cache (", k_cache.size(3), ") differ");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, op, ": num_heads (", H, ") must be a multiple of num_kv_heads (", KVH, ")");
  auto bt = block_tables.to(torch::kInt64).contiguous();
  auto cu = cu_seqlens_q.to(torch::kInt64).contiguous();
  auto sp = start_pos.to(torch::kInt64).contiguous();
  const int64_t P = sp.numel();
  TORCH_CHECK(bt.dim() == 2 && bt.size(0) == P && cu.dim() == 1 && cu.numel() == P + 1, op,
              ": block_tables must be [num_chunks, max_blocks] and cu_seqlens_q [num_chunks + 1] for ", P,
              " start positions");
  const int64_t* cup = cu.data_ptr<int64_t>();
  const int64_t* spp = sp.data_ptr<int64_t>();
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int64_t MB = bt.size(1);
  TORCH_CHECK(P == 0 || (cup[0] == 0 && cup[P] == T), op, ": cu_seqlens_q must run from 0 to the ", T, " query rows");
  for (int64_t p = 0; p < P; ++p) {
    const int64_t n = cup[p + 1] - cup[p], blocks = (spp[p] + n + bs - 1) / bs;
    TORCH_CHECK(n >= 0 && spp[p] >= 0 && spp[p] + n < INT32_MAX, op, ": chunk ", p,
                " has a negative length or start position, or positions past 2^31");
    TORCH_CHECK(blocks <= MB, op, ": chunk ", p, " covers ", spp[p] + n, " positions, more than its ", MB,
                " blocks of ", bs, " hold");
    for (int64_t b = 0; b < (n ? blocks : 0); ++b) {
      TORCH_CHECK(btp[p * MB + b] >= 0 && btp[p * MB + b] < NB, op, ": chunk ", p, " reads block ",
                  btp[p * MB + b], ", outside the cache's ", NB, " blocks");
    }
  }
  auto out = torch::empty({T, H, D}, q.options());
  PrefillArgs a{q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                btp, MB, cup, spp, H, KVH, H / KVH, D, bs, static_cast<float>(scale), fp32_keys_forced()};
  dispatch_float(q, op, [&](auto tag) { prefill_impl<decltype(tag)>(a, P); });
  return out;
}

namespace {

// x += delta (in place, when given), then out = w * (x / sqrt(mean(x^2) + eps)). float32: the order of
// operations of transformers' LlamaRMSNorm; bfloat16: x + delta rounded to bfloat16 (the residual add in
// the model dtype), the norm in float32, the normalized x rounded to bfloat16, then times the weight and
// rounded again (transformers casts to the input dtype before the weight multiply).
template <typename T>
void rms_norm_impl(T* xp, const T* dp, const T* wp, T* op, int64_t rows, int64_t N, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* __restrict xr = xp + t * N;
      T* __restrict orow = op + t * N;
      if (dp) {
        const T* __restrict dr = dp + t * N;
#pragma omp simd
        for (int64_t i = 0; i < N; ++i) xr[i] = from_float<T>(to_float(xr[i]) + to_float(dr[i]));
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < N; ++i) ss += to_float(xr[i]) * to_float(xr[i]);
      const float r = 1.f / std::sqrt(ss / N + eps);
      if constexpr (std::is_same<T, float>::value) {
#pragma omp simd
        for (int64_t i = 0; i < N; ++i) orow[i] = wp[i] * (xr[i] * r);
      } else {
#pragma omp simd
        for (int64_t i = 0; i < N; ++i) orow[i] = from_float<T>(to_float(wp[i]) * round_to<T>(to_float(xr[i]) * r));
      }
    }
  });
}

// Rotate-half RoPE in place. float32 as before; bfloat16 rounds each product and the sum as torch does
// for x * cos + rotate_half(x) * sin in bfloat16.
template <typename T>
void rope_impl(T* xp, const int64_t* pp, const T* cp, const T* sp, int64_t rows, int64_t Hn, int64_t D,
               int64_t st, int64_t sh) {
  const int64_t half = D / 2;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* __restrict c = cp + pp[t] * D;
      const T* __restrict s = sp + pp[t] * D;
      for (int64_t h = 0; h < Hn; ++h) {
        T* __restrict v = xp + t * st + h * sh;
        if constexpr (std::is_same<T, float>::value) {
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const float a = v[i], b = v[i + half];
            v[i] = a * c[i] + (-b) * s[i];
            v[i + half] = b * c[i + half] + a * s[i + half];
          }
        } else {
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const float a = to_float(v[i]), b = to_float(v[i + half]);
            const float lo = round_to<T>(a * to_float(c[i])) + round_to<T>(-b * to_float(s[i]));
            const float hi = round_to<T>(b * to_float(c[i + half])) + round_to<T>(a * to_float(s[i + half]));
            v[i] = from_float<T>(lo);
            v[i + half] = from_float<T>(hi);
          }
        }
      }
    }
  });
}

// out = silu(gate) * up; bfloat16 rounds silu(gate) before the multiply, as F.silu(gate) * up does.
template <typename T>
void silu_mul_impl(const T* xp, T* op, int64_t rows, int64_t I) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* __restrict g = xp + t * 2 * I;
      const T* __restrict u = g + I;
      T* __restrict o = op + t * I;
      if constexpr (std::is_same<T, float>::value) {
#pragma omp simd
        for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + fast_exp(-g[i])) * u[i];
      } else {
#pragma omp simd
        for (int64_t i = 0; i < I; ++i) {
          const float gf = to_float(g[i]);
          o[i] = from_float<T>(round_to<T>(gf / (1.f + fast_exp(-gf))) * to_float(u[i]));
        }
      }
    }
  });
}

}  // namespace

torch::Tensor fused_add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor w, double eps) {
  const char* op = "fused_add_rms_norm";
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(1), op,
              ": x must be contiguous [rows, hidden] and w [hidden]");
  check_same_dtype(x, w, op, "x and w");
  torch::Tensor d;
  if (delta.has_value()) {
    check_same_dtype(x, *delta, op, "x and delta");
    TORCH_CHECK(delta->sizes() == x.sizes(), op, ": delta must have x's shape");
    d = delta->contiguous();
  }
  auto out = torch::empty_like(x);
  dispatch_float(x, op, [&](auto tag) {
    using T = decltype(tag);
    rms_norm_impl<T>(mptr<T>(x), d.defined() ? cptr<T>(d) : nullptr, cptr<T>(w), mptr<T>(out), x.size(0), x.size(1),
                     static_cast<float>(eps));
  });
  return out;
}

// Rotary embedding in place on x [T, heads, D] (rotate-half convention) with cos/sin tables [P, D].
void rope_inplace(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin) {
  const char* op = "rope_inplace";
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, op, ": x must be [tokens, heads, head_dim], last dim contiguous");
  check_same_dtype(x, cos, op, "x and cos");
  check_same_dtype(x, sin, op, "x and sin");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(-1) == x.size(2), op,
              ": cos and sin must be contiguous [positions, head_dim]");
  auto pos = positions.to(torch::kInt64).contiguous();
  dispatch_float(x, op, [&](auto tag) {
    using T = decltype(tag);
    rope_impl<T>(mptr<T>(x), pos.data_ptr<int64_t>(), cptr<T>(cos), cptr<T>(sin), x.size(0), x.size(1), x.size(2),
                 x.stride(0), x.stride(1));
  });
}

// out = silu(x[:, :I]) * x[:, I:] for x [T, 2I] (gate and up fused).
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, "silu_and_mul: x must be contiguous [rows, 2I]");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  auto out = torch::empty({T, I}, x.options());
  dispatch_float(x, "silu_and_mul", [&](auto tag) {
    using E = decltype(tag);
    silu_mul_impl<E>(cptr<E>(x), mptr<E>(out), T, I);
  });
  return out;
}

bool prefill_bf16_dot() {
#ifdef WB_DPBF16
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_decode", &paged_attention_decode,
        "paged decode attention (float32/bfloat16, CPU): q [B,H,D], caches [NB,bs,KVH,D], block_tables [B,MB], "
        "context_lens [B]");
  m.def("paged_attention_prefill_varlen", &paged_attention_prefill_varlen,
        "paged causal attention of all prefill chunks (float32/bfloat16, CPU): q [T,H,D], caches [NB,bs,KVH,D], "
        "block_tables [P,MB], cu_seqlens_q [P+1], start_pos [P]");
  m.def("prefill_bf16_dot", &prefill_bf16_dot,
        "true when bfloat16 prefill scores use vdpbf16ps (built for a CPU with avx512_bf16)");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "x += delta; return rmsnorm(x) * w (float32/bfloat16)");
  m.def("rope_inplace", &rope_inplace, "rotary embedding in place (float32/bfloat16)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up (float32/bfloat16)");
}
