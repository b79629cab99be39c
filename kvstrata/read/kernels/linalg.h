// Vector arithmetic of the decode kernels over float32 tiles: dot products of a query with many
// rows, probability-weighted sums of rows, the max of a tile and exp for softmax. AVX-512, AVX2 and
// scalar paths as `codes.h` picks them.
#pragma once

#include "codes.h"

namespace kv {
namespace {

// exp(x) for x <= 0 (softmax after subtracting the max), branch-free so loops vectorize: 2^t with
// t = x log2(e) split into an integer n and f in [-0.5, 0.5], 2^f by a degree-6 polynomial
// (relative error < 2e-7), 2^n through the exponent bits; below -87 the result is 0.
inline float exp_neg(float x) {
  float t = std::max(x, -87.f) * 1.44269504088896341f;
  float n = std::nearbyint(t);
  float f = t - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

#if KV_AVX2
// The 8 horizontal sums of a[0..8) as one vector.
inline __m256 hsum8(const __m256* a) {
  __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

// s[i] = q . k[i] for the n rows of `kbuf` (row stride dp). Each row's sum is taken in one order
// that depends on d alone, never on where the row sits in the tile (the last rows of a tile are
// summed as a full block's, padded): a token scores the same whichever runs and tiles hold it, so a
// cache installed from stored blocks decodes as the one that prefilled them, bit for bit.
inline void dots(const float* q, const float* kbuf, int n, int d, int dp, float* s) {
#if KV_AVX512
  if (d % 16 == 0) {
    for (int i = 0; i < n; i += 16) {  // 16 rows at once: one accumulator each, folded to 8 lanes, then summed
      const int m = std::min(16, n - i);
      __m256 h[16];
      const float* k = kbuf + (int64_t)i * dp;
      for (int j = 0; j < 16; j++, k += dp) {  // one row pointer, constant offsets: no spilled addresses
        if (j >= m) {
          h[j] = _mm256_setzero_ps();
          continue;
        }
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
        for (int c = 16; c < d; c += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), _mm512_loadu_ps(k + c), a);
        h[j] = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
      }
      if (m == 16) {
        _mm256_storeu_ps(s + i, hsum8(h));
        _mm256_storeu_ps(s + i + 8, hsum8(h + 8));
      } else {
        float out[16];
        _mm256_storeu_ps(out, hsum8(h));
        _mm256_storeu_ps(out + 8, hsum8(h + 8));
        std::memcpy(s + i, out, sizeof(float) * m);
      }
    }
    return;
  }
#endif
#if KV_AVX2
  if (d % 8 == 0) {
    for (int i = 0; i < n; i += 8) {
      const int m = std::min(8, n - i);
      __m256 a[8];
      for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
      for (int c = 0; c < d; c += 8) {
        const __m256 qv = _mm256_loadu_ps(q + c);
        for (int j = 0; j < m; j++)
          a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kbuf + (int64_t)(i + j) * dp + c), a[j]);
      }
      if (m == 8) {
        _mm256_storeu_ps(s + i, hsum8(a));
      } else {
        float out[8];
        _mm256_storeu_ps(out, hsum8(a));
        std::memcpy(s + i, out, sizeof(float) * m);
      }
    }
    return;
  }
#endif
  for (int i = 0; i < n; i++) {
    const float* k = kbuf + (int64_t)i * dp;
    float acc = 0.f;
    for (int c = 0; c < d; c++) acc += q[c] * k[c];
    s[i] = acc;
  }
}

#if KV_AVX512
// acc[0..16R) += sum_i p[i] * v[i][0..16R): R output registers stay put over the rows.
template <int R>
inline void accumulate_cols(const float* p, const float* vbuf, int n, int dp, float* acc) {
  __m512 r[R];
  for (int j = 0; j < R; j++) r[j] = _mm512_loadu_ps(acc + 16 * j);
  for (int i = 0; i < n; i++) {
    const __m512 pv = _mm512_set1_ps(p[i]);
    const float* v = vbuf + (int64_t)i * dp;
    for (int j = 0; j < R; j++) r[j] = _mm512_fmadd_ps(pv, _mm512_loadu_ps(v + 16 * j), r[j]);
  }
  for (int j = 0; j < R; j++) _mm512_storeu_ps(acc + 16 * j, r[j]);
}
#endif

// acc[0..d) += sum_i p[i] * v[i] over the n rows of `vbuf` (row stride dp).
inline void accumulate(const float* p, const float* vbuf, int n, int d, int dp, float* acc) {
  int c0 = 0;
#if KV_AVX512
  for (; c0 + 128 <= d; c0 += 128) accumulate_cols<8>(p, vbuf + c0, n, dp, acc + c0);
  for (; c0 + 64 <= d; c0 += 64) accumulate_cols<4>(p, vbuf + c0, n, dp, acc + c0);
  for (; c0 + 16 <= d; c0 += 16) accumulate_cols<1>(p, vbuf + c0, n, dp, acc + c0);
#elif KV_AVX2
  for (; c0 + 64 <= d; c0 += 64) {  // 8 registers of the output stay put over the tile
    __m256 r[8];
    for (int j = 0; j < 8; j++) r[j] = _mm256_loadu_ps(acc + c0 + 8 * j);
    for (int i = 0; i < n; i++) {
      const __m256 pv = _mm256_set1_ps(p[i]);
      const float* v = vbuf + (int64_t)i * dp + c0;
      for (int j = 0; j < 8; j++) r[j] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 8 * j), r[j]);
    }
    for (int j = 0; j < 8; j++) _mm256_storeu_ps(acc + c0 + 8 * j, r[j]);
  }
#endif
  for (int i = 0; i < n; i++) {
    const float pi = p[i];
    const float* v = vbuf + (int64_t)i * dp;
#pragma omp simd
    for (int c = c0; c < d; c++) acc[c] += pi * v[c];
  }
}

#if KV_AVX512
// Every query head of the group at once over 64 columns: acc[g * d + c] += sum_i p[g * TILE + i] v[i][c]
// for c < 64; the value rows are loaded once for all GG heads (GG * 4 registers held).
template <int GG>
inline void accumulate_heads64(const float* p, const float* vbuf, int n, int d, int dp, float* acc) {
  __m512 r[GG][4];
  for (int g = 0; g < GG; g++)
    for (int j = 0; j < 4; j++) r[g][j] = _mm512_loadu_ps(acc + g * d + 16 * j);
  for (int i = 0; i < n; i++) {
    const float* v = vbuf + (int64_t)i * dp;
    const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16), v2 = _mm512_loadu_ps(v + 32),
                 v3 = _mm512_loadu_ps(v + 48);
    for (int g = 0; g < GG; g++) {
      const __m512 pv = _mm512_set1_ps(p[g * TILE + i]);
      r[g][0] = _mm512_fmadd_ps(pv, v0, r[g][0]);
      r[g][1] = _mm512_fmadd_ps(pv, v1, r[g][1]);
      r[g][2] = _mm512_fmadd_ps(pv, v2, r[g][2]);
      r[g][3] = _mm512_fmadd_ps(pv, v3, r[g][3]);
    }
  }
  for (int g = 0; g < GG; g++)
    for (int j = 0; j < 4; j++) _mm512_storeu_ps(acc + g * d + 16 * j, r[g][j]);
}
#endif

// accumulate() for every query head g < G of the group (probabilities p[g * TILE + i], outputs
// acc[g * d ..]).
inline void accumulate_group(const float* p, int G, const float* vbuf, int n, int d, int dp, float* acc) {
#if KV_AVX512
  if (d % 64 == 0 && G <= 4) {
    for (int c0 = 0; c0 < d; c0 += 64) {
      switch (G) {
        case 1: accumulate_heads64<1>(p, vbuf + c0, n, d, dp, acc + c0); break;
        case 2: accumulate_heads64<2>(p, vbuf + c0, n, d, dp, acc + c0); break;
        case 3: accumulate_heads64<3>(p, vbuf + c0, n, d, dp, acc + c0); break;
        default: accumulate_heads64<4>(p, vbuf + c0, n, d, dp, acc + c0);
      }
    }
    return;
  }
#endif
  for (int g = 0; g < G; g++) accumulate(p + g * TILE, vbuf, n, d, dp, acc + g * d);
}

#if KV_AVX512
// channel_scores for a tile of n = 16 * nb tokens (nb <= 4) and GG query heads: GG x nb
// accumulators of 16 tokens each, the tile's channel rows loaded once for every head.
template <int GG>
inline void channel_scores_tile(const float* q, int d, const float* kT, int nb, float* s) {
  __m512 acc[GG][4];
  for (int g = 0; g < GG; g++)
    for (int j = 0; j < 4; j++) acc[g][j] = _mm512_setzero_ps();
  for (int c = 0; c < d; c++) {
    const float* kc = kT + c * TILE;
    __m512 k[4];
    for (int j = 0; j < 4; j++) k[j] = j < nb ? _mm512_loadu_ps(kc + 16 * j) : _mm512_setzero_ps();
    for (int g = 0; g < GG; g++) {
      const __m512 qv = _mm512_set1_ps(q[g * d + c]);
      for (int j = 0; j < 4; j++) acc[g][j] = _mm512_fmadd_ps(qv, k[j], acc[g][j]);
    }
  }
  for (int g = 0; g < GG; g++)
    for (int j = 0; j < nb; j++) _mm512_storeu_ps(s + g * TILE + 16 * j, acc[g][j]);
}
#endif

// s[g * TILE + i] = q_g . k_i for a tile of keys held transposed (kT[c * TILE + i], channel c of
// token i; KIVI keys grouped per channel) and the G query heads q[g * d ..].
// More than 4 heads go 4 at a time (a head's sums do not depend on the heads beside it).
inline void channel_scores(const float* q, int G, int d, const float* kT, int n, float* s) {
#if KV_AVX512
  if (n % 16 == 0 && n <= TILE) {
    const int nb = n / 16;
    for (int g0 = 0; g0 < G; g0 += 4) {
      const float* qg = q + g0 * d;
      float* sg = s + g0 * TILE;
      switch (std::min(4, G - g0)) {
        case 1: channel_scores_tile<1>(qg, d, kT, nb, sg); break;
        case 2: channel_scores_tile<2>(qg, d, kT, nb, sg); break;
        case 3: channel_scores_tile<3>(qg, d, kT, nb, sg); break;
        default: channel_scores_tile<4>(qg, d, kT, nb, sg);
      }
    }
    return;
  }
#endif
  for (int g = 0; g < G; g++) {
    float* sg = s + g * TILE;
    for (int i = 0; i < n; i++) sg[i] = 0.f;
    const float* qg = q + g * d;
    for (int c = 0; c < d; c++) {
      const float qc = qg[c];
      const float* kc = kT + c * TILE;
#pragma omp simd
      for (int i = 0; i < n; i++) sg[i] += qc * kc[i];
    }
  }
}

// max(x[0..n)), -inf when n = 0
inline float max_of(const float* x, int n) {
  float m = -std::numeric_limits<float>::infinity();
  int i = 0;
#if KV_AVX512
  __m512 mv = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(x + i));
  m = _mm512_reduce_max_ps(mv);
#endif
  for (; i < n; i++) m = std::max(m, x[i]);
  return m;
}

}  // namespace
}  // namespace kv
