// Paged decode attention for the CPU, float32: reads K/V blocks in place through the block table
// (no gather copy). One task per sequence computes the scores of every query head (grouped over its
// KV head), a max-subtracted softmax (vectorizable exp), and the weighted sum of V.
// head_dim is a template constant for the common sizes so the inner loops fully vectorize.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// exp for x <= 0 (max-subtracted scores): Cephes-style range reduction and polynomial,
// relative error about 2e-7; written without calls so the loop vectorizes.
inline float exp_neg(float x) {
  x = x < -87.f ? -87.f : x;
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

// One sequence, all heads: token rows (all KV heads, contiguous in a block) are read once each for
// K and once for V, in block order, so memory is streamed contiguously.
template <int DC>
void attend_seq(const float* __restrict qb, const float* __restrict kp, const float* __restrict vp,
                const int64_t* __restrict table, int64_t ctx, int64_t bs, int64_t KVH, int64_t G, int64_t Drt,
                float sc, std::vector<int64_t>& off, std::vector<float>& scores, std::vector<float>& acc,
                float* __restrict ob) {
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
    const float* __restrict krow = kp + off[t];
    for (int64_t h = 0; h < KVH; ++h) {
      const float* __restrict kt = krow + h * D;
      for (int64_t g = 0; g < G; ++g) {
        const float* __restrict qg = qb + (h * G + g) * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * kt[d];
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
      const float e = exp_neg(sg[t] - m);
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
    const float* __restrict vrow = vp + off[t];
    for (int64_t h = 0; h < KVH; ++h) {
      const float* __restrict vt = vrow + h * D;
      for (int64_t g = 0; g < G; ++g) {
        const float p = s[(h * G + g) * ctx + t];
        float* __restrict ag = a + (h * G + g) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] += p * vt[d];
      }
    }
  }
  std::memcpy(ob, a, sizeof(float) * H * D);
}

}  // namespace

torch::Tensor paged_attention_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32 &&
                  v_cache.scalar_type() == torch::kFloat32,
              "paged_attention_decode: float32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention_decode: tensors must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t G = H / KVH, MB = block_tables.size(1);
  auto bt = block_tables.to(torch::kInt64).contiguous();
  auto cl = context_lens.to(torch::kInt64).contiguous();
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int64_t* clp = cl.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);

  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> off;
    std::vector<float> scores, acc;
    for (int64_t b = begin; b < end; ++b) {
      const float* qb = qp + b * H * D;
      float* ob = op + b * H * D;
      const int64_t* table = btp + b * MB;
      const int64_t ctx = clp[b];
#define WB_CALL(DC) attend_seq<DC>(qb, kp, vp, table, ctx, bs, KVH, G, D, sc, off, scores, acc, ob)
      switch (D) {
        case 64: WB_CALL(64); break;
        case 128: WB_CALL(128); break;
        case 32: WB_CALL(32); break;
        case 16: WB_CALL(16); break;
        default: WB_CALL(0);
      }
#undef WB_CALL
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_decode", &paged_attention_decode,
        "paged decode attention (float32, CPU): q [B,H,D], caches [NB,bs,KVH,D], block_tables [B,MB], context_lens [B]");
}
