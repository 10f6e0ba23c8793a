// Row-wise argmax of fp32 logits on CPU: greedy sampling's one pass over [S, vocab].
//
// argmax_rows(logits [S, V] float32, contiguous) -> int64 [S], as torch.argmax(dim=-1): the first
// index of the maximum, and the first NaN where a row has one. torch's reduction reads ~7 GB/s here
// (1.8 ms for 64 x 49,152 logits, 3% of a decode step); this one streams at memory speed, rows in
// parallel.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cfloat>
#include <cmath>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

int64_t argmax_scalar(const float* row, int64_t n) {
  float best = -INFINITY;
  int64_t at = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(row[i])) return i;
    if (row[i] > best) {
      best = row[i];
      at = i;
    }
  }
  return at;
}

#if defined(__AVX512F__)
// Per lane: the largest value and the first index holding it (a strictly greater value replaces it);
// then the smallest index among the lanes at the overall maximum. A NaN sends the row to the scalar
// loop, which returns the first one.
int64_t argmax_avx512(const float* row, int64_t n) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i best_at = _mm512_setzero_si512();
  __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 valid = static_cast<__mmask16>(n - i >= 16 ? 0xFFFF : (1u << (n - i)) - 1);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), valid, row + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, greater, v);
    best_at = _mm512_mask_mov_epi32(best_at, greater, at);
    at = _mm512_add_epi32(at, step);
  }
  if (nan) return argmax_scalar(row, n);
  const float top = _mm512_reduce_max_ps(best);
  const __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  // index vectors only hold int32: fine for any vocabulary
  return _mm512_mask_reduce_min_epi32(at_top, best_at);
}
#endif

}  // namespace

torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "argmax_rows: contiguous float32 [S, V] only");
  TORCH_CHECK(logits.size(1) > 0 && logits.size(1) < INT32_MAX, "argmax_rows: 0 < V < 2^31");
  const int64_t rows = logits.size(0), n = logits.size(1);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
#if defined(__AVX512F__)
      o[r] = argmax_avx512(x + r * n, n);
#else
      o[r] = argmax_scalar(x + r * n, n);
#endif
    }
  });
  return out;
}
