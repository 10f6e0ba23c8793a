// SiLU-and-mul for bf16 activations on CPU: one pass over the MLP's fused gate/up projection instead
// of torch's silu and then mul (two passes, a temporary), bit-identical to that pair.
//
// silu_mul_bf16(gate_up [T, 2I] bf16, inner dim contiguous) -> [T, I] bf16:
//   out = bf16( f32(bf16(silu(f32(gate)))) * f32(up) ),  silu(x) = x / (1 + e^-x)
// with gate = gate_up[:, :I], up = gate_up[:, I:]. torch computes silu on bf16 in fp32 16 lanes at a
// time with SLEEF's expf (1-ulp), rounds to bf16, and the mul rounds again; e^x here follows that same
// algorithm step by step (range reduction by ln 2 in two parts, the same degree-6 polynomial, the
// same fused multiply-adds), so the results match bit for bit. torch finishes rows whose length is
// not a multiple of its 32-element vectors with scalar libm calls, so I must be a multiple of 32 here
// (every common model's is); callers keep the torch ops otherwise.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

// SLEEF's xexpf (the u10 variant torch's Vectorized<float>::exp calls), 16 lanes
inline __m512 sleef_expf(__m512 d) {
  const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(d, _mm512_set1_ps(1.442695040888963407359924681001892137426645954152985934135449406931f)));
  const __m512 qf = _mm512_cvtepi32_ps(q);
  __m512 s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-0.693145751953125f), d);
  s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-1.428606765330187045e-06f), s);
  __m512 u = _mm512_set1_ps(0.000198527617612853646278381f);
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00139304355252534151077271f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00833336077630519866943359f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.0416664853692054748535156f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.166666671633720397949219f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.5f));
  u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
  // u * 2^q as two exact power-of-two products (SLEEF's vldexp2), not one scalef: same result
  const __m512i q1 = _mm512_srai_epi32(q, 1), q2 = _mm512_sub_epi32(q, q1);
  const auto pow2 = [](__m512i e) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(127)), 23)); };
  u = _mm512_mul_ps(_mm512_mul_ps(u, pow2(q1)), pow2(q2));
  u = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.f), _CMP_NLT_UQ), u);  // d < -104: 0
  u = _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(_mm512_set1_ps(100.f), d, _CMP_LT_OQ), _mm512_set1_ps(INFINITY));
  return _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(d, d, _CMP_UNORD_Q), _mm512_set1_ps(NAN));
}

inline __m512 load_bf16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// fp32 -> bf16 bits (in the low half of each 32-bit lane), rounded to nearest even with NaN as 0x7fc0,
// as c10::BFloat16 and torch's vectorized conversion do; integer arithmetic, because the AVX512-BF16
// conversion instructions flush subnormals to zero
inline __m512i bf16_bits(__m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}

inline __m512 from_bits(__m512i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)); }

inline void store_bf16(c10::BFloat16* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(x)));
}

inline __m512 silu(__m512 x) { return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), sleef_expf(_mm512_sub_ps(_mm512_setzero_ps(), x)))); }

}  // namespace
#endif

torch::Tensor silu_mul_bf16(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kBFloat16 && gate_up.stride(1) == 1,
              "silu_mul_bf16: bf16 [T, 2I] with a contiguous inner dim");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 64 == 0, "silu_mul_bf16: I must be a multiple of 32");
  auto out = torch::empty({rows, inter}, gate_up.options());
#if defined(__AVX512F__)
  const c10::BFloat16* in = gate_up.data_ptr<c10::BFloat16>();
  c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
  const int64_t stride = gate_up.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const c10::BFloat16* g = in + r * stride;
      const c10::BFloat16* u = g + inter;
      c10::BFloat16* orow = o + r * inter;
      for (int64_t i = 0; i < inter; i += 16)  // silu rounded to bf16, times up, rounded again
        store_bf16(orow + i, _mm512_mul_ps(from_bits(bf16_bits(silu(load_bf16(g + i)))), load_bf16(u + i)));
    }
  });
#else
  const auto halves = gate_up.chunk(2, -1);
  out.copy_(torch::silu(halves[0]) * halves[1]);
#endif
  return out;
}
