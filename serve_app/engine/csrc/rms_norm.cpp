// RMSNorm for bf16 activations on CPU, rounded exactly as HF's LlamaRMSNorm does it:
//   y = bf16( w * bf16( x * rsqrt(mean(x^2) + eps) ) )   with x upcast to fp32.
// torch's F.rms_norm on a bf16 CPU tensor is a chain of ~10 ops (upcast, pow, mean, add, rsqrt, mul,
// downcast, mul), each a pass over the tensor plus dispatch overhead; a decode step calls it twice
// per layer on a few rows, where the overhead dominates. One pass per row here.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

namespace {
inline float bf16_to_f32(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
}  // namespace

torch::Tensor rms_norm_bf16(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "rms_norm_bf16: bf16 only");
  const int64_t hidden = weight.numel();
  TORCH_CHECK(x.size(-1) == hidden, "rms_norm_bf16: last dim must match the weight");
  x = x.contiguous();
  weight = weight.contiguous();
  auto out = torch::empty_like(x);
  const int64_t rows = hidden ? x.numel() / hidden : 0;
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* wp = weight.data_ptr<c10::BFloat16>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const c10::BFloat16* xr = xp + r * hidden;
      c10::BFloat16* orow = op + r * hidden;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t d = 0; d < hidden; ++d) ss += bf16_to_f32(xr[d]) * bf16_to_f32(xr[d]);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(hidden) + e);
      for (int64_t d = 0; d < hidden; ++d) {
        const float normed = bf16_to_f32(c10::BFloat16(bf16_to_f32(xr[d]) * inv));
        orow[d] = c10::BFloat16(bf16_to_f32(wp[d]) * normed);
      }
    }
  });
  return out;
}
