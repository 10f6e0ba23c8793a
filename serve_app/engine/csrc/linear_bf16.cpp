// bf16 projections on CPU with AVX512-BF16: y = x @ w^T (+ bias), fp32 accumulation over k in order,
// rounded to bf16 as torch rounds. oneDNN (F.linear) sums in another order: about one output in 10^4
// rounds the other way, by one bf16 ulp.
//
//   pack_linear_bf16(w [N, K], interleave) -> packed [N / 16, K / 2, 16, 2]: for each block of 16
//     output columns, for each pair of k, the 16 columns' (w[n][2k], w[n][2k + 1]) side by side, so
//     one 64-byte load is the weight operand of one dot-product step for 16 columns. With
//     `interleave` the two halves of the rows (gate and up of a fused gate/up projection) alternate
//     block by block, as linear_silu_mul_bf16 reads them.
//   linear_bf16(x [M, K], packed, bias?) -> [M, N] bf16
//   linear_logits_bf16(x, packed) -> [M, N] fp32: the lm_head's fp32 accumulators as they are, never
//     rounded to bf16 (a bf16 step near a logit of 25 is 0.125: rounding made near-ties between
//     tokens exact ties, decided by token id rather than by the model)
//   linear_silu_mul_bf16(x, packed interleaved) -> [M, N / 2] bf16: silu(gate) * up of the fused
//     gate/up projection, rounded exactly where torch's linear, silu and mul round (SLEEF's expf, as
//     torch's vectorized silu uses it), without the [M, N] intermediate.
//
// Why not oneDNN's packed matmul (which the engine used before): at decode shapes (tens of rows) it
// was 10-40% slower than this plain kernel, and its weights are opaque. Each task is a tile of up to
// 48 output columns for all rows: the tile's weights (K x 48 bf16, ~55 KB at K = 576) stay in L2
// while 8-row groups of x stream past them, 24 accumulators in registers, x broadcast pair by pair.
// Machines with AMX keep oneDNN, whose AMX kernels are several times faster at prefill shapes.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>

#if defined(__AVX512BF16__)
#include <immintrin.h>
constexpr bool kCompiled = true;

namespace {

constexpr int64_t kRowsPerGroup = 8;
constexpr int64_t kBlocksPerTile = 3;

enum class Epilogue { kBf16, kLogits, kSiluMul };

// fp32 -> bf16 bits (low half of each lane), round to nearest even, NaN as 0x7fc0: c10::BFloat16's
// rounding, in integer arithmetic because the AVX512-BF16 conversion flushes subnormals to zero.
inline __m512i bf16_bits(__m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}
inline __m512 from_bits(__m512i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)); }
inline __m512 round_bf16(__m512 x) { return from_bits(bf16_bits(x)); }
inline void store_bf16(void* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(x)));
}

// SLEEF's xexpf (the u10 variant torch's Vectorized<float>::exp calls), 16 lanes, step by step
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
inline __m512 silu(__m512 x) {
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), sleef_expf(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

struct Problem {
  const uint32_t* x;    // [M, K / 2] bf16 pairs
  int64_t ldx;          // pairs between rows of x
  const uint32_t* w;    // packed
  int64_t K2;           // pairs per row = 32-bit words per block row
  int64_t block;        // words per 16-column block
  const uint16_t* bias;  // [N] bf16 or null
  void* y;
  int64_t ldy;          // elements between rows of y
};

// R rows x NV blocks of 16 columns: acc[r][v] over every k, then the epilogue. For kSiluMul, NV is 2
// (a gate block, then its up block) and the 16 outputs land at column `col` of y.
template <int R, int NV, Epilogue E>
inline void tile(const Problem& p, const uint32_t* x, const uint32_t* w, int64_t row, int64_t col) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < p.K2; ++k) {
    __m512i wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = _mm512_loadu_si512(w + v * p.block + k * 16);
    for (int r = 0; r < R; ++r) {
      const __m512i xb = _mm512_set1_epi32(static_cast<int>(x[r * p.ldx + k]));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)wv[v], (__m512bh)xb);
    }
  }
  for (int r = 0; r < R; ++r) {
    if constexpr (E == Epilogue::kSiluMul) {
      const __m512 gate = round_bf16(acc[r][0]), up = round_bf16(acc[r][1]);
      store_bf16(static_cast<uint16_t*>(p.y) + (row + r) * p.ldy + col, _mm512_mul_ps(round_bf16(silu(gate)), up));
      continue;
    }
    for (int v = 0; v < NV; ++v) {
      __m512 a = acc[r][v];
      const int64_t c = col + 16 * v;
      if (p.bias) a = _mm512_add_ps(a, from_bits(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.bias + c)))));
      if constexpr (E == Epilogue::kLogits)
        _mm512_storeu_ps(static_cast<float*>(p.y) + (row + r) * p.ldy + c, a);
      else
        store_bf16(static_cast<uint16_t*>(p.y) + (row + r) * p.ldy + c, a);
    }
  }
}

template <int NV, Epilogue E>
inline void rows(const Problem& p, int64_t row, int64_t n, const uint32_t* w, int64_t col) {
  const uint32_t* x = p.x + row * p.ldx;
  switch (n) {
    case 1: return tile<1, NV, E>(p, x, w, row, col);
    case 2: return tile<2, NV, E>(p, x, w, row, col);
    case 3: return tile<3, NV, E>(p, x, w, row, col);
    case 4: return tile<4, NV, E>(p, x, w, row, col);
    case 5: return tile<5, NV, E>(p, x, w, row, col);
    case 6: return tile<6, NV, E>(p, x, w, row, col);
    case 7: return tile<7, NV, E>(p, x, w, row, col);
    default: return tile<8, NV, E>(p, x, w, row, col);
  }
}

// Every output column tile (NV blocks; fewer in the last) for all M rows, tiles split over threads.
template <Epilogue E>
void run(const Problem& p, int64_t M, int64_t num_blocks) {
  constexpr int64_t per_tile = E == Epilogue::kSiluMul ? 2 : kBlocksPerTile;
  const int64_t tiles = (num_blocks + per_tile - 1) / per_tile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b0 = t * per_tile, nb = std::min(per_tile, num_blocks - b0);
      const uint32_t* w = p.w + b0 * p.block;
      for (int64_t row = 0; row < M; row += kRowsPerGroup) {
        const int64_t n = std::min(kRowsPerGroup, M - row);
        if constexpr (E == Epilogue::kSiluMul) {
          rows<2, E>(p, row, n, w, 16 * t);
        } else if (nb == 3) {
          rows<3, E>(p, row, n, w, 16 * b0);
        } else if (nb == 2) {
          rows<2, E>(p, row, n, w, 16 * b0);
        } else {
          rows<1, E>(p, row, n, w, 16 * b0);
        }
      }
    }
  });
}

torch::Tensor linear_impl(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, Epilogue e) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
                  packed.size(2) == 16 && packed.size(3) == 2 && packed.is_contiguous(),
              "linear_bf16: x [M, K] bf16 and a weight from pack_linear_bf16");
  if (x.stride(1) != 1 || x.stride(0) % 2 != 0) x = x.contiguous();
  const int64_t M = x.size(0), num_blocks = packed.size(0), N = 16 * num_blocks;
  TORCH_CHECK(x.size(1) == 2 * packed.size(1), "linear_bf16: x has ", x.size(1), " columns, the weight ", 2 * packed.size(1));
  const int64_t out_cols = e == Epilogue::kSiluMul ? N / 2 : N;
  auto y = torch::empty({M, out_cols}, x.options().dtype(e == Epilogue::kLogits ? at::kFloat : at::kBFloat16));
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == N && e == Epilogue::kBf16, "linear_bf16: bias must be bf16 [N]");
    bias = bias->contiguous();
  }
  if (M == 0) return y;
  Problem p{reinterpret_cast<const uint32_t*>(x.data_ptr()), x.stride(0) / 2, reinterpret_cast<const uint32_t*>(packed.data_ptr()),
            packed.size(1), packed.size(1) * 16, bias ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr, y.data_ptr(),
            out_cols};
  switch (e) {
    case Epilogue::kBf16: run<Epilogue::kBf16>(p, M, num_blocks); break;
    case Epilogue::kLogits: run<Epilogue::kLogits>(p, M, num_blocks); break;
    case Epilogue::kSiluMul: run<Epilogue::kSiluMul>(p, M, num_blocks); break;
  }
  return y;
}

}  // namespace
#else
constexpr bool kCompiled = false;
#endif

bool linear_bf16_supported() { return kCompiled; }

torch::Tensor pack_linear_bf16(torch::Tensor w, bool interleave) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack_linear_bf16: w must be bf16 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % (interleave ? 32 : 16) == 0 && K % 2 == 0, "pack_linear_bf16: N must be a multiple of 16 (32 interleaved), K even");
  if (interleave)  // blocks of 16 rows: gate 0, up 0, gate 1, up 1, ...
    w = torch::stack({w.narrow(0, 0, N / 2).view({N / 32, 16, K}), w.narrow(0, N / 2, N / 2).view({N / 32, 16, K})}, 1).view({N, K});
  return w.contiguous().view({N / 16, 16, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

#if defined(__AVX512BF16__)
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  return linear_impl(x, packed, bias, Epilogue::kBf16);
}
torch::Tensor linear_logits_bf16(torch::Tensor x, torch::Tensor packed) { return linear_impl(x, packed, c10::nullopt, Epilogue::kLogits); }
torch::Tensor linear_silu_mul_bf16(torch::Tensor x, torch::Tensor packed) {
  TORCH_CHECK(packed.size(0) % 2 == 0, "linear_silu_mul_bf16: the weight must be packed interleaved");
  return linear_impl(x, packed, c10::nullopt, Epilogue::kSiluMul);
}
#else
torch::Tensor linear_bf16(torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>) { TORCH_CHECK(false, "linear_bf16: built without AVX512-BF16"); }
torch::Tensor linear_logits_bf16(torch::Tensor, torch::Tensor) { TORCH_CHECK(false, "linear_logits_bf16: built without AVX512-BF16"); }
torch::Tensor linear_silu_mul_bf16(torch::Tensor, torch::Tensor) { TORCH_CHECK(false, "linear_silu_mul_bf16: built without AVX512-BF16"); }
#endif
