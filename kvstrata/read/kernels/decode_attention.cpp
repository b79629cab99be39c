// Decode attention straight from encoded KV (one query token per sequence), flash-decoding style.
//
// The layer's K and V are runs of encoded tokens (bf16, FP8 E4M3, NVFP4, MXFP4, INT4/INT3/INT2 with
// keys per token or grouped per channel as KIVI stores them, or float32 for the full-precision
// tail). Each work item (batch row, KV head, slice of tokens) decodes a tile of at most 64 tokens
// into a small buffer, scores it against every query head of the KV group (GQA: one pass over the
// codes), and folds it into an online softmax; slices are merged at the end. Nothing the size of
// the layer is ever decoded.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

enum Kind { F32 = 0, BF16 = 1, FP8 = 2, NVFP4 = 3, MXFP4 = 4, INT4 = 5, INT2 = 6, INT3 = 7 };
constexpr int TILE = 64;
constexpr int MAX_DIM = 1024;
constexpr int MAX_GROUP = 4096;  // tokens per channel group of KIVI keys

float E4M3[256];
float E2M1[16];
float INT4_CODES[256][2];  // a byte's two 4-bit codes, low bits first
float INT2_CODES[256][4];  // a byte's four 2-bit codes

struct Tables {
  Tables() {
    const float mags[8] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
    for (int i = 0; i < 16; i++) E2M1[i] = (i & 8) ? -mags[i & 7] : mags[i & 7];
    for (int x = 0; x < 256; x++) {
      for (int j = 0; j < 2; j++) INT4_CODES[x][j] = (float)((x >> (4 * j)) & 15);
      for (int j = 0; j < 4; j++) INT2_CODES[x][j] = (float)((x >> (2 * j)) & 3);
    }
    for (int x = 0; x < 256; x++) {
      int e = (x >> 3) & 15, m = x & 7;
      float v = e ? std::ldexp(1.f + m / 8.f, e - 7) : std::ldexp(m / 8.f, -6);
      if ((x & 0x7f) == 0x7f) v = std::numeric_limits<float>::quiet_NaN();
      E4M3[x] = (x & 0x80) ? -v : v;
    }
  }
} tables;

inline float half_to_float(uint16_t h) {
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
}

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
    for (int j = 0; j < n / 2; j++) std::memcpy(out + 2 * j, INT4_CODES[p[j]], 8);
  else if (bits == 3)
    for (int j = 0; j < n / 8; j++) {
      const uint32_t w = p[3 * j] | (uint32_t)p[3 * j + 1] << 8 | (uint32_t)p[3 * j + 2] << 16;
      for (int i = 0; i < 8; i++) out[8 * j + i] = (float)((w >> (3 * i)) & 7);
    }
  else
    for (int j = 0; j < n / 4; j++) std::memcpy(out + 4 * j, INT2_CODES[p[j]], 16);
}

// Decode token `t` (row in the run, skip included) of a token-major run into out[0..d).
inline void decode_row(const Run& r, int64_t b, int64_t h, int64_t t, int d, float* out) {
  const uint8_t* c = r.codes + b * r.cs[0] + h * r.cs[1] + t * r.cs[2];
  const uint8_t* s = r.scales ? r.scales + b * r.ss[0] + h * r.ss[1] + t * r.ss[2] : nullptr;
  switch (r.kind) {
    case F32:
      std::memcpy(out, c, sizeof(float) * d);
      break;
    case BF16: {
      const uint16_t* p = reinterpret_cast<const uint16_t*>(c);
      for (int i = 0; i < d; i++) {
        uint32_t u = (uint32_t)p[i] << 16;
        std::memcpy(out + i, &u, 4);
      }
      break;
    }
    case FP8: {
      const float* sc = reinterpret_cast<const float*>(s);
      const int blk = r.block;
      int i = 0;
#ifdef __AVX2__
      if (blk % 8 == 0) {  // E4M3 bits -> float32 bits: normals shift in place (+120 on the exponent),
        const __m256i m7f = _mm256_set1_epi32(0x7f), sev = _mm256_set1_epi32(7), bias = _mm256_set1_epi32(120 << 23);
        const __m256i s80 = _mm256_set1_epi32(0x80), zero = _mm256_setzero_si256();
        const __m256 sub = _mm256_set1_ps(1.f / 512.f);  // subnormals are m * 2^-9
        for (; i + 8 <= d; i += 8) {
          int64_t word;
          std::memcpy(&word, c + i, 8);
          __m256i x = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(word));
          __m256i mag = _mm256_and_si256(x, m7f);
          __m256 nrm = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), bias));
          __m256 sbn = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(mag, sev)), sub);
          __m256 isn = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_srli_epi32(mag, 3), zero));
          __m256 v = _mm256_blendv_ps(nrm, sbn, isn);
          v = _mm256_xor_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(x, s80), 24)));
          _mm256_storeu_ps(out + i, _mm256_mul_ps(v, _mm256_set1_ps(sc[i / blk])));
        }
      }
#endif
      for (; i < d; i++) out[i] = E4M3[c[i]] * sc[i / blk];
      break;
    }
    case NVFP4:
    case MXFP4: {
      const int blk = r.block, half_blk = blk / 2;
      const int nb = (d + blk - 1) / blk;
      for (int k = 0; k < nb; k++) {
        float scale = r.kind == NVFP4 ? E4M3[s[k]] * r.tscale : e8m0(s[k]);
        const uint8_t* p = c + k * half_blk;
        float* o = out + k * blk;
#ifdef __AVX2__
        const __m256 lut = _mm256_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
        const __m256 vs = _mm256_set1_ps(scale);
        const __m256i f = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
        for (int j = 0; j + 8 <= half_blk; j += 8) {  // 8 bytes -> 16 values
          int64_t word;
          std::memcpy(&word, p + j, 8);
          __m256i w = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(word));
          __m256i lo = _mm256_and_si256(w, f), hi = _mm256_srli_epi32(w, 4);
          __m256 vlo = _mm256_xor_ps(_mm256_permutevar8x32_ps(lut, lo),
                                     _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(lo, eight), 28)));
          __m256 vhi = _mm256_xor_ps(_mm256_permutevar8x32_ps(lut, hi),
                                     _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(hi, eight), 28)));
          __m256 a = _mm256_unpacklo_ps(vlo, vhi), bq = _mm256_unpackhi_ps(vlo, vhi);
          _mm256_storeu_ps(o + 2 * j, _mm256_mul_ps(_mm256_permute2f128_ps(a, bq, 0x20), vs));
          _mm256_storeu_ps(o + 2 * j + 8, _mm256_mul_ps(_mm256_permute2f128_ps(a, bq, 0x31), vs));
        }
        for (int j = half_blk - half_blk % 8; j < half_blk; j++) {
#else
        for (int j = 0; j < half_blk; j++) {
#endif
          o[2 * j] = E2M1[p[j] & 15] * scale;
          o[2 * j + 1] = E2M1[p[j] >> 4] * scale;
        }
      }
      break;
    }
    case INT4:
    case INT3:
    case INT2: {
      const int bits = int_bits(r.kind);
      const int blk = r.block;
      const int nb = (d + blk - 1) / blk;
      const uint8_t* mn = r.mins + b * r.ms[0] + h * r.ms[1] + t * r.ms[2];
      int_codes(c, nb * blk, bits, out);
      for (int k = 0; k < nb; k++) {
        const float scale = half_to_float(reinterpret_cast<const uint16_t*>(s)[k]);
        const float lo = half_to_float(reinterpret_cast<const uint16_t*>(mn)[k]);
        float* o = out + k * blk;
        for (int j = 0; j < blk; j++) o[j] = lo + o[j] * scale;
      }
      break;
    }
  }
}

// Keys grouped per channel (KIVI): decode tokens [t0, t0 + n) of the run, transposed, into
// outT[c * TILE + i] (token i of the tile, channel c). The tokens lie in one block of `block`.
void decode_channel_tile(const Run& r, int64_t b, int64_t h, int64_t t0, int n, int d, float* outT) {
  const int bits = int_bits(r.kind);
  const int64_t blk = t0 / r.block, off = t0 % r.block;
  float codes[MAX_GROUP];
  for (int ch = 0; ch < d; ch++) {
    const uint8_t* p = r.codes + b * r.cs[0] + h * r.cs[1] + ch * r.cs[2] + blk * r.cs[3];
    float scale = half_to_float(*reinterpret_cast<const uint16_t*>(r.scales + b * r.ss[0] + h * r.ss[1] + ch * r.ss[2] + blk * r.ss[3]));
    float lo = half_to_float(*reinterpret_cast<const uint16_t*>(r.mins + b * r.ms[0] + h * r.ms[1] + ch * r.ms[2] + blk * r.ms[3]));
    float* o = outT + ch * TILE;
    int_codes(p, (int)r.block, bits, codes);
    for (int i = 0; i < n; i++) o[i] = lo + codes[off + i] * scale;
  }
}

Run make_run(const std::vector<torch::Tensor>& parts, const int64_t* meta, float tscale, int64_t i) {
  Run r;
  r.kind = (int)meta[0];
  r.channel = meta[1] != 0;
  r.length = meta[2];
  r.skip = meta[3];
  r.block = (int)meta[4];
  r.tscale = tscale;
  TORCH_CHECK(r.kind >= F32 && r.kind <= INT3, "unknown run kind");
  TORCH_CHECK(!r.channel || (r.block > 0 && r.block <= MAX_GROUP), "channel groups must hold 1..4096 tokens");
  TORCH_CHECK(r.channel || r.kind <= BF16 || r.block > 0, "a block size is needed");
  const torch::Tensor* ts[3] = {&parts[3 * i], &parts[3 * i + 1], &parts[3 * i + 2]};
  const uint8_t** ptrs[3] = {&r.codes, &r.scales, &r.mins};
  int64_t* strides[3] = {r.cs, r.ss, r.ms};
  for (int k = 0; k < 3; k++) {
    const torch::Tensor& t = *ts[k];
    if (!t.defined() || t.numel() == 0) continue;
    TORCH_CHECK(t.stride(-1) == 1, "encoded parts need a contiguous last dimension");
    *ptrs[k] = reinterpret_cast<const uint8_t*>(t.data_ptr());
    int64_t es = t.element_size();
    for (int j = 0; j < std::min<int64_t>(4, t.dim()); j++) strides[k][j] = t.stride(j) * es;
  }
  return r;
}

struct Partial {
  std::vector<float> m, l, acc;  // [G], [G], [G * d]
};

// A tile: `n` consecutive visible tokens of segment `seg`, starting at row `row` (skip included),
// or, in sparse mode, `n` rows listed in `rows`.
struct Tile {
  int seg;
  int64_t row;
  int n;
};

#if defined(__AVX2__) && defined(__FMA__)
// The 8 horizontal sums of a[0..8) as one vector.
inline __m256 hsum8(const __m256* a) {
  __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

// s[i] = q . k[i] for the n rows of `kbuf` (row stride dp).
inline void dots(const float* q, const float* kbuf, int n, int d, int dp, float* s) {
  int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (d % 8 == 0) {
    for (; i + 8 <= n; i += 8) {
      __m256 a[8];
      for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
      for (int c = 0; c < d; c += 8) {
        const __m256 qv = _mm256_loadu_ps(q + c);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kbuf + (int64_t)(i + j) * dp + c), a[j]);
      }
      _mm256_storeu_ps(s + i, hsum8(a));
    }
  }
#endif
  for (; i < n; i++) {
    const float* k = kbuf + (int64_t)i * dp;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int c = 0; c < d; c++) acc += q[c] * k[c];
    s[i] = acc;
  }
}

// acc[0..d) += sum_i p[i] * v[i] over the n rows of `vbuf` (row stride dp).
inline void accumulate(const float* p, const float* vbuf, int n, int d, int dp, float* acc) {
  int c0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
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

// bias (or null): [G, total] scores added before scaling at each token's logical position (`starts`:
// where each run's visible tokens begin)
void attend_tiles(const std::vector<Run>& K, const std::vector<Run>& V, const Tile* tiles, int ntiles,
                  const int64_t* rows, const float* q, int G, int d, int dp, int64_t b, int64_t h, float scaling,
                  float softcap, const float* bias, const int64_t* starts, int64_t total, Partial& out) {
  std::vector<float> kbuf(TILE * dp), vbuf(TILE * dp), s(G * TILE);
  out.m.assign(G, -std::numeric_limits<float>::infinity());
  out.l.assign(G, 0.f);
  out.acc.assign((size_t)G * d, 0.f);
  for (int ti = 0; ti < ntiles; ti++) {
    const Tile& tile = tiles[ti];
    const Run& kr = K[tile.seg];
    const Run& vr = V[tile.seg];
    const int n = tile.n;
    // scores s[g * TILE + i]
    if (kr.channel) {
      decode_channel_tile(kr, b, h, tile.row, n, d, kbuf.data());
      for (int g = 0; g < G; g++) {
        float* sg = s.data() + g * TILE;
        for (int i = 0; i < n; i++) sg[i] = 0.f;
        const float* qg = q + g * d;
        for (int c = 0; c < d; c++) {
          const float qc = qg[c];
          const float* kc = kbuf.data() + c * TILE;
#pragma omp simd
          for (int i = 0; i < n; i++) sg[i] += qc * kc[i];
        }
      }
    } else {
      for (int i = 0; i < n; i++)
        decode_row(kr, b, h, rows ? rows[ti * TILE + i] : tile.row + i, d, kbuf.data() + (int64_t)i * dp);
      for (int g = 0; g < G; g++) dots(q + g * d, kbuf.data(), n, d, dp, s.data() + g * TILE);
    }
    if (bias) {
      const int64_t base = starts[tile.seg] - kr.skip;  // logical position of row 0 of this run
      for (int i = 0; i < n; i++) {
        const int64_t pos = base + (rows ? rows[ti * TILE + i] : tile.row + i);
        for (int g = 0; g < G; g++) s[g * TILE + i] += bias[g * total + pos];
      }
    }
    // online softmax
    for (int g = 0; g < G; g++) {
      float* sg = s.data() + g * TILE;
      float mt = -std::numeric_limits<float>::infinity();
      for (int i = 0; i < n; i++) {
        float x = sg[i] * scaling;
        if (softcap > 0.f) x = softcap * std::tanh(x / softcap);
        sg[i] = x;
        mt = std::max(mt, x);
      }
      const float mnew = std::max(out.m[g], mt);
      const float corr = std::exp(out.m[g] - mnew);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int i = 0; i < n; i++) {
        sg[i] = exp_neg(sg[i] - mnew);
        sum += sg[i];
      }
      out.l[g] = out.l[g] * corr + sum;
      out.m[g] = mnew;
      if (corr != 1.f) {
        float* a = out.acc.data() + g * d;
        for (int c = 0; c < d; c++) a[c] *= corr;
      }
    }
    for (int i = 0; i < n; i++)
      decode_row(vr, b, h, rows ? rows[ti * TILE + i] : tile.row + i, d, vbuf.data() + (int64_t)i * dp);
    for (int g = 0; g < G; g++) accumulate(s.data() + g * TILE, vbuf.data(), n, d, dp, out.acc.data() + g * d);
  }
}

// Tiles covering the visible tokens of every run in order; channel-grouped keys' tiles stay inside
// one group so a tile decodes from one block of scales.
std::vector<Tile> dense_tiles(const std::vector<Run>& K) {
  std::vector<Tile> tiles;
  for (int sgi = 0; sgi < (int)K.size(); sgi++) {
    const Run& r = K[sgi];
    int64_t t = r.skip;
    while (t < r.length) {
      int64_t end = std::min<int64_t>(r.length, t + TILE);
      if (r.channel) end = std::min<int64_t>(end, (t / r.block + 1) * r.block);
      tiles.push_back({sgi, t, (int)(end - t)});
      t = end;
    }
  }
  return tiles;
}

// One sequence's attention problem: its runs, tiles and work split. A varlen call holds one per
// request; each is split exactly as a single call would split it, so every row's result is the
// single-request kernel's, bit for bit.
struct Problem {
  torch::Tensor q, km, vm, kt, vt, idx, bias, out;
  std::vector<Run> K, V;
  std::vector<int64_t> starts;  // logical position where each run's visible tokens begin
  std::vector<Tile> all;        // dense tiles (empty when sparse)
  std::vector<Partial> parts;
  int64_t B = 0, Hq = 0, Hk = 1, total = 0, m = 0, units = 0, splits = 1;
  int d = 0, dp = 0, G = 1;
  bool sparse = false, biased = false;
  int64_t work() const { return B * Hk * splits; }
};

// q: [B, Hq, d] float32; parts: 3 tensors per run (codes, scales, mins; undefined/empty when unused);
// meta: int64 [runs, 5] (kind, channel, length, skip, block); tscale: float32 [runs]; K and V runs
// pair up (same tokens). idx: int64 [B, Hk, m] logical positions over the visible tokens of the runs
// in order (sorted), or empty for every token. bias: float32 [B, Hq, visible tokens] added to the
// scores before scaling (outlier key channels kept apart), or empty.
void prepare(Problem& p, const torch::Tensor& q, const std::vector<torch::Tensor>& kparts, const torch::Tensor& kmeta,
             const torch::Tensor& kts, const std::vector<torch::Tensor>& vparts, const torch::Tensor& vmeta,
             const torch::Tensor& vts, const torch::Tensor& idx, const torch::Tensor& bias, int threads) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q must be contiguous float32 [B, Hq, d]");
  p.q = q;
  p.B = q.size(0);
  p.Hq = q.size(1);
  p.d = (int)q.size(2);
  TORCH_CHECK(p.d <= MAX_DIM, "head_dim too large");
  p.km = kmeta.contiguous();
  p.vm = vmeta.contiguous();
  p.kt = kts.contiguous();
  p.vt = vts.contiguous();
  const int64_t nruns = p.km.size(0);
  TORCH_CHECK(p.vm.size(0) == nruns && (int64_t)kparts.size() == 3 * nruns && (int64_t)vparts.size() == 3 * nruns,
              "K and V need the same runs");
  p.dp = p.d;
  for (int64_t i = 0; i < nruns; i++) {
    p.K.push_back(make_run(kparts, p.km.data_ptr<int64_t>() + 5 * i, p.kt.data_ptr<float>()[i], i));
    p.V.push_back(make_run(vparts, p.vm.data_ptr<int64_t>() + 5 * i, p.vt.data_ptr<float>()[i], i));
    for (const Run* r : {&p.K.back(), &p.V.back()})
      if (!r->channel && r->block > 0) p.dp = std::max(p.dp, (int)((p.d + r->block - 1) / r->block * r->block));
  }
  // Channel-grouped key runs decode into a [d, TILE] buffer; rows need dp columns
  p.Hk = p.K.empty() ? 1 : (kparts[0].dim() >= 2 ? kparts[0].size(1) : 1);
  TORCH_CHECK(p.Hq % p.Hk == 0, "query heads must be a multiple of KV heads");
  p.G = (int)(p.Hq / p.Hk);
  p.sparse = idx.defined() && idx.numel() > 0;
  for (const Run& r : p.K) {
    p.starts.push_back(p.total);
    p.total += r.visible();
  }
  p.biased = bias.defined() && bias.numel() > 0;
  p.bias = p.biased ? bias.to(torch::kFloat32).contiguous() : bias;
  TORCH_CHECK(!p.biased || (p.bias.dim() == 3 && p.bias.size(0) == p.B && p.bias.size(1) == p.Hq && p.bias.size(2) == p.total),
              "bias must be float32 [B, Hq, visible tokens]");
  if (!p.sparse) p.all = dense_tiles(p.K);
  p.m = p.sparse ? idx.size(2) : 0;
  p.units = p.sparse ? (p.m + TILE - 1) / TILE : (int64_t)p.all.size();
  p.splits = std::max<int64_t>(1, std::min<int64_t>(p.units, (2 * threads + p.B * p.Hk - 1) / (p.B * p.Hk)));
  if (p.units < 4) p.splits = 1;
  p.parts.resize(p.work());
  p.idx = p.sparse ? idx.to(torch::kInt64).contiguous() : idx;
}

// Work item w of p: (batch row, KV head, slice of tokens).
void run_work(Problem& p, int64_t w, float scaling, float softcap) {
  const int64_t sp = w % p.splits, bh = w / p.splits, b = bh / p.Hk, h = bh % p.Hk;
  const int64_t u0 = p.units * sp / p.splits, u1 = p.units * (sp + 1) / p.splits;
  const float* qg = p.q.data_ptr<float>() + (b * p.Hq + h * p.G) * p.d;
  const float* bg = p.biased ? p.bias.data_ptr<float>() + (b * p.Hq + h * p.G) * p.total : nullptr;
  if (!p.sparse) {
    attend_tiles(p.K, p.V, p.all.data() + u0, (int)(u1 - u0), nullptr, qg, p.G, p.d, p.dp, b, h, scaling, softcap, bg,
                 p.starts.data(), p.total, p.parts[w]);
    return;
  }
  // sparse: map each listed position to (run, row), in tiles of one run each
  const int64_t* pos = p.idx.data_ptr<int64_t>() + (b * p.Hk + h) * p.m;
  std::vector<Tile> tiles;
  std::vector<int64_t> rows;
  int64_t e0 = u0 * TILE, e1 = std::min<int64_t>(p.m, u1 * TILE);
  int run = 0;
  for (int64_t e = e0; e < e1; e++) {
    int64_t x = pos[e];
    TORCH_CHECK(x >= 0 && x < p.total, "sparse position out of range");
    while (run + 1 < (int)p.K.size() && x >= p.starts[run + 1]) run++;
    while (run > 0 && x < p.starts[run]) run--;
    if (tiles.empty() || tiles.back().seg != run || tiles.back().n == TILE || p.K[run].channel) {
      tiles.push_back({run, 0, 0});
      rows.resize(tiles.size() * TILE);
    }
    Tile& t = tiles.back();
    int64_t row = x - p.starts[run] + p.K[run].skip;
    if (p.K[run].channel) t.row = row;
    rows[(tiles.size() - 1) * TILE + t.n] = row;
    t.n++;
  }
  attend_tiles(p.K, p.V, tiles.data(), (int)tiles.size(), rows.data(), qg, p.G, p.d, p.dp, b, h, scaling, softcap, bg,
               p.starts.data(), p.total, p.parts[w]);
}

// The slices' partial softmaxes merged: [B, Hq, d] float32.
torch::Tensor merge(const Problem& p) {
  auto out = torch::zeros({p.B, p.Hq, p.d}, p.q.options());
  float* op = out.data_ptr<float>();
  const int d = p.d;
  for (int64_t bh = 0; bh < p.B * p.Hk; bh++) {
    const int64_t b = bh / p.Hk, h = bh % p.Hk;
    for (int g = 0; g < p.G; g++) {
      float M = -std::numeric_limits<float>::infinity();
      for (int64_t sp = 0; sp < p.splits; sp++) M = std::max(M, p.parts[bh * p.splits + sp].m[g]);
      float L = 0.f;
      float* o = op + (b * p.Hq + h * p.G + g) * d;
      for (int64_t sp = 0; sp < p.splits; sp++) {
        const Partial& P = p.parts[bh * p.splits + sp];
        if (P.l[g] == 0.f) continue;
        float w = std::exp(P.m[g] - M);
        L += P.l[g] * w;
        for (int c = 0; c < d; c++) o[c] += P.acc[(size_t)g * d + c] * w;
      }
      if (L > 0.f)
        for (int c = 0; c < d; c++) o[c] /= L;
    }
  }
  return out;
}

}  // namespace

// One sequence (see `prepare` for the arguments). Returns [B, Hq, d] float32.
torch::Tensor decode_attention(torch::Tensor q, std::vector<torch::Tensor> kparts, torch::Tensor kmeta, torch::Tensor kts,
                               std::vector<torch::Tensor> vparts, torch::Tensor vmeta, torch::Tensor vts, double scaling,
                               double softcap, torch::Tensor idx, torch::Tensor bias) {
  Problem p;
  prepare(p, q, kparts, kmeta, kts, vparts, vmeta, vts, idx, bias, at::get_num_threads());
  at::parallel_for(0, p.work(), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t w = lo; w < hi; w++) run_work(p, w, (float)scaling, (float)softcap);
  });
  return merge(p);
}

// Many sequences of different lengths in one call (varlen): argument i of each list is sequence i's
// (as `decode_attention` takes them); one parallel pass over every sequence's work items, so short
// and long requests share the threads and nothing is padded. Returns one [B, Hq, d] per sequence.
std::vector<torch::Tensor> decode_attention_varlen(
    std::vector<torch::Tensor> qs, std::vector<std::vector<torch::Tensor>> kparts, std::vector<torch::Tensor> kmeta,
    std::vector<torch::Tensor> kts, std::vector<std::vector<torch::Tensor>> vparts, std::vector<torch::Tensor> vmeta,
    std::vector<torch::Tensor> vts, double scaling, double softcap, std::vector<torch::Tensor> idx,
    std::vector<torch::Tensor> bias) {
  const size_t n = qs.size();
  TORCH_CHECK(kparts.size() == n && kmeta.size() == n && kts.size() == n && vparts.size() == n && vmeta.size() == n &&
                  vts.size() == n && idx.size() == n && bias.size() == n,
              "every argument list needs one entry per sequence");
  std::vector<Problem> ps(n);
  std::vector<int64_t> first(n + 1, 0);  // first work item of each sequence
  const int threads = at::get_num_threads();
  for (size_t i = 0; i < n; i++) {
    prepare(ps[i], qs[i], kparts[i], kmeta[i], kts[i], vparts[i], vmeta[i], vts[i], idx[i], bias[i], threads);
    first[i + 1] = first[i] + ps[i].work();
  }
  at::parallel_for(0, first[n], 1, [&](int64_t lo, int64_t hi) {
    for (int64_t w = lo; w < hi; w++) {
      const size_t i = std::upper_bound(first.begin(), first.end(), w) - first.begin() - 1;
      run_work(ps[i], w - first[i], (float)scaling, (float)softcap);
    }
  });
  std::vector<torch::Tensor> out;
  for (const Problem& p : ps) out.push_back(merge(p));
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "decode attention over encoded KV runs");
  m.def("decode_attention_varlen", &decode_attention_varlen, "decode attention for many sequences in one call");
}
