// Encoded KV rows decoded to float32, for `decode_attention.cpp`.
//
// One path per instruction set, picked at build time: AVX-512 (4-bit codes looked up 16 at a time
// in a register-resident table, FP8 widened through the FP16 converter), AVX2 (8 at a time), and
// scalar tables for anything else. Every path decodes to the same floats as the scalar one: the
// scale products are the same single roundings, only their grouping into instructions differs.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define KV_AVX512 1
#else
#define KV_AVX512 0
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define KV_AVX2 1
#else
#define KV_AVX2 0
#endif

namespace kv {
namespace {  // one translation unit: everything inlines, nothing goes through the PLT

enum Kind { F32 = 0, BF16 = 1, FP8 = 2, NVFP4 = 3, MXFP4 = 4, INT4 = 5, INT2 = 6, INT3 = 7 };
constexpr int TILE = 64;
constexpr int MAX_DIM = 1024;
constexpr int MAX_GROUP = 4096;  // tokens per channel group of KIVI keys

inline const char* isa() { return KV_AVX512 ? "avx512" : KV_AVX2 ? "avx2" : "scalar"; }

struct Tables {
  float e4m3[256];
  float e2m1[16];
  float int4[256][2];  // a byte's two 4-bit codes, low bits first
  float int2[256][4];  // a byte's four 2-bit codes
  Tables() {
    const float mags[8] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
    for (int i = 0; i < 16; i++) e2m1[i] = (i & 8) ? -mags[i & 7] : mags[i & 7];
    for (int x = 0; x < 256; x++) {
      for (int j = 0; j < 2; j++) int4[x][j] = (float)((x >> (4 * j)) & 15);
      for (int j = 0; j < 4; j++) int2[x][j] = (float)((x >> (2 * j)) & 3);
      int e = (x >> 3) & 15, m = x & 7;
      float v = e ? std::ldexp(1.f + m / 8.f, e - 7) : std::ldexp(m / 8.f, -6);
      if ((x & 0x7f) == 0x7f) v = std::numeric_limits<float>::quiet_NaN();
      e4m3[x] = (x & 0x80) ? -v : v;
    }
  }
};
inline const Tables T;

inline float half_to_float(uint16_t h) {
#if defined(__F16C__) && (defined(__AVX2__) || defined(__AVX512F__))
  return _cvtsh_ss(h);  // one instruction, the value the bit arithmetic below gives
#else
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023, bits;
  if (exp == 0) {
    float v = std::ldexp((float)man, -24);
    std::memcpy(&bits, &v, 4);
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
#endif
}

inline float e8m0(uint8_t s) {  // 2^(s - 127), exact (s = 0 is 2^-127, a subnormal)
  if (s == 0) return std::ldexp(1.f, -127);
  uint32_t bits = (uint32_t)s << 23;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// One encoded run of one stream (K or V). Strides are in bytes; the two innermost dims of codes /
// scales / mins are contiguous.
struct Run {
  int kind = F32;
  bool channel = false;  // keys grouped per channel: codes [b, h, d, token_blocks, bytes]
  int64_t length = 0, skip = 0;
  int block = 0;  // elements per scale block (along head_dim, or along tokens when channel)
  float tscale = 1.f;
  const float* scaled = nullptr;  // NVFP4: T.e4m3[x] * tscale for every scale byte x (the same products)
  const uint8_t* codes = nullptr;
  const uint8_t* scales = nullptr;
  const uint8_t* mins = nullptr;
  int64_t cs[4] = {0, 0, 0, 0}, ss[4] = {0, 0, 0, 0}, ms[4] = {0, 0, 0, 0};
  int64_t visible() const { return length - skip; }
};

inline int int_bits(int kind) { return kind == INT4 ? 4 : kind == INT3 ? 3 : 2; }

// Integer codes of `n` elements (`bits` wide, one bit stream, low bits first) as floats; INT3
// packs 8 codes in 3 bytes, so `n` is a multiple of 8 there.
inline void int_codes(const uint8_t* p, int n, int bits, float* out) {
  if (bits == 4)
    for (int j = 0; j < n / 2; j++) std::memcpy(out + 2 * j, T.int4[p[j]], 8);
  else if (bits == 3)
    for (int j = 0; j < n / 8; j++) {
      const uint32_t w = p[3 * j] | (uint32_t)p[3 * j + 1] << 8 | (uint32_t)p[3 * j + 2] << 16;
      for (int i = 0; i < 8; i++) out[8 * j + i] = (float)((w >> (3 * i)) & 7);
    }
  else
    for (int j = 0; j < n / 4; j++) std::memcpy(out + 4 * j, T.int2[p[j]], 16);
}

#if KV_AVX512
// 16 four-bit codes (8 bytes, low nibble first) as indices into a 16-lane table; the lookup reads
// each dword's low 4 bits. With AVX512-VBMI one multishift puts code e's bits (4e ..) in dword e's low
// byte; otherwise byte j's 64-bit lane holds it in its low dword and, shifted by 28, its high nibble
// in the high dword. Both look up the same entries.
inline __m512 nibbles16(const uint8_t* p, __m512 table) {
  long long word;
  std::memcpy(&word, p, 8);
#if defined(__AVX512VBMI__)
  const __m512i at = _mm512_set_epi64(0x3c3c3c3c38383838, 0x3434343430303030, 0x2c2c2c2c28282828, 0x2424242420202020,
                                      0x1c1c1c1c18181818, 0x1414141410101010, 0x0c0c0c0c08080808, 0x0404040400000000);
  return _mm512_permutexvar_ps(_mm512_multishift_epi64_epi8(at, _mm512_set1_epi64(word)), table);
#else
  const __m512i w = _mm512_cvtepu8_epi64(_mm_cvtsi64_si128(word));
  return _mm512_permutexvar_ps(_mm512_or_si512(w, _mm512_slli_epi64(w, 28)), table);
#endif
}
#endif

#if KV_AVX512
// Integer codes j .. j + 16 (j a multiple of 16) of a 4- or 2-bit stream, low bits first, as floats.
inline __m512 int_codes16(const uint8_t* p, int bits, int j) {
  if (bits == 4) return nibbles16(p + j / 2, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  uint32_t word;
  std::memcpy(&word, p + j / 4, 4);
  const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  return _mm512_cvtepi32_ps(
      _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)word), shifts), _mm512_set1_epi32(3)));
}
#endif

inline void bf16_row(const uint8_t* c, int d, float* out) {
  const uint16_t* p = reinterpret_cast<const uint16_t*>(c);
  int i = 0;
#if KV_AVX512
  for (; i + 16 <= d; i += 16) {
    const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
  }
#elif KV_AVX2
  for (; i + 8 <= d; i += 8) {
    const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)));
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
  }
#endif
  for (; i < d; i++) {
    uint32_t u = (uint32_t)p[i] << 16;
    std::memcpy(out + i, &u, 4);
  }
}

inline void fp8_row(const uint8_t* c, const float* sc, int blk, int d, float* out) {
  int i = 0;
#if KV_AVX512
  if (blk % 16 == 0) {  // E4M3 -> FP16 bits (exponent bias 15, not 7: the value / 256), then FP32
    const __m256i m7f = _mm256_set1_epi16(0x7f), m80 = _mm256_set1_epi16(0x80);
    const __m512 nan = _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN());
    for (; i + 16 <= d; i += 16) {
      const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + i)));
      const __m256i mag = _mm256_and_si256(w, m7f);
      const __m256i h = _mm256_or_si256(_mm256_slli_epi16(mag, 7), _mm256_slli_epi16(_mm256_and_si256(w, m80), 8));
      const __m512 v = _mm512_mask_mov_ps(_mm512_cvtph_ps(h), _mm256_cmpeq_epi16_mask(mag, m7f), nan);
      _mm512_storeu_ps(out + i, _mm512_mul_ps(v, _mm512_set1_ps(sc[i / blk] * 256.f)));
    }
  }
#endif
#if KV_AVX2
  if (blk % 8 == 0) {  // E4M3 bits -> float32 bits: normals shift in place (+120 on the exponent)
    const __m256i m7f = _mm256_set1_epi32(0x7f), sev = _mm256_set1_epi32(7), bias = _mm256_set1_epi32(120 << 23);
    const __m256i s80 = _mm256_set1_epi32(0x80), zero = _mm256_setzero_si256();
    const __m256 sub = _mm256_set1_ps(1.f / 512.f);  // subnormals are m * 2^-9
    for (; i + 8 <= d; i += 8) {
      long long word;
      std::memcpy(&word, c + i, 8);
      const __m256i x = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(word));
      const __m256i mag = _mm256_and_si256(x, m7f);
      const __m256 nrm = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), bias));
      const __m256 sbn = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(mag, sev)), sub);
      const __m256 isn = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_srli_epi32(mag, 3), zero));
      __m256 v = _mm256_blendv_ps(nrm, sbn, isn);
      v = _mm256_blendv_ps(v, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()),
                           _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, m7f)));
      v = _mm256_xor_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(x, s80), 24)));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(v, _mm256_set1_ps(sc[i / blk])));
    }
  }
#endif
  for (; i < d; i++) out[i] = T.e4m3[c[i]] * sc[i / blk];
}

// NVFP4 (E4M3 block scales times a tensor scale) or MXFP4 (E8M0 block scales): E2M1 pairs.
inline void fp4_row(const Run& r, const uint8_t* c, const uint8_t* s, int d, float* out) {
  const int blk = r.block, half_blk = blk / 2, nb = (d + blk - 1) / blk;
#if KV_AVX512
  const __m512 table = _mm512_loadu_ps(T.e2m1);
#endif
  for (int k = 0; k < nb; k++) {
    const float scale = r.kind == NVFP4 ? T.e4m3[s[k]] * r.tscale : e8m0(s[k]);
    const uint8_t* p = c + k * half_blk;
    float* o = out + k * blk;
    int j = 0;
#if KV_AVX512
    const __m512 vs = _mm512_set1_ps(scale);
    if (blk == 16) {  // the two formats' own block sizes, unrolled
      _mm512_storeu_ps(o, _mm512_mul_ps(nibbles16(p, table), vs));
      j = 8;
    } else if (blk == 32) {
      _mm512_storeu_ps(o, _mm512_mul_ps(nibbles16(p, table), vs));
      _mm512_storeu_ps(o + 16, _mm512_mul_ps(nibbles16(p + 8, table), vs));
      j = 16;
    }
    for (; j + 8 <= half_blk; j += 8) _mm512_storeu_ps(o + 2 * j, _mm512_mul_ps(nibbles16(p + j, table), vs));
#elif KV_AVX2
    const __m256 lut = _mm256_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
    const __m256 vs = _mm256_set1_ps(scale);
    const __m256i f = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
    for (; j + 8 <= half_blk; j += 8) {  // 8 bytes -> 16 values
      long long word;
      std::memcpy(&word, p + j, 8);
      const __m256i w = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(word));
      const __m256i lo = _mm256_and_si256(w, f), hi = _mm256_srli_epi32(w, 4);
      const __m256 vlo = _mm256_xor_ps(_mm256_permutevar8x32_ps(lut, lo),
                                       _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(lo, eight), 28)));
      const __m256 vhi = _mm256_xor_ps(_mm256_permutevar8x32_ps(lut, hi),
                                       _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(hi, eight), 28)));
      const __m256 a = _mm256_unpacklo_ps(vlo, vhi), bq = _mm256_unpackhi_ps(vlo, vhi);
      _mm256_storeu_ps(o + 2 * j, _mm256_mul_ps(_mm256_permute2f128_ps(a, bq, 0x20), vs));
      _mm256_storeu_ps(o + 2 * j + 8, _mm256_mul_ps(_mm256_permute2f128_ps(a, bq, 0x31), vs));
    }
#endif
    for (; j < half_blk; j++) {
      o[2 * j] = T.e2m1[p[j] & 15] * scale;
      o[2 * j + 1] = T.e2m1[p[j] >> 4] * scale;
    }
  }
}

// Asymmetric integer codes per token: lo + code * scale in blocks of `block` elements.
inline void int_row(const Run& r, const uint8_t* c, const uint8_t* s, const uint8_t* mn, int d, float* out) {
  const int bits = int_bits(r.kind), blk = r.block, nb = (d + blk - 1) / blk;
  const uint16_t* sh = reinterpret_cast<const uint16_t*>(s);
  const uint16_t* mh = reinterpret_cast<const uint16_t*>(mn);
#if KV_AVX512
  if (bits != 3 && blk % 16 == 0) {
    for (int k = 0; k < nb; k++) {
      const __m512 vs = _mm512_set1_ps(half_to_float(sh[k])), lo = _mm512_set1_ps(half_to_float(mh[k]));
      const uint8_t* p = c + k * blk * bits / 8;
      for (int j = 0; j < blk; j += 16) _mm512_storeu_ps(out + k * blk + j, _mm512_fmadd_ps(int_codes16(p, bits, j), vs, lo));
    }
    return;
  }
#endif
  int_codes(c, nb * blk, bits, out);
  for (int k = 0; k < nb; k++) {
    const float scale = half_to_float(sh[k]), lo = half_to_float(mh[k]);
    float* o = out + k * blk;
    for (int j = 0; j < blk; j++) o[j] = lo + o[j] * scale;
  }
}

// Decode tokens `rows[i]` (or `row0 + i` when rows is null; skip included) of a token-major run into
// buf[i * dp .. + d), i < n: one dispatch per tile, the row loop inlined into each codec's.
template <class Row>
inline void each_row(const Run& r, int64_t b, int64_t h, const int64_t* rows, int64_t row0, int n, int dp,
                     float* buf, Row row) {
  const uint8_t* c = r.codes + b * r.cs[0] + h * r.cs[1];
  const uint8_t* s = r.scales ? r.scales + b * r.ss[0] + h * r.ss[1] : nullptr;
  const uint8_t* m = r.mins ? r.mins + b * r.ms[0] + h * r.ms[1] : nullptr;
  for (int i = 0; i < n; i++) {
    const int64_t t = rows ? rows[i] : row0 + i;
    row(c + t * r.cs[2], s ? s + t * r.ss[2] : nullptr, m ? m + t * r.ms[2] : nullptr, buf + (int64_t)i * dp);
  }
}

inline void decode_tile(const Run& r, int64_t b, int64_t h, const int64_t* rows, int64_t row0, int n, int d, int dp,
                        float* buf) {
  using P = const uint8_t*;
  switch (r.kind) {
    case F32:
      each_row(r, b, h, rows, row0, n, dp, buf, [&](P c, P, P, float* o) { std::memcpy(o, c, sizeof(float) * d); });
      break;
    case BF16:
      each_row(r, b, h, rows, row0, n, dp, buf, [&](P c, P, P, float* o) { bf16_row(c, d, o); });
      break;
    case FP8:
      each_row(r, b, h, rows, row0, n, dp, buf,
               [&](P c, P s, P, float* o) { fp8_row(c, reinterpret_cast<const float*>(s), r.block, d, o); });
      break;
    case NVFP4:
    case MXFP4:
      each_row(r, b, h, rows, row0, n, dp, buf, [&](P c, P s, P, float* o) { fp4_row(r, c, s, d, o); });
      break;
    default:
      each_row(r, b, h, rows, row0, n, dp, buf, [&](P c, P s, P m, float* o) { int_row(r, c, s, m, d, o); });
  }
}

// Keys grouped per channel (KIVI): decode tokens [t0, t0 + n) of the run, transposed, into
// outT[c * TILE + i] (token i, channel c). The tokens lie in one block of `block`.
inline void decode_channel_group(const Run& r, int64_t b, int64_t h, int64_t t0, int n, int d, float* outT) {
  const int bits = int_bits(r.kind);
  const int64_t blk = t0 / r.block, off = t0 % r.block;
  const int64_t ofs = off * bits / 8;  // the first code byte in the group (off: where the piece starts)
  const bool whole = bits != 3 && (off * bits) % 8 == 0;
  float codes[MAX_GROUP];
  for (int ch = 0; ch < d; ch++) {
    const uint8_t* p = r.codes + b * r.cs[0] + h * r.cs[1] + ch * r.cs[2] + blk * r.cs[3];
    const float scale = half_to_float(*reinterpret_cast<const uint16_t*>(r.scales + b * r.ss[0] + h * r.ss[1] + ch * r.ss[2] + blk * r.ss[3]));
    const float lo = half_to_float(*reinterpret_cast<const uint16_t*>(r.mins + b * r.ms[0] + h * r.ms[1] + ch * r.ms[2] + blk * r.ms[3]));
    float* o = outT + ch * TILE;
    // only the tile's codes (rounded out to whole bytes), not the whole group's
    const int m = whole ? (n * bits + 7) / 8 * 8 / bits : (int)r.block;
    const float* cd = whole ? codes : codes + off;
    int i = 0;
#if KV_AVX512
    if (whole) {  // the tile's codes straight into its row of the transposed buffer, 16 at a time
      const __m512 vs = _mm512_set1_ps(scale), vlo = _mm512_set1_ps(lo);
      for (; i + 16 <= n; i += 16) _mm512_storeu_ps(o + i, _mm512_fmadd_ps(int_codes16(p + ofs, bits, i), vs, vlo));
      if (i == n) continue;
    }
#endif
    int_codes(whole ? p + ofs : p, m, bits, codes);
    for (; i < n; i++) o[i] = lo + cd[i] * scale;
  }
}

// A tile of channel-grouped keys, tokens [t0, t0 + n), transposed as above: group by group, so one
// tile spans several small groups (KIVI's 32-token groups fill a 64-token tile).
inline void decode_channel_tile(const Run& r, int64_t b, int64_t h, int64_t t0, int n, int d, float* outT) {
  for (int done = 0; done < n;) {
    const int64_t t = t0 + done;
    const int m = (int)std::min<int64_t>(n - done, r.block - t % r.block);
    decode_channel_group(r, b, h, t, m, d, outT + done);
    done += m;
  }
}

}  // namespace
}  // namespace kv
