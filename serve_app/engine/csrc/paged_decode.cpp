// CPU paged-attention decode: one query token per request attends over its whole context, read in
// place from the block-structured cache through its block table.
//
//   out, q:        [B, H, D]                     (head_dim contiguous)
//   k/v_cache:     [num_blocks, block_size, Hkv, D] (contiguous)
//   block_tables:  [B, max_blocks] int64, context_lens: [B] int32, scale: softmax scale
//
// Decode attention is a stream over random KV blocks, so the loop order follows memory: blocks
// outermost (the next block is prefetched, and the next request's blocks are streamed in while this
// one is computed: Lookahead), then the KV heads of a token row, then the G query heads that share
// each KV head (GQA). Accumulation is fp32 whatever the cache dtype.
//
// Two implementations of the same loops:
// - portable C++ (any head_dim, any x86/ARM CPU);
// - AVX-512 for head_dim 64 and 128 (the common ones), chosen when the compiler targets it: scores
//   for 16 tokens at once (one transpose-reduce instead of 16 horizontal sums), bf16 caches read with
//   the AVX512-BF16 dot-product instruction when available (P.V too: two tokens per instruction,
//   the softmax weights packed to bf16 pairs once, the accumulators in registers for a chunk), K/V
//   rows converted to fp32 once per block and KV head otherwise, and a vectorized softmax (a scalar
//   exp per score was once half the kernel's compute).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float to_f32(float x) { return x; }
inline float to_f32(c10::Half x) { return static_cast<float>(x); }
inline float to_f32(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Prefetches go to L2 (locality 2: prefetcht1), not L1: a request's K and V blocks streamed ahead
// (tens of KB) would evict from L1 the rows being computed. On a Zen 4 machine the kernel over W1's
// decode shape (30 layers, 64 requests, context 192, cold caches) ran 26.6 ms with L1 prefetches and
// 13.1 ms with these.
constexpr int kPrefetchLocality = 2;

// Shapes and pointers shared by every task of one call.
template <typename T>
struct Problem {
  const T* q;
  const T* k;
  const T* v;
  T* out;
  const int64_t* block_tables;
  const int32_t* lens;
  int64_t H, D, G, Hkv, bs, nb;
  int64_t q_b, q_h, o_b, o_h;
  int64_t row;    // elements between consecutive tokens of a block (Hkv * D)
  int64_t block;  // elements per block
  float scale;

  const T* block_ptr(const T* cache, int64_t b, int64_t blk) const { return cache + block_tables[b * nb + blk] * block; }

  void prefetch_block(const T* cache, int64_t b, int64_t blk) const {
    if (blk * bs >= lens[b]) return;
    const char* p = reinterpret_cast<const char*>(block_ptr(cache, b, blk));
    const int64_t bytes = block * static_cast<int64_t>(sizeof(T));
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, kPrefetchLocality);
  }
};

// Streams the next request's K and V blocks toward the cache while the current one is computed.
// Decode attention does little arithmetic per byte, and a block table scatters a request over
// memory, so neither the hardware prefetcher nor a block-ahead prefetch hides DRAM latency (the
// kernel read 8 GB/s of a measured 25). The next request's lines are issued a share at a time, one
// share per 16-token chunk of the current request, so few loads are in flight at once.
template <typename T>
struct Lookahead {
  const Problem<T>* p = nullptr;
  int64_t b = 0, nblk = 0, blk = 0, off = 0, per_chunk = 0;
  int pass = 2;  // 0: K blocks, 1: V blocks, 2: done (or never started)

  // prefetch request `next` over the `chunks` chunk steps of the current request
  void start(const Problem<T>& problem, int64_t next, int64_t chunks) {
    p = &problem;
    b = next;
    nblk = (problem.lens[next] + problem.bs - 1) / problem.bs;
    blk = off = 0;
    pass = 0;
    const int64_t lines = 2 * nblk * ((problem.block * static_cast<int64_t>(sizeof(T)) + 63) / 64);
    per_chunk = (lines + chunks - 1) / std::max<int64_t>(chunks, 1);
  }

  inline void step() {
    if (pass >= 2) return;
    const int64_t bytes = p->block * static_cast<int64_t>(sizeof(T));
    for (int64_t n = 0; n < per_chunk && pass < 2; ++n) {
      __builtin_prefetch(reinterpret_cast<const char*>(p->block_ptr(pass == 0 ? p->k : p->v, b, blk)) + off, 0, kPrefetchLocality);
      off += 64;
      if (off < bytes) continue;
      off = 0;
      if (++blk < nblk) continue;
      blk = 0;
      ++pass;
    }
  }
};

// Per-task scratch, reused across the tasks a thread runs.
struct Scratch {
  std::vector<float> q;       // [H * D] fp32 queries (scaled on the portable path)
  std::vector<float> scores;  // [H * len] scores, then softmax numerators
  std::vector<float> acc;     // [H * D] output accumulators
  std::vector<float> rows;    // [16 * D] one block chunk of K or V rows in fp32
  std::vector<float> inv;     // [H] 1 / softmax denominator
  std::vector<uint32_t> wp;   // [H * pairs] softmax numerators as bf16 pairs (bf16 path)
};

// scores -> softmax numerators in place; inv[h] = 1 / sum
inline void softmax_rows(float* scores, float* inv, int64_t h0, int64_t h1, int64_t len) {
  for (int64_t h = h0; h < h1; ++h) {
    float* sh = scores + h * len;
    float mx = -FLT_MAX;
    for (int64_t t = 0; t < len; ++t) mx = std::max(mx, sh[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      sh[t] = std::exp(sh[t] - mx);
      sum += sh[t];
    }
    inv[h] = 1.f / sum;
  }
}

template <typename T>
void write_out(const Problem<T>& p, const Scratch& s, int64_t b, int64_t h0, int64_t h1) {
  for (int64_t h = h0; h < h1; ++h) {
    T* oh = p.out + b * p.o_b + h * p.o_h;
    for (int64_t d = 0; d < p.D; ++d) oh[d] = static_cast<T>(s.acc[h * p.D + d] * s.inv[h]);
  }
}

// ---- portable path -------------------------------------------------------------------------------
// KV heads [kv0, kv1) of request b
template <typename T>
void attend_portable(const Problem<T>& p, Scratch& s, int64_t b, int64_t kv0, int64_t kv1, Lookahead<T>&) {
  const int64_t D = p.D, G = p.G, len = p.lens[b], h0 = kv0 * G, h1 = kv1 * G;
  for (int64_t h = h0; h < h1; ++h)
    for (int64_t d = 0; d < D; ++d) s.q[h * D + d] = to_f32(p.q[b * p.q_b + h * p.q_h + d]) * p.scale;
  for (int64_t start = 0, blk = 0; start < len; start += p.bs, ++blk) {
    p.prefetch_block(p.k, b, blk + 1);
    const T* kb = p.block_ptr(p.k, b, blk);
    for (int64_t i = 0, n = std::min(p.bs, len - start); i < n; ++i)
      for (int64_t kvh = kv0; kvh < kv1; ++kvh) {
        const T* kr = kb + i * p.row + kvh * D;
        for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h) {
          const float* qh = s.q.data() + h * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qh[d] * to_f32(kr[d]);
          s.scores[h * len + start + i] = dot;
        }
      }
  }
  softmax_rows(s.scores.data(), s.inv.data(), h0, h1, len);
  std::fill(s.acc.begin() + h0 * D, s.acc.begin() + h1 * D, 0.f);
  for (int64_t start = 0, blk = 0; start < len; start += p.bs, ++blk) {
    p.prefetch_block(p.v, b, blk + 1);
    const T* vb = p.block_ptr(p.v, b, blk);
    for (int64_t i = 0, n = std::min(p.bs, len - start); i < n; ++i)
      for (int64_t kvh = kv0; kvh < kv1; ++kvh) {
        const T* vr = vb + i * p.row + kvh * D;
        for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h) {
          const float w = s.scores[h * len + start + i];
          float* ah = s.acc.data() + h * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ah[d] += w * to_f32(vr[d]);
        }
      }
  }
  write_out(p, s, b, h0, h1);
}

// ---- AVX-512 path --------------------------------------------------------------------------------
#if defined(__AVX512F__)
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const c10::BFloat16* x) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* x) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))); }

// r[i] = sum of the 16 lanes of v[i]: a transpose-add tree (45 instructions for 16 sums).
inline __m512 hsum16(const __m512* v) {
  __m512 a[8], c[4], e[2];
  for (int i = 0; i < 8; ++i)  // pairs: each 128-bit lane holds partial sums of v[2i], v[2i+1]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // lane j: (sum over lane j of) v[4i..4i+3]
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // halves: lanes (0+1, 2+3) of two groups
    e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// e^x for 16 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial
// (relative error < 2e-7 there), times 2^n by scalef, which also flushes underflow to 0.
// NaN propagates; x is clamped below at -104 (where e^x is 0 in fp32 anyway).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-104.f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2, high bits
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);    // ln2, the rest
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 tail_mask(int64_t n) { return static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1); }

// softmax_rows, 16 lanes at a time
inline void softmax_rows16(float* scores, float* inv, int64_t h0, int64_t h1, int64_t len) {
  for (int64_t h = h0; h < h1; ++h) {
    float* sh = scores + h * len;
    __m512 mx = _mm512_set1_ps(-FLT_MAX);
    for (int64_t t = 0; t < len; t += 16)
      mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, tail_mask(len - t), sh + t));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t += 16) {
      const __mmask16 k = tail_mask(len - t);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sh + t), m));
      _mm512_mask_storeu_ps(sh + t, k, e);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
    }
    inv[h] = 1.f / _mm512_reduce_add_ps(sum);
  }
}

#if defined(__AVX512BF16__)
constexpr bool kHasBf16Dot = true;
#else
constexpr bool kHasBf16Dot = false;
#endif

// q . k for up to 16 tokens of one chunk (k rows `stride` apart), NV = D / 16 vectors per row
template <typename T, int NV>
inline __m512 chunk_scores(const float* qf, const T* qraw, const T* k, int64_t stride, int64_t n) {
  __m512 part[16];
  if constexpr (std::is_same_v<T, c10::BFloat16> && kHasBf16Dot) {
#if defined(__AVX512BF16__)
    __m512i qv[NV / 2];  // q as bf16 pairs (the scale is applied to the sums)
    for (int j = 0; j < NV / 2; ++j) qv[j] = _mm512_loadu_si512(qraw + 32 * j);
    for (int64_t i = 0; i < 16; ++i) {
      __m512 a = _mm512_setzero_ps();
      if (i < n)
        for (int j = 0; j < NV / 2; ++j)
          a = _mm512_dpbf16_ps(a, (__m512bh)qv[j], (__m512bh)_mm512_loadu_si512(k + i * stride + 32 * j));
      part[i] = a;
    }
#endif
  } else {
    __m512 qv[NV];
    for (int j = 0; j < NV; ++j) qv[j] = _mm512_loadu_ps(qf + 16 * j);
    for (int64_t i = 0; i < 16; ++i) {
      __m512 a = _mm512_setzero_ps();
      if (i < n)
        for (int j = 0; j < NV; ++j) a = _mm512_fmadd_ps(qv[j], load16(k + i * stride + 16 * j), a);
      part[i] = a;
    }
  }
  return hsum16(part);
}

#if defined(__AVX512BF16__)
// The softmax numerators of heads [h0, h1) as bf16 pairs: wp[h * pairs + t / 2] = (w[t], w[t + 1]),
// zero past len, so a dot-product step weighs two tokens at once.
inline void pack_weight_pairs(Scratch& s, int64_t h0, int64_t h1, int64_t len, int64_t pairs) {
  for (int64_t h = h0; h < h1; ++h) {
    const float* w = s.scores.data() + h * len;
    uint32_t* out = s.wp.data() + h * pairs;
    for (int64_t t = 0; t < len; t += 32) {
      const int64_t n = std::min<int64_t>(32, len - t);
      const __m512 lo = _mm512_maskz_loadu_ps(static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1), w + t);
      const __m512 hi = n > 16 ? _mm512_maskz_loadu_ps(static_cast<__mmask16>(n >= 32 ? 0xFFFF : (1u << (n - 16)) - 1), w + t + 16)
                               : _mm512_setzero_ps();
      _mm512_storeu_si512(out + t / 2, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

// acc[g] += sum_i w[g][i] * v_i for GH heads sharing one KV head and the n (<= 16) rows of one chunk,
// two tokens per dot-product step: rows i and i+1 interleaved 16 bits at a time pair each v_i[d]
// with v_{i+1}[d], against the weight pair (w_i, w_{i+1}). The interleave permutes d within each
// 32-element group; acc keeps that order until unpermute_pairs. The accumulators stay in registers
// for the whole chunk.
template <int NV, int GH>
inline void pv_chunk(float* acc, int64_t acc_stride, const uint32_t* wp, int64_t wp_stride, const c10::BFloat16* v,
                     int64_t stride, int64_t n) {
  __m512 a[GH][NV];
  for (int g = 0; g < GH; ++g)
    for (int j = 0; j < NV; ++j) a[g][j] = _mm512_loadu_ps(acc + g * acc_stride + 16 * j);
  for (int64_t i = 0; i < n; i += 2) {
    const bool pair = i + 1 < n;
    __m512i lo[NV / 2], hi[NV / 2];
    for (int j = 0; j < NV / 2; ++j) {
      const __m512i x = _mm512_loadu_si512(v + i * stride + 32 * j);
      const __m512i y = pair ? _mm512_loadu_si512(v + (i + 1) * stride + 32 * j) : _mm512_setzero_si512();
      lo[j] = _mm512_unpacklo_epi16(x, y);
      hi[j] = _mm512_unpackhi_epi16(x, y);
    }
    for (int g = 0; g < GH; ++g) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(wp[g * wp_stride + i / 2]));
      for (int j = 0; j < NV / 2; ++j) {
        a[g][2 * j] = _mm512_dpbf16_ps(a[g][2 * j], (__m512bh)lo[j], w);
        a[g][2 * j + 1] = _mm512_dpbf16_ps(a[g][2 * j + 1], (__m512bh)hi[j], w);
      }
    }
  }
  for (int g = 0; g < GH; ++g)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + g * acc_stride + 16 * j, a[g][j]);
}

// The query heads [h0, h1) of one KV head over one chunk, at most four heads per pass.
template <int NV>
inline void accumulate_pv_bf16(Scratch& s, const c10::BFloat16* v, int64_t stride, int64_t n, int64_t h0, int64_t h1,
                               int64_t pairs, int64_t t0) {
  constexpr int64_t D = NV * 16;
  for (int64_t h = h0; h < h1; h += 4) {
    float* acc = s.acc.data() + h * D;
    const uint32_t* wp = s.wp.data() + h * pairs + t0 / 2;
    switch (std::min<int64_t>(4, h1 - h)) {
      case 1: pv_chunk<NV, 1>(acc, D, wp, pairs, v, stride, n); break;
      case 2: pv_chunk<NV, 2>(acc, D, wp, pairs, v, stride, n); break;
      case 3: pv_chunk<NV, 3>(acc, D, wp, pairs, v, stride, n); break;
      default: pv_chunk<NV, 4>(acc, D, wp, pairs, v, stride, n); break;
    }
  }
}

// Undo accumulate_pv_bf16's order: in group j, lane 4L+k of the low half holds d = 32j + 8L + k and
// of the high half d = 32j + 8L + 4 + k.
template <int NV>
inline void unpermute_pairs(float* acc, float* tmp) {
  for (int j = 0; j < NV / 2; ++j)
    for (int L = 0; L < 4; ++L)
      for (int k = 0; k < 4; ++k) {
        tmp[32 * j + 8 * L + k] = acc[32 * j + 4 * L + k];
        tmp[32 * j + 8 * L + 4 + k] = acc[32 * j + 16 + 4 * L + k];
      }
  std::memcpy(acc, tmp, NV * 16 * sizeof(float));
}
#else
template <int NV>
inline void accumulate_pv_bf16(Scratch&, const c10::BFloat16*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t) {}
inline void pack_weight_pairs(Scratch&, int64_t, int64_t, int64_t, int64_t) {}
template <int NV>
inline void unpermute_pairs(float*, float*) {}
#endif

template <typename T, int NV>
void attend_avx512(const Problem<T>& p, Scratch& s, int64_t b, int64_t kv0, int64_t kv1, Lookahead<T>& ahead) {
  constexpr int64_t D = NV * 16;
  constexpr bool bf16_dot = std::is_same_v<T, c10::BFloat16> && kHasBf16Dot;
  const int64_t G = p.G, len = p.lens[b], h0 = kv0 * G, h1 = kv1 * G;
  // the bf16 dot product takes q unscaled; the fp32 path folds the scale into q
  const __m512 post_scale = _mm512_set1_ps(bf16_dot ? p.scale : 1.f);
  for (int64_t h = h0; h < h1; ++h)
    for (int64_t d = 0; d < D; ++d) s.q[h * D + d] = to_f32(p.q[b * p.q_b + h * p.q_h + d]) * (bf16_dot ? 1.f : p.scale);
  for (int64_t start = 0, blk = 0; start < len; start += p.bs, ++blk) {
    p.prefetch_block(p.k, b, blk + 1);
    const T* kb = p.block_ptr(p.k, b, blk);
    for (int64_t c = 0; c < std::min(p.bs, len - start); c += 16) {
      const int64_t n = std::min<int64_t>(16, std::min(p.bs, len - start) - c);
      const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
      ahead.step();
      for (int64_t kvh = kv0; kvh < kv1; ++kvh) {
        const T* kr = kb + c * p.row + kvh * D;
        for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h) {
          const __m512 sc = chunk_scores<T, NV>(s.q.data() + h * D, p.q + b * p.q_b + h * p.q_h, kr, p.row, n);
          _mm512_mask_storeu_ps(s.scores.data() + h * len + start + c, valid, _mm512_mul_ps(sc, post_scale));
        }
      }
    }
  }
  softmax_rows16(s.scores.data(), s.inv.data(), h0, h1, len);
  const int64_t pairs = (len + 31) / 32 * 16;
  if constexpr (bf16_dot) pack_weight_pairs(s, h0, h1, len, pairs);
  std::fill(s.acc.begin() + h0 * D, s.acc.begin() + h1 * D, 0.f);
  for (int64_t start = 0, blk = 0; start < len; start += p.bs, ++blk) {
    p.prefetch_block(p.v, b, blk + 1);
    const T* vb = p.block_ptr(p.v, b, blk);
    for (int64_t c = 0; c < std::min(p.bs, len - start); c += 16) {
      const int64_t n = std::min<int64_t>(16, std::min(p.bs, len - start) - c);
      ahead.step();
      for (int64_t kvh = kv0; kvh < kv1; ++kvh) {
        const T* vr = vb + c * p.row + kvh * D;
        if constexpr (bf16_dot) {
          accumulate_pv_bf16<NV>(s, vr, p.row, n, kvh * G, (kvh + 1) * G, pairs, start + c);
          continue;
        }
        for (int64_t i = 0; i < n; ++i)  // fp32 once per row, shared by the G query heads
          for (int j = 0; j < NV; ++j) _mm512_storeu_ps(s.rows.data() + i * D + 16 * j, load16(vr + i * p.row + 16 * j));
        for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h) {
          float* ah = s.acc.data() + h * D;
          const float* w = s.scores.data() + h * len + start + c;
          __m512 acc[NV];
          for (int j = 0; j < NV; ++j) acc[j] = _mm512_loadu_ps(ah + 16 * j);
          for (int64_t i = 0; i < n; ++i) {
            const __m512 wi = _mm512_set1_ps(w[i]);
            for (int j = 0; j < NV; ++j) acc[j] = _mm512_fmadd_ps(wi, _mm512_loadu_ps(s.rows.data() + i * D + 16 * j), acc[j]);
          }
          for (int j = 0; j < NV; ++j) _mm512_storeu_ps(ah + 16 * j, acc[j]);
        }
      }
    }
  }
  if constexpr (bf16_dot)
    for (int64_t h = h0; h < h1; ++h) unpermute_pairs<NV>(s.acc.data() + h * D, s.rows.data());
  write_out(p, s, b, h0, h1);
}
#endif

template <typename T>
void decode_impl(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                 torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  Problem<T> p;
  p.q = q.data_ptr<T>();
  p.k = k_cache.data_ptr<T>();
  p.v = v_cache.data_ptr<T>();
  p.out = out.data_ptr<T>();
  p.block_tables = block_tables.data_ptr<int64_t>();
  p.lens = context_lens.data_ptr<int32_t>();
  const int64_t B = q.size(0);
  p.H = q.size(1);
  p.D = q.size(2);
  p.bs = k_cache.size(1);
  p.Hkv = k_cache.size(2);
  p.G = p.H / p.Hkv;
  p.nb = block_tables.size(1);
  p.q_b = q.stride(0);
  p.q_h = q.stride(1);
  p.o_b = out.stride(0);
  p.o_h = out.stride(1);
  p.row = p.Hkv * p.D;
  p.block = p.bs * p.row;
  p.scale = static_cast<float>(scale);

  auto attend = attend_portable<T>;
#if defined(__AVX512F__)
  if (p.D == 64) attend = attend_avx512<T, 4>;
  if (p.D == 128) attend = attend_avx512<T, 8>;
#endif
  // A task is one request's KV heads: all of them when requests alone keep every thread busy (each
  // block is then read front to back once), else one KV head per task.
  const int64_t heads_per_task = B >= 2 * at::get_num_threads() ? p.Hkv : 1;
  const int64_t tasks_per_request = p.Hkv / heads_per_task;
  at::parallel_for(0, B * tasks_per_request, 1, [&](int64_t begin, int64_t end) {
    Scratch s;
    s.q.resize(p.H * p.D);
    s.acc.resize(p.H * p.D);
    s.rows.resize(16 * p.D);
    s.inv.resize(p.H);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / tasks_per_request, kv0 = (task % tasks_per_request) * heads_per_task;
      s.scores.resize(p.H * p.lens[b]);
      s.wp.resize(p.H * ((p.lens[b] + 31) / 32 * 16));
      // whole-request tasks run requests back to back: stream in the next over both passes' chunks
      Lookahead<T> ahead;
      if (task + 1 < end && heads_per_task == p.Hkv) ahead.start(p, b + 1, 2 * ((p.lens[b] + 15) / 16));
      attend(p, s, b, kv0, kv0 + heads_per_task, ahead);
    }
  });
}

}  // namespace

void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q/out must be [B, H, D]");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(), "q and caches: one dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && block_tables.is_contiguous(), "block_tables: int64");
  TORCH_CHECK(context_lens.scalar_type() == torch::kInt && context_lens.is_contiguous(), "context_lens: int32");
  switch (q.scalar_type()) {
    case at::kFloat: return decode_impl<float>(out, q, k_cache, v_cache, block_tables, context_lens, scale);
    case at::kBFloat16: return decode_impl<c10::BFloat16>(out, q, k_cache, v_cache, block_tables, context_lens, scale);
    case at::kHalf: return decode_impl<c10::Half>(out, q, k_cache, v_cache, block_tables, context_lens, scale);
    default: TORCH_CHECK(false, "paged_decode: float32, bfloat16 or float16 only, got ", q.scalar_type());
  }
}

