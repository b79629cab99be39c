// Scores of E2M1 keys (NVFP4 / MXFP4, token-major) in the codes' integer domain, as llama.cpp's CPU
// path scores q4_0 (`vec_dot_q4_0_q8_0`): the query is rounded to int8 once per call, per 16-value
// chunk and head, and dotted with the codes by AVX-512 VNNI (`vpdpbusd`, 4 products per lane), so no
// key is widened to floats. Twice an E2M1 value is an integer in [-12, 12]; a code becomes that plus
// 12 (unsigned, as vpdpbusd takes it) and the 12 * sum(q) it adds is taken off before the sum is
// scaled: score = sum_chunks (scale_chunk * q_scale_chunk / 2) * sum_i q8_i (2 e2m1_i).
//
// Layout: 16 rows at a time, each row's 32 code bytes (64 values) expanded to 64 unsigned bytes in
// one register (low nibbles, then high nibbles), the 16 registers transposed (register l holds dword
// l of every row), so one vpdpbusd takes 4 values of 16 rows against one broadcast dword of the
// query; chunk scales apply per 16 rows, not per row.
//
// Not the reference's sums: the query's rounding moves each score by up to ~0.4 % of |q_chunk|_max
// |k_chunk|_1 / 127 per chunk (the tests bound the attention output). Off unless
// KVSTRATA_KERNEL_SCORES=int8.
#pragma once

#include <cstdlib>
#include <cstring>

#include "codes.h"

namespace kv {
namespace {

#if KV_AVX512 && defined(__AVX512VNNI__) && !defined(KV_BUFFERED)
constexpr bool INT8_SCORES = true;
#else
constexpr bool INT8_SCORES = false;
#endif

// Whether KVSTRATA_KERNEL_SCORES asks for integer-domain scores (read once per kernel call: tests switch it).
inline bool int8_scores_asked() {
  const char* v = std::getenv("KVSTRATA_KERNEL_SCORES");
  return v && std::strcmp(v, "int8") == 0;
}

// Whether a key run is scored in integers here: E2M1 codes per token, head_dim 64 / 128 / 256, at
// most 8 query heads per KV head, scale blocks of whole 16-value chunks.
inline bool int8_scorable(const Run& r, int d, int G) {
  if (!INT8_SCORES || r.channel || G > 8 || (d != 64 && d != 128 && d != 256)) return false;
  return (r.kind == NVFP4 || r.kind == MXFP4) && r.block >= 16 && (r.block & (r.block - 1)) == 0;
}

// Every E8M0 scale byte's value (MXFP4's scales are looked up as NVFP4's scaled table is)
struct E8M0Table {
  float v[256];
  E8M0Table() {
    for (int x = 0; x < 256; x++) v[x] = e8m0((uint8_t)x);
  }
};
inline const E8M0Table E8M0;

// A query group rounded for int8 scoring: per head g and 16-value chunk c, 4 dwords of int8 in the
// order the expanded codes hold values (see expand32), the scale that multiplies their sums (the
// int8 step over 2) and -12 * their sum (the unsigned offset's share).
struct QInt8 {
  int32_t dw[8][MAX_DIM / 16][4];
  int32_t offset[8][MAX_DIM / 16];
  float scale[8][MAX_DIM / 16];
};

inline void quantize_query(const float* q, int G, int d, QInt8& out) {
  // the values of chunk c that dword j of its 4 holds: even values of its halves, then odd ones
  static constexpr int order[4][4] = {{0, 2, 4, 6}, {8, 10, 12, 14}, {1, 3, 5, 7}, {9, 11, 13, 15}};
  for (int g = 0; g < G; g++)
    for (int c = 0; c < d / 16; c++) {
      const float* x = q + g * d + 16 * c;
      float amax = 0.f;
      for (int i = 0; i < 16; i++) amax = std::max(amax, std::fabs(x[i]));
      const float step = amax > 0.f ? amax / 127.f : 0.f;
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int sum = 0;
      for (int j = 0; j < 4; j++) {
        uint32_t word = 0;
        for (int e = 0; e < 4; e++) {
          const int v = std::max(-127, std::min(127, (int)std::lrint(x[order[j][e]] * inv)));
          sum += v;
          word |= (uint32_t)(uint8_t)(int8_t)v << (8 * e);
        }
        out.dw[g][c][j] = (int32_t)word;
      }
      out.offset[g][c] = -12 * sum;
      out.scale[g][c] = step * 0.5f;
    }
}

#if KV_AVX512 && defined(__AVX512VNNI__)
// 16x16 dword transpose: r[j] holds row j's 16 dwords -> r[l] holds dword l of rows 0..15.
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; i++) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 4; i++) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0xdd);
    t[8 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0xdd);
  }
  for (int i = 0; i < 4; i++) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
    r[4 + i] = _mm512_shuffle_i32x4(t[4 + i], t[12 + i], 0x88);
    r[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xdd);
    r[12 + i] = _mm512_shuffle_i32x4(t[4 + i], t[12 + i], 0xdd);
  }
}

// 32 code bytes (64 values) -> 64 unsigned bytes 2 e2m1 + 12: dword l < 8 the low nibbles of bytes
// 4l .. 4l + 3 (values 8l, +2, +4, +6), dword 8 + l their high nibbles (8l + 1, +3, +5, +7).
inline __m512i expand32(const uint8_t* p, __m512i lut) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(b), _mm256_srli_epi16(b, 4), 1);
  return _mm512_shuffle_epi8(lut, _mm512_and_si512(z, _mm512_set1_epi8(0x0f)));
}

// s[g * TILE + i] = q_g . k_i for the n rows (rows[i], or row0 + i) of an E2M1 key run, in integers.
template <int D, int G>
inline void int8_scores_dg(const Run& r, int64_t b, int64_t h, const int64_t* rows, int64_t row0, int n,
                           const QInt8& qi, float* s) {
  const float* table = r.kind == NVFP4 ? r.scaled : E8M0.v;
  // 2 e2m1 + 12 for codes 0 .. 15 (0, 1, 2, 3, 4, 6, 8, 12, then their negatives), in every 128-bit lane
  const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  int shift = 0;  // log2(chunks per scale block)
  while ((16 << shift) < r.block) shift++;
  const uint8_t* cb = r.codes + b * r.cs[0] + h * r.cs[1];
  const uint8_t* sb = r.scales + b * r.ss[0] + h * r.ss[1];
  const int per_piece = std::max(1, 4 >> shift);  // scale bytes per 64 values
  for (int i = 0; i < n; i += 16) {
    const int m = std::min(16, n - i);
    const uint8_t* crow[16];
    const uint8_t* srow[16];
    for (int j = 0; j < 16; j++) {  // rows past the tile's end repeat its last (their scores are dropped)
      const int64_t t = rows ? rows[i + std::min(j, m - 1)] : row0 + i + std::min(j, m - 1);
      crow[j] = cb + t * r.cs[2];
      srow[j] = sb + t * r.ss[2];
    }
    __m512 f[G];
    for (int g = 0; g < G; g++) f[g] = _mm512_setzero_ps();
    for (int z = 0; z < D / 64; z++) {
      __m512i k[16];
      alignas(64) uint32_t sc[16];
      for (int j = 0; j < 16; j++) {
        k[j] = expand32(crow[j] + 32 * z, lut);
        const uint8_t* p = srow[j] + ((4 * z) >> shift);
        uint32_t w = p[0];
        if (per_piece >= 2) w |= (uint32_t)p[1] << 8;
        if (per_piece == 4) w |= (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
        sc[j] = w;
      }
      transpose16(k);
      const __m512i words = _mm512_load_si512(sc);
      for (int jj = 0; jj < 4; jj++) {
        const int c = 4 * z + jj;
        const __m512i idx = _mm512_and_si512(_mm512_srli_epi32(words, 8 * (jj >> shift)), _mm512_set1_epi32(0xff));
        const __m512 scale = _mm512_i32gather_ps(idx, table, 4);
        for (int g = 0; g < G; g++) {
          __m512i acc = _mm512_set1_epi32(qi.offset[g][c]);
          acc = _mm512_dpbusd_epi32(acc, k[2 * jj], _mm512_set1_epi32(qi.dw[g][c][0]));
          acc = _mm512_dpbusd_epi32(acc, k[2 * jj + 1], _mm512_set1_epi32(qi.dw[g][c][1]));
          acc = _mm512_dpbusd_epi32(acc, k[8 + 2 * jj], _mm512_set1_epi32(qi.dw[g][c][2]));
          acc = _mm512_dpbusd_epi32(acc, k[9 + 2 * jj], _mm512_set1_epi32(qi.dw[g][c][3]));
          f[g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(scale, _mm512_set1_ps(qi.scale[g][c])), f[g]);
        }
      }
    }
    for (int g = 0; g < G; g++) _mm512_mask_storeu_ps(s + g * TILE + i, (__mmask16)((1u << m) - 1), f[g]);
  }
}

template <int D>
inline void int8_scores_d(const Run& r, int64_t b, int64_t h, const int64_t* rows, int64_t row0, int n, int G,
                          const QInt8& qi, float* s) {
  switch (G) {
    case 1: int8_scores_dg<D, 1>(r, b, h, rows, row0, n, qi, s); break;
    case 2: int8_scores_dg<D, 2>(r, b, h, rows, row0, n, qi, s); break;
    case 3: int8_scores_dg<D, 3>(r, b, h, rows, row0, n, qi, s); break;
    case 4: int8_scores_dg<D, 4>(r, b, h, rows, row0, n, qi, s); break;
    case 5: int8_scores_dg<D, 5>(r, b, h, rows, row0, n, qi, s); break;
    case 6: int8_scores_dg<D, 6>(r, b, h, rows, row0, n, qi, s); break;
    case 7: int8_scores_dg<D, 7>(r, b, h, rows, row0, n, qi, s); break;
    default: int8_scores_dg<D, 8>(r, b, h, rows, row0, n, qi, s);
  }
}
#endif

// The tile's scores from an `int8_scorable` run's codes and a query rounded by quantize_query.
__attribute__((noinline)) void int8_scores(const Run& r, int64_t b, int64_t h, const int64_t* rows, int64_t row0,
                                           int n, int d, int G, const QInt8& qi, float* s) {
#if KV_AVX512 && defined(__AVX512VNNI__)
  if (d == 64) int8_scores_d<64>(r, b, h, rows, row0, n, G, qi, s);
  else if (d == 128) int8_scores_d<128>(r, b, h, rows, row0, n, G, qi, s);
  else int8_scores_d<256>(r, b, h, rows, row0, n, G, qi, s);
#else
  (void)r, (void)b, (void)h, (void)rows, (void)row0, (void)n, (void)d, (void)G, (void)qi, (void)s;
#endif
}

}  // namespace
}  // namespace kv
