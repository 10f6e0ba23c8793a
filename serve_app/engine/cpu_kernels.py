"""CPU paged-attention decode kernel (C++, built once per machine with torch's extension builder).

The reference path (gather the blocks, then `scaled_dot_product_attention`) copies every decode
request's whole context each layer and runs thousands of tiny attention problems; this kernel reads
K/V in place from the block tables, one (request, KV head) pair per task, with all query heads of
the group sharing each K/V row it loads (GQA). fp32 accumulation whatever the cache dtype.

`paged_decode_kernel()` returns the op, or None (with a warning) when it cannot be built; callers
then use the reference path. `python -m serve_app.engine.cpu_kernels` builds it ahead of time.
"""

from __future__ import annotations

import functools
import logging
import os

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

// fp32 view of one cache/query element; the bf16 case is a shift the compiler vectorizes
static inline float to_f32(float x) { return x; }
static inline float to_f32(c10::Half x) { return static_cast<float>(x); }
static inline float to_f32(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
static void decode_impl(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                        torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = H / Hkv, nb = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int64_t q_b = q.stride(0), q_h = q.stride(1), o_b = out.stride(0), o_h = out.stride(1);
  const int64_t row = Hkv * D;  // elements between consecutive tokens of a block
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, kvh = task % Hkv;
      const int64_t len = lens[b];
      scores.resize(G * len);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = to_f32(qp[b * q_b + (kvh * G + g) * q_h + d]) * sc;
      // scores = q . k for every context token, block by block
      for (int64_t start = 0, blk = 0; start < len; start += bs, ++blk) {
        const int64_t n = std::min(bs, len - start);
        const T* kb = kp + (bt[b * nb + blk] * bs * Hkv + kvh) * D;
        for (int64_t i = 0; i < n; ++i) {
          const T* kr = kb + i * row;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qf.data() + g * D;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; ++d) s += qg[d] * to_f32(kr[d]);
            scores[g * len + start + i] = s;
          }
        }
      }
      // softmax numerators (vectorized exp), then p . v block by block
      std::fill(acc.begin(), acc.end(), 0.f);
      std::vector<float> inv(G);
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * len;
        float mx = -FLT_MAX;
        for (int64_t t = 0; t < len; ++t) mx = sg[t] > mx ? sg[t] : mx;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
          sg[t] = std::exp(sg[t] - mx);
          sum += sg[t];
        }
        inv[g] = 1.f / sum;
      }
      for (int64_t start = 0, blk = 0; start < len; start += bs, ++blk) {
        const int64_t n = std::min(bs, len - start);
        const T* vb = vp + (bt[b * nb + blk] * bs * Hkv + kvh) * D;
        for (int64_t i = 0; i < n; ++i) {
          const T* vr = vb + i * row;
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[g * len + start + i];
            float* ag = acc.data() + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p * to_f32(vr[d]);
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        T* og = op + b * o_b + (kvh * G + g) * o_h;
        for (int64_t d = 0; d < D; ++d) og[d] = static_cast<T>(acc[g * D + d] * inv[g]);
      }
    }
  });
}

void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q/out must be [B, H, D]");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && block_tables.is_contiguous(), "block_tables: int64");
  TORCH_CHECK(context_lens.scalar_type() == torch::kInt && context_lens.is_contiguous(), "context_lens: int32");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_impl<scalar_t>(out, q, k_cache, v_cache, block_tables, context_lens, scale);
  });
}
"""


@functools.cache
def paged_decode_kernel():
    """Build (or load the cached build of) the kernel; None if that fails."""
    try:
        from torch.utils.cpp_extension import load_inline

        module = load_inline(
            name="serve_app_paged_decode",
            cpp_sources=_SOURCE,
            functions=["paged_decode"],
            # fast-math for vectorized exp (glibc libmvec); finite-math off to keep inf/nan semantics
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only"],
            extra_ldflags=["-fopenmp"],
            verbose=bool(os.environ.get("SERVE_APP_VERBOSE_BUILD")),
        )
    except Exception as exc:  # no compiler, no ninja, ...: the reference path still works
        logger.warning("CPU paged-attention kernel unavailable (%s); using the torch reference path", exc)
        return None
    return module.paged_decode


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print("[kernel] building the CPU paged-attention kernel (about a minute the first time) ...", flush=True)
    print("[kernel] ready" if paged_decode_kernel() is not None else "[kernel] unavailable: reference path will be used")
