// Scores and value sums straight from a token-major run's codes, 16 values at a time in registers
// (AVX-512): no tile of decoded floats is written and read back. Each chunk of 16 values is computed
// by the very instructions `decode_tile` uses, and the sums are taken in `dots` / `accumulate_group`'s
// order, so every score and output equals the buffered path's bit for bit (tests compare them).
#pragma once

#include <type_traits>

#include "codes.h"
#include "linalg.h"

namespace kv {
namespace {

#if KV_AVX512
// Row t's values 16c .. 16c + 15 of one run at (b, h), for codecs whose scale blocks hold whole
// 16-value chunks (`fusable`).
template <int KIND>
struct Chunks {
  const Run& r;
  const uint8_t *cb, *sb, *mb, *c = nullptr, *s = nullptr, *m = nullptr;
  __m512 table;
  int shift = 0;  // log2(chunks per scale block)
  Chunks(const Run& run, int64_t b, int64_t h)
      : r(run), cb(run.codes + b * run.cs[0] + h * run.cs[1]),
        sb(run.scales ? run.scales + b * run.ss[0] + h * run.ss[1] : nullptr),
        mb(run.mins ? run.mins + b * run.ms[0] + h * run.ms[1] : nullptr), table(_mm512_loadu_ps(T.e2m1)) {
    while ((16 << shift) < run.block) shift++;
  }
  void row(int64_t t) {
    c = cb + t * r.cs[2];
    s = sb ? sb + t * r.ss[2] : nullptr;
    m = mb ? mb + t * r.ms[2] : nullptr;
  }
  __m512 operator()(int j) const {
    const int k = j >> shift;  // the chunk's scale block
    if constexpr (KIND == BF16) {
      const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c) + j));
      return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    } else if constexpr (KIND == FP8) {
      const __m256i m7f = _mm256_set1_epi16(0x7f), m80 = _mm256_set1_epi16(0x80);
      const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * j)));
      const __m256i mag = _mm256_and_si256(w, m7f);
      const __m256i hb = _mm256_or_si256(_mm256_slli_epi16(mag, 7), _mm256_slli_epi16(_mm256_and_si256(w, m80), 8));
      const __m512 v = _mm512_mask_mov_ps(_mm512_cvtph_ps(hb), _mm256_cmpeq_epi16_mask(mag, m7f),
                                          _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
      return _mm512_mul_ps(v, _mm512_set1_ps(reinterpret_cast<const float*>(s)[k] * 256.f));
    } else if constexpr (KIND == NVFP4 || KIND == MXFP4) {
      const float scale = KIND == NVFP4 ? r.scaled[s[k]] : e8m0(s[k]);
      return _mm512_mul_ps(nibbles16(c + 8 * j, table), _mm512_set1_ps(scale));
    } else {  // INT4 / INT2: lo + code * scale
      const uint16_t* sh = reinterpret_cast<const uint16_t*>(s);
      const uint16_t* mh = reinterpret_cast<const uint16_t*>(m);
      return _mm512_fmadd_ps(int_codes16(c, KIND == INT4 ? 4 : 2, 16 * j), _mm512_set1_ps(half_to_float(sh[k])),
                             _mm512_set1_ps(half_to_float(mh[k])));
    }
  }
};

// Rows of a tile already decoded to floats (row stride dp), read as Chunks reads codes: the buffered
// path's scores go through the same loop.
struct Buffered {
  const float* base;
  int dp;
  const float* k = nullptr;
  void row(int64_t t) { k = base + t * dp; }
  __m512 operator()(int j) const { return _mm512_loadu_ps(k + 16 * j); }
};

// s[g * TILE + i] = q_g . row i for the n rows (rows[i], or row0 + i) of `ch` (Chunks or Buffered):
// each row's chunks read once for all G heads, summed as dots() sums.
template <int D, int G, class Src>
inline void fused_scores(Src ch, const int64_t* rows, int64_t row0, int n, const float* q, float* s) {
  constexpr int C = D / 16;
  alignas(64) float h[G][16 * 8];  // folded sums per head and row of a 16-row block
  for (int i = 0; i < n; i += 16) {
    const int m = std::min(16, n - i);
    for (int j = 0; j < 16; j++) {
      if (j >= m) {
        for (int g = 0; g < G; g++) _mm256_store_ps(h[g] + 8 * j, _mm256_setzero_ps());
        continue;
      }
      ch.row(rows ? rows[i + j] : row0 + i + j);
      __m512 k[C];
      for (int c = 0; c < C; c++) k[c] = ch(c);
      for (int g = 0; g < G; g++) {
        const float* qg = q + g * D;
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qg), k[0]);
        for (int c = 1; c < C; c++) a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), k[c], a);
        _mm256_store_ps(h[g] + 8 * j, _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)));
      }
    }
    for (int g = 0; g < G; g++) {
      __m256 hv[16];
      for (int j = 0; j < 16; j++) hv[j] = _mm256_load_ps(h[g] + 8 * j);
      float out[16];
      _mm256_storeu_ps(out, hsum8(hv));
      _mm256_storeu_ps(out + 8, hsum8(hv + 8));
      std::memcpy(s + g * TILE + i, out, sizeof(float) * m);
    }
  }
}

// acc[g * D + c] += sum_i p[g * TILE + i] v_i[c] for every head g < GG, W chunks (16W columns) at a
// time, each row's chunks decoded in registers: every column's sum is accumulate_heads64's (one fma
// per row, rows in order), whatever W and GG are.
template <int D, int GG, int W, int KIND>
inline void fused_accumulate(Chunks<KIND> ch, const int64_t* rows, int64_t row0, int n, const float* p, float* acc) {
  for (int c0 = 0; c0 < D / 16; c0 += W) {
    __m512 r[GG][W];
    for (int g = 0; g < GG; g++)
      for (int j = 0; j < W; j++) r[g][j] = _mm512_loadu_ps(acc + g * D + 16 * (c0 + j));
    for (int i = 0; i < n; i++) {
      ch.row(rows ? rows[i] : row0 + i);
      __m512 v[W];
      for (int j = 0; j < W; j++) v[j] = ch(c0 + j);
      for (int g = 0; g < GG; g++) {
        const __m512 pv = _mm512_set1_ps(p[g * TILE + i]);
        for (int j = 0; j < W; j++) r[g][j] = _mm512_fmadd_ps(pv, v[j], r[g][j]);
      }
    }
    for (int g = 0; g < GG; g++)
      for (int j = 0; j < W; j++) _mm512_storeu_ps(acc + g * D + 16 * (c0 + j), r[g][j]);
  }
}

// up to 4 heads 64 columns at a time, 5 to 8 heads 32 columns at a time (their accumulators stay in
// registers either way, and each value chunk is decoded once)
template <int D, int KIND>
inline void fused_accumulate_g(const Run& r, int64_t b, int64_t h, const int64_t* rows, int64_t row0, int n,
                               const float* p, int G, float* acc) {
  const Chunks<KIND> ch(r, b, h);
  switch (G) {
    case 1: fused_accumulate<D, 1, 4, KIND>(ch, rows, row0, n, p, acc); break;
    case 2: fused_accumulate<D, 2, 4, KIND>(ch, rows, row0, n, p, acc); break;
    case 3: fused_accumulate<D, 3, 4, KIND>(ch, rows, row0, n, p, acc); break;
    case 4: fused_accumulate<D, 4, 4, KIND>(ch, rows, row0, n, p, acc); break;
    case 5: fused_accumulate<D, 5, 2, KIND>(ch, rows, row0, n, p, acc); break;
    case 6: fused_accumulate<D, 6, 2, KIND>(ch, rows, row0, n, p, acc); break;
    case 7: fused_accumulate<D, 7, 2, KIND>(ch, rows, row0, n, p, acc); break;
    default: fused_accumulate<D, 8, 2, KIND>(ch, rows, row0, n, p, acc);
  }
}
#endif

#if KV_AVX512 && !defined(KV_BUFFERED)
constexpr bool READS_IN_REGISTERS = true;
#else
constexpr bool READS_IN_REGISTERS = false;
#endif

// Whether a run's rows can be read in registers here: token-major, a head_dim of 64 / 128 / 256, at
// most 8 query heads per KV head (Qwen2.5's 6 and 7 included), and scale blocks of whole 16-value
// chunks (a power of two). A build with KV_BUFFERED (`KVSTRATA_KERNEL_ISA=buffered`) never does:
// the tests compare the two.
inline bool fusable(const Run& r, int d, int G) {
#if KV_AVX512
  if (!READS_IN_REGISTERS || r.channel || G > 8 || (d != 64 && d != 128 && d != 256)) return false;
  if (r.kind == BF16) return true;
  const bool pow2 = r.block >= 16 && (r.block & (r.block - 1)) == 0;
  return pow2 && (r.kind == FP8 || r.kind == NVFP4 || r.kind == MXFP4 || r.kind == INT4 || r.kind == INT2);
#else
  (void)r, (void)d, (void)G;
  return false;
#endif
}

#if KV_AVX512
template <int D, class Src>
inline void fused_scores_g(Src ch, const int64_t* rows, int64_t row0, int n, const float* q, int G, float* s) {
  switch (G) {
    case 1: fused_scores<D, 1, Src>(ch, rows, row0, n, q, s); break;
    case 2: fused_scores<D, 2, Src>(ch, rows, row0, n, q, s); break;
    case 3: fused_scores<D, 3, Src>(ch, rows, row0, n, q, s); break;
    case 4: fused_scores<D, 4, Src>(ch, rows, row0, n, q, s); break;
    case 5: fused_scores<D, 5, Src>(ch, rows, row0, n, q, s); break;
    case 6: fused_scores<D, 6, Src>(ch, rows, row0, n, q, s); break;
    case 7: fused_scores<D, 7, Src>(ch, rows, row0, n, q, s); break;
    default: fused_scores<D, 8, Src>(ch, rows, row0, n, q, s);
  }
}

// f(std::integral_constant<int, KIND>{}) for a fusable run's kind: one switch for every entry point
template <class F>
inline void by_kind(int kind, F f) {
  switch (kind) {
    case BF16: f(std::integral_constant<int, BF16>{}); break;
    case FP8: f(std::integral_constant<int, FP8>{}); break;
    case NVFP4: f(std::integral_constant<int, NVFP4>{}); break;
    case MXFP4: f(std::integral_constant<int, MXFP4>{}); break;
    case INT4: f(std::integral_constant<int, INT4>{}); break;
    default: f(std::integral_constant<int, INT2>{});
  }
}

template <int D>
inline void fused_scores_d(const Run& r, int64_t b, int64_t h, const int64_t* rows, int64_t row0, int n,
                           const float* q, int G, float* s) {
  by_kind(r.kind, [&](auto k) { fused_scores_g<D>(Chunks<decltype(k)::value>(r, b, h), rows, row0, n, q, G, s); });
}

template <int D>
inline void fused_accumulate_d(const Run& r, int64_t b, int64_t h, const int64_t* rows, int64_t row0, int n,
                               const float* p, int G, float* acc) {
  by_kind(r.kind, [&](auto k) { fused_accumulate_g<D, decltype(k)::value>(r, b, h, rows, row0, n, p, G, acc); });
}
#endif

#if KV_AVX512
// channel_scores over up to NB 16-token chunks (4 for up to 4 heads, else 2: the GG x NB accumulators
// stay in registers) of channel-grouped INT4 / INT2 keys decoded in registers: channel c's chunk j
// is `int_codes16 * scale + min` (decode_channel_group's instructions), decoded once for all GG
// heads, and feeds the same FMAs in the same order as channel_scores_tile, so the scores equal the
// buffered path's bit for bit; no [d, TILE] buffer is written and read back. One token per tile
// (a sparse read) takes the buffered path.
template <int GG, int NB = (GG <= 4 ? 4 : 2)>
inline void channel_scores_codes(const Run& r, int64_t b, int64_t h, int64_t t0, int nb, int d, int bits,
                                 const float* q, float* s) {
  __m512 acc[GG][NB];
  for (int g = 0; g < GG; g++)
    for (int j = 0; j < NB; j++) acc[g][j] = _mm512_setzero_ps();
  const uint8_t* cb = r.codes + b * r.cs[0] + h * r.cs[1];
  const uint8_t* sb = r.scales + b * r.ss[0] + h * r.ss[1];
  const uint8_t* mb = r.mins + b * r.ms[0] + h * r.ms[1];
  for (int c = 0; c < d; c++) {
    __m512 k[NB], vs = _mm512_setzero_ps(), vlo = vs;
    int64_t held = -1;  // the group whose scale and minimum vs / vlo hold (chunks of one group share them)
    for (int j = 0; j < NB; j++) {
      if (j >= nb) {
        k[j] = _mm512_setzero_ps();
        continue;
      }
      const int64_t t = t0 + 16 * j, blk = t / r.block;
      if (blk != held) {
        vs = _mm512_set1_ps(half_to_float(*reinterpret_cast<const uint16_t*>(sb + c * r.ss[2] + blk * r.ss[3])));
        vlo = _mm512_set1_ps(half_to_float(*reinterpret_cast<const uint16_t*>(mb + c * r.ms[2] + blk * r.ms[3])));
        held = blk;
      }
      k[j] = _mm512_fmadd_ps(int_codes16(cb + c * r.cs[2] + blk * r.cs[3], bits, (int)(t % r.block)), vs, vlo);
    }
    for (int g = 0; g < GG; g++) {
      const __m512 qv = _mm512_set1_ps(q[g * d + c]);
      for (int j = 0; j < NB; j++) acc[g][j] = _mm512_fmadd_ps(qv, k[j], acc[g][j]);
    }
  }
  for (int g = 0; g < GG; g++)
    for (int j = 0; j < nb; j++) _mm512_storeu_ps(s + g * TILE + 16 * j, acc[g][j]);
}
#endif

// The scores of a channel-grouped key tile [t0, t0 + n) from its codes, when this build reads codes in
// registers, the tile is whole 16-token chunks of INT4 / INT2 codes (each chunk inside one group) and
// G <= 8: up to 4 heads over the whole tile at once, 5-8 heads over half of it at a time (their
// accumulators stay in registers; each chunk is decoded once either way). False: the caller decodes
// the tile (decode_channel_tile) and scores the buffer.
__attribute__((noinline)) bool channel_scores_from_codes(const Run& r, int64_t b, int64_t h, int64_t t0, int n, int d,
                                                         const float* q, int G, float* s) {
#if KV_AVX512
  const int bits = int_bits(r.kind);
  if (!READS_IN_REGISTERS || bits == 3 || G > 8 || n % 16 || n > TILE || t0 % 16 || r.block % 16) return false;
  const int per = G <= 4 ? 4 : 2;  // chunks per pass (channel_scores_codes' NB)
  for (int j0 = 0; j0 < n / 16; j0 += per) {
    const int m = std::min(per, n / 16 - j0);
    const int64_t t = t0 + 16 * j0;
    float* sj = s + 16 * j0;
    switch (G) {
      case 1: channel_scores_codes<1>(r, b, h, t, m, d, bits, q, sj); break;
      case 2: channel_scores_codes<2>(r, b, h, t, m, d, bits, q, sj); break;
      case 3: channel_scores_codes<3>(r, b, h, t, m, d, bits, q, sj); break;
      case 4: channel_scores_codes<4>(r, b, h, t, m, d, bits, q, sj); break;
      case 5: channel_scores_codes<5>(r, b, h, t, m, d, bits, q, sj); break;
      case 6: channel_scores_codes<6>(r, b, h, t, m, d, bits, q, sj); break;
      case 7: channel_scores_codes<7>(r, b, h, t, m, d, bits, q, sj); break;
      default: channel_scores_codes<8>(r, b, h, t, m, d, bits, q, sj);
    }
  }
  return true;
#else
  (void)r, (void)b, (void)h, (void)t0, (void)n, (void)d, (void)q, (void)G, (void)s;
  return false;
#endif
}

// s[g * TILE + i] = q_g . k[i] for every query head of the group over a decoded tile (row stride dp);
// the same sums as dots() per head.
__attribute__((noinline)) void dots_group(const float* q, int G, const float* kbuf, int n, int d, int dp, float* s) {
#if KV_AVX512
  if (G <= 8 && (d == 64 || d == 128 || d == 256)) {
    const Buffered src{kbuf, dp};
    if (d == 64) fused_scores_g<64>(src, nullptr, 0, n, q, G, s);
    else if (d == 128) fused_scores_g<128>(src, nullptr, 0, n, q, G, s);
    else fused_scores_g<256>(src, nullptr, 0, n, q, G, s);
    return;
  }
#endif
  for (int g = 0; g < G; g++) dots(q + g * d, kbuf, n, d, dp, s + g * TILE);
}

// The tile's scores (s[g * TILE + i]) / value sums (acc[g * d ..]) from a `fusable` run's codes. Kept
// out of line: inlined, their many instantiations changed how the compiler laid out the buffered
// paths beside them (KIVI tiles ran 1.2x slower).
__attribute__((noinline)) void scores_from_codes(const Run& r, int64_t b, int64_t h, const int64_t* rows, int64_t row0, int n, int d,
                              const float* q, int G, float* s) {
#if KV_AVX512
  if (d == 64) fused_scores_d<64>(r, b, h, rows, row0, n, q, G, s);
  else if (d == 128) fused_scores_d<128>(r, b, h, rows, row0, n, q, G, s);
  else fused_scores_d<256>(r, b, h, rows, row0, n, q, G, s);
#else
  (void)r, (void)b, (void)h, (void)rows, (void)row0, (void)n, (void)d, (void)q, (void)G, (void)s;
#endif
}

__attribute__((noinline)) void accumulate_from_codes(const Run& r, int64_t b, int64_t h, const int64_t* rows, int64_t row0, int n,
                                  int d, const float* p, int G, float* acc) {
#if KV_AVX512
  if (d == 64) fused_accumulate_d<64>(r, b, h, rows, row0, n, p, G, acc);
  else if (d == 128) fused_accumulate_d<128>(r, b, h, rows, row0, n, p, G, acc);
  else fused_accumulate_d<256>(r, b, h, rows, row0, n, p, G, acc);
#else
  (void)r, (void)b, (void)h, (void)rows, (void)row0, (void)n, (void)d, (void)p, (void)G, (void)acc;
#endif
}

}  // namespace
}  // namespace kv
