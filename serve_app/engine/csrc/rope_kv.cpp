// RoPE on the q and k heads of a bf16 qkv projection, in place, and the k and v rows written to
// their KV-cache slots, in one pass per token (torch needs a gather of cos/sin, a roll, three
// elementwise ops and two index_copy_ calls per layer for the same).
//
// rope_write_kv_bf16(qkv, positions, cos, signed_sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)
//   qkv:          [T, (H + 2 Hkv) * D] bf16, rows contiguous (q heads, k heads, v heads)
//   positions:    [T] int64; cos, signed_sin: [max_positions, D] bf16 (sin with rotate_half's sign folded in)
//   k/v_cache:    [num_blocks, block_size, Hkv, D] bf16, contiguous; slot_mapping: [T] int64
// Rounds as HF's `x * cos + rotate_half(x) * sin` does in bf16 (each product, then the sum, rounded to
// bf16), so the result is bit-identical to the torch ops it replaces.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {
using bf16 = c10::BFloat16;

inline float f32(bf16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float round_bf16(float x) { return f32(bf16(x)); }

// one head of D values in place: x[d] <- bf16(bf16(x[d] cos[d]) + bf16(x[(d + D/2) % D] sin[d]))
inline void rotate_portable(bf16* x, const bf16* cos, const bf16* sin, int64_t D, float* tmp) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const float rolled = f32(x[d < half ? d + half : d - half]);
    tmp[d] = round_bf16(round_bf16(f32(x[d]) * f32(cos[d])) + round_bf16(rolled * f32(sin[d])));
  }
  for (int64_t d = 0; d < D; ++d) x[d] = bf16(tmp[d]);
}

#if defined(__AVX512BF16__)
inline __m512 load_bf16x16(const bf16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 round16(__m512 x) {  // to bf16 (round to nearest even) and back
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}

// the same for D a multiple of 32 (the halves are whole 16-lane vectors)
inline void rotate_avx512(bf16* x, const bf16* cos, const bf16* sin, int64_t D) {
  const int64_t half = D / 2;
  __m512 out[16];  // D <= 256
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 v = load_bf16x16(x + d);
    const __m512 rolled = load_bf16x16(x + (d < half ? d + half : d - half));
    const __m512 a = round16(_mm512_mul_ps(v, load_bf16x16(cos + d)));
    const __m512 b = round16(_mm512_mul_ps(rolled, load_bf16x16(sin + d)));
    out[d / 16] = _mm512_add_ps(a, b);
  }
  for (int64_t d = 0; d < D; d += 16)  // written after every read: the halves read each other
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + d), (__m256i)_mm512_cvtneps_pbh(out[d / 16]));
}
#endif
}  // namespace

void rope_write_kv_bf16(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                        torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping, int64_t num_heads,
                        int64_t num_kv_heads) {
  for (const auto& t : {qkv, cos, sin, k_cache, v_cache})
    TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.is_contiguous(), "rope_write_kv_bf16: contiguous bf16 tensors only");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong, "positions, slot_mapping: int64");
  const int64_t T = qkv.size(0), D = cos.size(1);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * D, "rope_write_kv_bf16: qkv row must be (H + 2 Hkv) * D");
  TORCH_CHECK(D % 2 == 0 && D <= 256, "rope_write_kv_bf16: even head_dim <= 256");
  TORCH_CHECK(k_cache.size(2) == num_kv_heads && k_cache.size(3) == D, "rope_write_kv_bf16: cache shape");
  positions = positions.contiguous();
  slot_mapping = slot_mapping.contiguous();
  bf16* base = qkv.data_ptr<bf16>();
  const bf16* cp = cos.data_ptr<bf16>();
  const bf16* sp = sin.data_ptr<bf16>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  bf16* kc = k_cache.data_ptr<bf16>();
  bf16* vc = v_cache.data_ptr<bf16>();
  const int64_t row = qkv.size(1), kv_row = num_kv_heads * D, rotated = num_heads + num_kv_heads;
#if defined(__AVX512BF16__)
  const bool vector = D % 32 == 0;
#endif
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    float tmp[256];
    for (int64_t t = begin; t < end; ++t) {
      bf16* r = base + t * row;
      const bf16* c = cp + pos[t] * D;
      const bf16* s = sp + pos[t] * D;
      for (int64_t h = 0; h < rotated; ++h) {
#if defined(__AVX512BF16__)
        if (vector) {
          rotate_avx512(r + h * D, c, s, D);
          continue;
        }
#endif
        rotate_portable(r + h * D, c, s, D, tmp);
      }
      std::memcpy(kc + slots[t] * kv_row, r + num_heads * D, kv_row * sizeof(bf16));
      std::memcpy(vc + slots[t] * kv_row, r + rotated * D, kv_row * sizeof(bf16));
    }
  });
}
