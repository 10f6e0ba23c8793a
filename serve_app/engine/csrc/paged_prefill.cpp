// CPU paged attention for prompt chunks: each chunk's query tokens attend causally over their
// request's context, read in place from the block-structured cache through its block table (the
// chunk's own K/V are written there before attention).
//
//   out, q:        [T, H, D]                       (head_dim contiguous), bf16
//   k/v_cache:     [num_blocks, block_size, Hkv, D] (contiguous), bf16
//   block_tables:  [S, max_blocks] int64
//   query_start:   [S + 1] int32: chunk s owns rows query_start[s] .. query_start[s + 1] of q/out
//   start_pos:     [S] int32: the position of chunk s's first token; its row i attends over the
//                  positions 0 .. start_pos[s] + i
//
// The decode kernel attends such a chunk one row per token, each row reloading its context and
// reducing dot products row by row. Here a task is a tile of 16 query tokens of one chunk times the
// G query heads that share one KV head, so each 16-token chunk of K/V is read (and repacked) once
// per tile instead of once per row, and both products run on the AVX512-BF16 dot-product
// instruction with the 16 query tokens in the vector lanes:
// - scores: a K row's (k[2p], k[2p+1]) pairs broadcast against the tile's queries packed as pairs
//   (transposed once per tile), so a K row is read straight from the cache, not transposed;
// - online softmax in fp32, everything vertical (the per-query max and sum are lanes), the causal
//   mask only on the chunks that reach past the tile's first position;
// - P.V: the softmax weights of tokens (t, t+1) as bf16 pairs against V packed as pairs per
//   16-token chunk, output accumulators [d][query] in fp32, rescaled as the running max moves.
// Needs AVX512-BF16 and head_dim 64 or 128 (`paged_prefill_supported`); callers use the decode
// kernel's rows otherwise.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512BF16__)
constexpr bool kCompiled = true;
constexpr int64_t kTile = 16;  // query tokens per tile: the lanes of one vector

// e^x for 16 lanes, as paged_decode.cpp's exp16 (degree-6 polynomial of the reduced argument,
// scaled by 2^n; clamped below at -104, where e^x is 0 in fp32).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-104.f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// 16 bf16 values -> the low halves of 16 32-bit lanes
inline __m512i widen(const uint16_t* x) { return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))); }

// r[i][j] <-> r[j][i] for 16 x 16 32-bit lanes (unpack pairs, then pairs of pairs, then 128-bit lanes twice)
inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]), c = _mm512_castps_pd(t[i + 2]),
                  d = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + 4 + i], 0x88);
      t[h + 4 + i] = _mm512_shuffle_f32x4(r[h + i], r[h + 4 + i], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
  }
}

// Shapes and pointers shared by every task of one call; caches and q/out as bf16 bit patterns.
struct Problem {
  const uint16_t* q;
  const uint16_t* k;
  const uint16_t* v;
  uint16_t* out;
  const int64_t* tables;
  int64_t H, Hkv, G, D, bs, nb, q_t, q_h, o_t, o_h;
  int64_t row;    // elements between consecutive tokens of a block (Hkv * D)
  int64_t block;  // elements per block
  float scale;
};

struct Task {
  int64_t seq, row0, pos0, n, kvh;  // rows row0 .. row0 + n of q at positions pos0 .. pos0 + n
};

// Per-thread scratch (vectors of 16 lanes = the tile's query tokens).
struct Scratch {
  std::vector<uint32_t> qpk;  // [G][D/2][16]  queries as bf16 pairs
  std::vector<float> acc;     // [G][D][16]    P.V accumulators
  std::vector<float> sc;      // [G][16][16]   one chunk's scores: [head][token][query]
  std::vector<uint32_t> ppk;  // [G][8][16]    softmax weights of token pairs as bf16 pairs
  std::vector<uint32_t> vpk;  // [8][D]        V of token pairs as bf16 pairs
  std::vector<float> m, l;    // [G][16]       running max and sum
};

// sc[g][t] = q . k_t for the GH heads of qpk and the n (<= 16) K rows from k (`row` apart), TB
// tokens at a time with GH x TB accumulators in registers. Past n the last row is recomputed (no
// branch in the loop); those scores are never read.
template <int NP, int GH, int TB>
inline void chunk_scores(const uint32_t* qpk, const uint16_t* k, int64_t row, int64_t n, float* sc) {
  for (int64_t t = 0; t < n; t += TB) {
    const uint32_t* kr[TB];
    for (int u = 0; u < TB; ++u) kr[u] = reinterpret_cast<const uint32_t*>(k + std::min<int64_t>(t + u, n - 1) * row);
    __m512 a[TB][GH];
    for (int u = 0; u < TB; ++u)
      for (int g = 0; g < GH; ++g) a[u][g] = _mm512_setzero_ps();
    for (int p = 0; p < NP; ++p) {
      __m512bh qv[GH];
      for (int g = 0; g < GH; ++g) qv[g] = (__m512bh)_mm512_loadu_si512(qpk + (g * NP + p) * 16);
      for (int u = 0; u < TB; ++u) {
        const __m512bh kb = (__m512bh)_mm512_set1_epi32(static_cast<int>(kr[u][p]));
        for (int g = 0; g < GH; ++g) a[u][g] = _mm512_dpbf16_ps(a[u][g], qv[g], kb);
      }
    }
    for (int u = 0; u < TB; ++u)
      if (t + u < n)
        for (int g = 0; g < GH; ++g) _mm512_storeu_ps(sc + (g * 16 + t + u) * 16, a[u][g]);
  }
}

// acc[g][d] = acc[g][d] * alpha[g] + sum over the chunk's token pairs j of P[g][2j..2j+1] . V[2j..2j+1][d],
// DB output dimensions at a time with GH x DB accumulators in registers.
template <int NP, int GH, int DB>
inline void chunk_pv(float* acc, const __m512* alpha, const uint32_t* ppk, const uint32_t* vpk, int64_t pairs) {
  constexpr int D = 2 * NP;
  for (int d0 = 0; d0 < D; d0 += DB) {
    __m512 a[GH][DB];
    for (int g = 0; g < GH; ++g)
      for (int dd = 0; dd < DB; ++dd) a[g][dd] = _mm512_mul_ps(_mm512_loadu_ps(acc + (g * D + d0 + dd) * 16), alpha[g]);
    for (int64_t j = 0; j < pairs; ++j) {
      __m512bh pv[GH];
      for (int g = 0; g < GH; ++g) pv[g] = (__m512bh)_mm512_loadu_si512(ppk + (g * 8 + j) * 16);
      for (int dd = 0; dd < DB; ++dd) {
        const __m512bh vb = (__m512bh)_mm512_set1_epi32(static_cast<int>(vpk[j * D + d0 + dd]));
        for (int g = 0; g < GH; ++g) a[g][dd] = _mm512_dpbf16_ps(a[g][dd], pv[g], vb);
      }
    }
    for (int g = 0; g < GH; ++g)
      for (int dd = 0; dd < DB; ++dd) _mm512_storeu_ps(acc + (g * D + d0 + dd) * 16, a[g][dd]);
  }
}

// The query heads [h0, h0 + GH) of KV head t.kvh (their scratch at index hs = h0 - kvh * G) for
// one tile over its whole causal context.
template <int NP, int GH>
void attend_heads(const Problem& p, Scratch& s, const Task& t, int64_t h0) {
  constexpr int D = 2 * NP;
  constexpr int TB = GH == 4 ? 4 : 8;   // score accumulators: GH * TB <= 32 registers with the operands
  constexpr int DB = GH == 4 ? 4 : 8;   // P.V accumulators likewise
  const int64_t hs = h0 - t.kvh * p.G;
  uint32_t* qpk = s.qpk.data() + hs * NP * 16;
  float* acc = s.acc.data() + hs * D * 16;
  float* m = s.m.data() + hs * 16;
  float* l = s.l.data() + hs * 16;
  // queries as pairs, lane i = token i (0 past the tile's end): 16 x 16 transposes of the rows' pairs
  for (int g = 0; g < GH; ++g)
    for (int w = 0; w < NP; w += 16) {
      __m512 r[16];
      for (int64_t i = 0; i < kTile; ++i)
        r[i] = i < t.n ? _mm512_loadu_ps(p.q + (t.row0 + i) * p.q_t + (h0 + g) * p.q_h + 2 * w) : _mm512_setzero_ps();
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_storeu_ps(qpk + (g * NP + w + j) * 16, r[j]);
    }
  std::fill(acc, acc + GH * D * 16, 0.f);
  std::fill(m, m + GH * 16, -FLT_MAX);
  std::fill(l, l + GH * 16, 0.f);
  // lane i's position; -1 past the tile's end masks every key there (those lanes are never written)
  const __m512i qpos = _mm512_mask_add_epi32(_mm512_set1_epi32(-1), static_cast<__mmask16>((1u << t.n) - 1),
                                             _mm512_set1_epi32(static_cast<int>(t.pos0)),
                                             _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m512 scale = _mm512_set1_ps(p.scale);
  const int64_t kend = t.pos0 + t.n;  // keys 0 .. kend - 1
  const int64_t* table = p.tables + t.seq * p.nb;
  for (int64_t start = 0, blk = 0; start < kend; start += p.bs, ++blk) {
    const int64_t off = t.kvh * D;
    const uint16_t* kb = p.k + table[blk] * p.block + off;
    const uint16_t* vb = p.v + table[blk] * p.block + off;
    if (start + p.bs < kend) {  // the next block's rows of this KV head
      const uint16_t* kn = p.k + table[blk + 1] * p.block + off;
      const uint16_t* vn = p.v + table[blk + 1] * p.block + off;
      for (int64_t i = 0; i < std::min(p.bs, kend - start - p.bs); ++i)
        for (int64_t c = 0; c < D; c += 32) {
          __builtin_prefetch(kn + i * p.row + c);
          __builtin_prefetch(vn + i * p.row + c);
        }
    }
    for (int64_t c = 0; c < std::min(p.bs, kend - start); c += 16) {
      const int64_t t0 = start + c, n = std::min<int64_t>(16, std::min(p.bs, kend - start) - c);
      const uint16_t* kc = kb + c * p.row;
      const uint16_t* vc = vb + c * p.row;
      float* sc = s.sc.data();
      chunk_scores<NP, GH, TB>(qpk, kc, p.row, n, sc);
      // V of token pairs (2j, 2j + 1): one 32-bit lane per d, token 2j in the low half
      const int64_t pairs = (n + 1) / 2;
      for (int64_t j = 0; j < pairs; ++j) {
        const uint16_t* v0 = vc + 2 * j * p.row;
        for (int d = 0; d < D; d += 16) {
          const __m512i lo = widen(v0 + d);
          const __m512i hi = 2 * j + 1 < n ? _mm512_slli_epi32(widen(v0 + p.row + d), 16) : _mm512_setzero_si512();
          _mm512_storeu_si512(s.vpk.data() + j * D + d, _mm512_or_si512(lo, hi));
        }
      }
      const bool diag = t0 + n - 1 > t.pos0;  // some key here lies past some query of the tile
      __m512 alpha[GH];
      for (int g = 0; g < GH; ++g) {
        float* sg = sc + g * 256;
        __m512 mx = _mm512_loadu_ps(m + g * 16);
        const __m512 m_old = mx;
        for (int64_t i = 0; i < n; ++i) {
          __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sg + i * 16), scale);
          if (diag) x = _mm512_mask_mov_ps(x, _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(static_cast<int>(t0 + i)), qpos),
                                           _mm512_set1_ps(-FLT_MAX));
          _mm512_storeu_ps(sg + i * 16, x);
          mx = _mm512_max_ps(mx, x);
        }
        alpha[g] = exp16(_mm512_sub_ps(m_old, mx));
        _mm512_storeu_ps(m + g * 16, mx);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < pairs; ++j) {
          const __m512 e0 = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + 2 * j * 16), mx));
          const __m512 e1 = 2 * j + 1 < n ? exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + (2 * j + 1) * 16), mx)) : _mm512_setzero_ps();
          sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
          const __m512i w0 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e0));
          const __m512i w1 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e1));
          _mm512_storeu_si512(s.ppk.data() + ((hs + g) * 8 + j) * 16, _mm512_or_si512(w0, _mm512_slli_epi32(w1, 16)));
        }
        _mm512_storeu_ps(l + g * 16, _mm512_fmadd_ps(_mm512_loadu_ps(l + g * 16), alpha[g], sum));
      }
      chunk_pv<NP, GH, DB>(acc, alpha, s.ppk.data() + hs * 8 * 16, s.vpk.data(), pairs);
    }
  }
  // out[row i][h][d] = acc[g][d][i] / l[g][i]: 16 x 16 transposes back to rows
  for (int g = 0; g < GH; ++g)
    for (int d = 0; d < D; d += 16) {
      __m512 r[16];
      for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_ps(acc + (g * D + d + j) * 16);
      transpose16(r);
      for (int64_t i = 0; i < t.n; ++i) {
        const __m512 x = _mm512_mul_ps(r[i], _mm512_set1_ps(1.f / l[g * 16 + i]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.out + (t.row0 + i) * p.o_t + (h0 + g) * p.o_h + d),
                            (__m256i)_mm512_cvtneps_pbh(x));
      }
    }
}

template <int NP>
void attend_tile(const Problem& p, Scratch& s, const Task& t) {
  for (int64_t h = t.kvh * p.G; h < (t.kvh + 1) * p.G; h += 4) {
    switch (std::min<int64_t>(4, (t.kvh + 1) * p.G - h)) {
      case 1: attend_heads<NP, 1>(p, s, t, h); break;
      case 2: attend_heads<NP, 2>(p, s, t, h); break;
      case 3: attend_heads<NP, 3>(p, s, t, h); break;
      default: attend_heads<NP, 4>(p, s, t, h); break;
    }
  }
}
#else
constexpr bool kCompiled = false;
#endif

}  // namespace

bool paged_prefill_supported(int64_t head_dim) { return kCompiled && (head_dim == 64 || head_dim == 128); }

void paged_prefill(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor block_tables, torch::Tensor query_start, torch::Tensor start_pos, double scale) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q/out must be [T, H, D]");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16, "paged_prefill: bfloat16 only");
  TORCH_CHECK(paged_prefill_supported(q.size(2)), "paged_prefill: needs AVX512-BF16 and head_dim 64 or 128");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && block_tables.is_contiguous(), "block_tables: int64");
  TORCH_CHECK(query_start.scalar_type() == torch::kInt && start_pos.scalar_type() == torch::kInt && query_start.is_contiguous() &&
                  start_pos.is_contiguous(), "query_start, start_pos: int32");
  const int64_t S = start_pos.size(0);
  TORCH_CHECK(query_start.size(0) == S + 1 && block_tables.size(0) == S, "one block table, start and query range per chunk");
#if defined(__AVX512BF16__)
  Problem p;
  p.q = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  p.k = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  p.v = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  p.out = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  p.tables = block_tables.data_ptr<int64_t>();
  p.H = q.size(1);
  p.D = q.size(2);
  p.bs = k_cache.size(1);
  p.Hkv = k_cache.size(2);
  p.G = p.H / p.Hkv;
  p.nb = block_tables.size(1);
  p.q_t = q.stride(0);
  p.q_h = q.stride(1);
  p.o_t = out.stride(0);
  p.o_h = out.stride(1);
  p.row = p.Hkv * p.D;
  p.block = p.bs * p.row;
  p.scale = static_cast<float>(scale);
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int32_t* sp = start_pos.data_ptr<int32_t>();
  // Tasks are handed out one at a time (a static split would give one thread all of a long chunk's
  // late, costly tiles): the costliest chunks first, and a chunk's tiles of one KV head together,
  // last tile first, so the threads end on short tiles and a KV head's context is re-read while it
  // is still in this core's cache.
  std::vector<int64_t> order(S);
  for (int64_t seq = 0; seq < S; ++seq) {
    TORCH_CHECK(qs[seq] <= qs[seq + 1] && qs[seq + 1] <= q.size(0), "query_start: ranges within q");
    TORCH_CHECK(sp[seq] + qs[seq + 1] - qs[seq] <= p.nb * p.bs, "block table shorter than the chunk's context");
    order[seq] = seq;
  }
  auto cost = [&](int64_t seq) { const int64_t n = qs[seq + 1] - qs[seq]; return n * (2 * sp[seq] + n); };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost(a) > cost(b); });
  std::vector<Task> tasks;
  for (const int64_t seq : order)
    for (int64_t kvh = 0; kvh < p.Hkv; ++kvh)
      for (int64_t r = qs[seq] + (qs[seq + 1] - qs[seq] - 1) / kTile * kTile; r >= qs[seq]; r -= kTile)
        tasks.push_back({seq, r, sp[seq] + r - qs[seq], std::min<int64_t>(kTile, qs[seq + 1] - r), kvh});
  auto attend = p.D == 64 ? attend_tile<32> : attend_tile<64>;
  std::atomic<int64_t> next{0};
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tasks), 1, [&](int64_t, int64_t) {
    Scratch s;
    s.qpk.resize(p.G * (p.D / 2) * 16);
    s.acc.resize(p.G * p.D * 16);
    s.sc.resize(4 * 16 * 16);
    s.ppk.resize(p.G * 8 * 16);
    s.vpk.resize(8 * p.D);
    s.m.resize(p.G * 16);
    s.l.resize(p.G * 16);
    for (int64_t i = next++; i < num_tasks; i = next++) attend(p, s, tasks[i]);
  });
#endif
}
