// Fused bf16 ops for the CPU decoder layer. Each replaces a chain of torch ops (one pass over the
// tensor and one dispatch each) with one pass per row, rounding exactly where the unfused chain
// rounds to bf16, so results match it (and HF) bit for bit, up to the last bit of exp in SiLU.
//
// - add_rms_norm_bf16(x, residual, weight, eps) -> normed: residual <- bf16(residual + x) in place,
//   normed = RMSNorm(residual) with HF's rounding (as rms_norm_bf16).
// - silu_and_mul_bf16(gate_up [T, 2I]) -> [T, I]: bf16(bf16(silu(gate)) * up).
// - rope_store_kv_bf16(qkv [T, (H + 2 Hkv) D], positions [T], cos, signed_sin [P, D], k_cache,
//   v_cache [blocks, bs, Hkv, D], slot_mapping [T]) -> qk [T, H + Hkv, D]: q and k heads rotated
//   (bf16(bf16(x cos) + bf16(roll(x, D/2) signed_sin)), as the torch path), k and v written to
//   their slots (slot < 0: not written).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

namespace {
inline float f32(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float round_bf16(float x) { return f32(c10::BFloat16(x)); }
using bf16 = c10::BFloat16;
}  // namespace

torch::Tensor add_rms_norm_bf16(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && residual.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "add_rms_norm_bf16: bf16 only");
  TORCH_CHECK(residual.is_contiguous() && x.sizes() == residual.sizes(), "add_rms_norm_bf16: residual must be contiguous, shaped as x");
  const int64_t hidden = weight.numel();
  TORCH_CHECK(x.size(-1) == hidden, "add_rms_norm_bf16: last dim must match the weight");
  x = x.contiguous();
  weight = weight.contiguous();
  auto out = torch::empty_like(x);
  const int64_t rows = hidden ? x.numel() / hidden : 0;
  const bf16* xp = x.data_ptr<bf16>();
  bf16* rp = residual.data_ptr<bf16>();
  const bf16* wp = weight.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      bf16* rr = rp + r * hidden;
      const bf16* xr = xp + r * hidden;
      float ss = 0.f;
      for (int64_t d = 0; d < hidden; ++d) {
        const float s = round_bf16(f32(rr[d]) + f32(xr[d]));
        rr[d] = bf16(s);
        ss += s * s;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(hidden) + e);
      bf16* orow = op + r * hidden;
      for (int64_t d = 0; d < hidden; ++d) orow[d] = bf16(f32(wp[d]) * round_bf16(f32(rr[d]) * inv));
    }
  });
  return out;
}

torch::Tensor silu_and_mul_bf16(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16 && gate_up.dim() == 2, "silu_and_mul_bf16: bf16 [T, 2I]");
  gate_up = gate_up.contiguous();
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = torch::empty({rows, inter}, gate_up.options());
  const bf16* gp = gate_up.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const bf16* g = gp + r * 2 * inter;
      const bf16* u = g + inter;
      bf16* o = op + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
        const float x = f32(g[i]);
        o[i] = bf16(round_bf16(x / (1.f + std::exp(-x))) * f32(u[i]));
      }
    }
  });
  return out;
}

torch::Tensor rope_store_kv_bf16(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor signed_sin,
                                 torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping, int64_t num_heads) {
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16 && cos.scalar_type() == at::kBFloat16 && signed_sin.scalar_type() == at::kBFloat16 &&
              k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16, "rope_store_kv_bf16: bf16 only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && cos.is_contiguous() && signed_sin.is_contiguous(),
              "rope_store_kv_bf16: contiguous caches and tables");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong, "rope_store_kv_bf16: long positions, slots");
  qkv = qkv.contiguous();
  positions = positions.contiguous();
  slot_mapping = slot_mapping.contiguous();
  const int64_t T = qkv.size(0), Hkv = k_cache.size(2), D = k_cache.size(3), H = num_heads, half = D / 2;
  TORCH_CHECK(qkv.size(1) == (H + 2 * Hkv) * D && cos.size(1) == D, "rope_store_kv_bf16: shapes");
  auto qk = torch::empty({T, H + Hkv, D}, qkv.options());
  const bf16* src = qkv.data_ptr<bf16>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const bf16* cp = cos.data_ptr<bf16>();
  const bf16* sp = signed_sin.data_ptr<bf16>();
  bf16* kc = k_cache.data_ptr<bf16>();
  bf16* vc = v_cache.data_ptr<bf16>();
  bf16* dst = qk.data_ptr<bf16>();
  const int64_t row = Hkv * D;
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const bf16* c = cp + pos[t] * D;
      const bf16* s = sp + pos[t] * D;
      const int64_t slot = slots[t];
      for (int64_t h = 0; h < H + Hkv; ++h) {
        const bf16* x = src + t * (H + 2 * Hkv) * D + h * D;
        bf16* o = dst + (t * (H + Hkv) + h) * D;
        for (int64_t d = 0; d < D; ++d) {
          const float rolled = f32(x[(d + half) % D]);
          o[d] = bf16(round_bf16(f32(x[d]) * f32(c[d])) + round_bf16(rolled * f32(s[d])));
        }
        if (h >= H && slot >= 0) std::memcpy(kc + slot * row + (h - H) * D, o, D * sizeof(bf16));
      }
      if (slot >= 0) std::memcpy(vc + slot * row, src + t * (H + 2 * Hkv) * D + (H + Hkv) * D, row * sizeof(bf16));
    }
  });
  return qk;
}
