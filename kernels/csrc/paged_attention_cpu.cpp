// Paged decode attention for the CPU, float32: reads K/V blocks in place through the block table
// (no gather copy). One task per (sequence, KV head) computes the scores of the KV head's group of
// query heads, a max-subtracted softmax, and the weighted sum of V.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

torch::Tensor paged_attention_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32,
              "paged_attention_decode: float32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention_decode: tensors must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t G = H / KVH, MB = block_tables.size(1);
  auto bt = block_tables.contiguous();
  auto cl = context_lens.contiguous();
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int64_t* clp = cl.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t tok_stride = KVH * D;  // floats between consecutive slots

  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, h = task % KVH;
      const int64_t ctx = clp[b];
      scores.assign(G * ctx, 0.f);
      const float* qb = qp + (b * H + h * G) * D;
      const int64_t* table = btp + b * MB;
      // scores[g, t] = scale * <q_g, k_t>
      for (int64_t t = 0; t < ctx; ++t) {
        const float* kt = kp + (table[t / bs] * bs + t % bs) * tok_stride + h * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qb + g * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * kt[d];
          scores[g * ctx + t] = s * sc;
        }
      }
      // softmax over t, per g
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * ctx;
        float m = -INFINITY;
        for (int64_t t = 0; t < ctx; ++t) m = sg[t] > m ? sg[t] : m;
        float sum = 0.f;
        for (int64_t t = 0; t < ctx; ++t) {
          sg[t] = std::exp(sg[t] - m);
          sum += sg[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < ctx; ++t) sg[t] *= inv;
      }
      // out_g = sum_t p[g, t] v_t
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < ctx; ++t) {
        const float* vt = vp + (table[t / bs] * bs + t % bs) * tok_stride + h * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * ctx + t];
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * vt[d];
        }
      }
      float* ob = op + (b * H + h * G) * D;
      std::copy(acc.begin(), acc.end(), ob);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_decode", &paged_attention_decode,
        "paged decode attention (float32, CPU): q [B,H,D], caches [NB,bs,KVH,D], block_tables [B,MB], context_lens [B]");
}
