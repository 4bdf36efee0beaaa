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


// x += delta (in place, when delta is given), then out = w * (x / sqrt(mean(x^2) + eps)); rows in parallel.
// Same order of operations as transformers' LlamaRMSNorm in float32.
torch::Tensor fused_add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && w.is_contiguous(), "fused_add_rms_norm: float32, contiguous");
  const int64_t T = x.size(0), N = x.size(1);
  auto out = torch::empty_like(x);
  float* xp = x.data_ptr<float>();
  const float* dp = delta.has_value() ? delta->contiguous().data_ptr<float>() : nullptr;
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* __restrict xr = xp + t * N;
      float* __restrict orow = op + t * N;
      if (dp) {
        const float* __restrict dr = dp + t * N;
#pragma omp simd
        for (int64_t i = 0; i < N; ++i) xr[i] += dr[i];
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < N; ++i) ss += xr[i] * xr[i];
      const float r = 1.f / std::sqrt(ss / N + feps);
#pragma omp simd
      for (int64_t i = 0; i < N; ++i) orow[i] = wp[i] * (xr[i] * r);
    }
  });
  return out;
}

// Rotary embedding in place on x [T, heads, D] (rotate-half convention) with cos/sin tables [P, D].
void rope_inplace(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.stride(2) == 1, "rope_inplace: float32, last dim contiguous");
  const int64_t T = x.size(0), Hn = x.size(1), D = x.size(2), half = D / 2;
  const int64_t st = x.stride(0), sh = x.stride(1);
  auto pos = positions.to(torch::kInt64).contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* __restrict c = cp + pp[t] * D;
      const float* __restrict s = sp + pp[t] * D;
      for (int64_t h = 0; h < Hn; ++h) {
        float* __restrict v = xp + t * st + h * sh;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          v[i] = a * c[i] + (-b) * s[i];
          v[i + half] = b * c[i + half] + a * s[i + half];
        }
      }
    }
  });
}

// out = silu(x[:, :I]) * x[:, I:] for x [T, 2I] (gate and up fused).
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "silu_and_mul: float32, contiguous");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  auto out = torch::empty({T, I}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* __restrict g = xp + t * 2 * I;
      const float* __restrict u = g + I;
      float* __restrict o = op + t * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + fast_exp(-g[i])) * u[i];
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_decode", &paged_attention_decode,
        "paged decode attention (float32, CPU): q [B,H,D], caches [NB,bs,KVH,D], block_tables [B,MB], context_lens [B]");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "x += delta; return rmsnorm(x) * w (float32)");
  m.def("rope_inplace", &rope_inplace, "rotary embedding in place (float32)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up (float32)");
}
