// Top-k selection for sparse decode reads, scored straight from a layer's index rows: each KV
// head's projected queries dotted with every candidate row (the decode kernel's `dots`), reduced
// over the group's query heads (max, or V4.1's sum of ReLUs), and the k best kept by a partial
// selection -- no score tensor, sort or sliced copy per layer and step.
#pragma once

#include "encode.h"
#include "linalg.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <functional>

namespace kv {
namespace {

// A float's bits as an unsigned key in the float's order (-0 keyed as +0, which it equals).
inline uint32_t order_key(float x) {
  x += 0.0f;
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

constexpr int64_t INDEX_TILE = 256;  // index rows scored together (16 KB at rank 16)

// Combine one query head's scores `t` into `s` (max, or the sum of ReLUs), m of them.
inline void combine(float* s, float* t, int m, bool first, bool relu_sum) {
  if (relu_sum)
    for (int i = 0; i < m; i++) t[i] = std::max(t[i], 0.f);
  if (first) return;
  if (relu_sum)
    for (int i = 0; i < m; i++) s[i] += t[i];
  else
    for (int i = 0; i < m; i++) s[i] = std::max(s[i], t[i]);
}

// Scores of positions [lo, hi) from row-major index rows (rows[i * rs ..] row i): a tile of rows at
// a time, every query head over it while it sits in L1 (each row's dot is the same whichever call
// holds it).
inline void score_rows(const float* q, int G, int r, const float* rows, int64_t rs, int64_t lo, int64_t hi,
                       bool relu_sum, float* s) {
  float t[INDEX_TILE];
  for (int64_t i0 = lo; i0 < hi; i0 += INDEX_TILE) {
    const int m = (int)std::min<int64_t>(INDEX_TILE, hi - i0);
    float* si = s + (i0 - lo);
    for (int g = 0; g < G; g++) {
      float* dst = g == 0 ? si : t;
      dots(q + (int64_t)g * r, rows + i0 * rs, m, r, (int)rs, dst);
      combine(si, dst, m, g == 0, relu_sum);
    }
  }
}

// Scores of positions [lo, hi) from index rows held transposed in tiles of 16 (tiles[(i / 16) * ts +
// c * 16 + i % 16] is row i's value c): each query value broadcast over a tile's 16 rows, one FMA
// per value and tile, no per-row reduction; four tiles at a time, so four FMA chains overlap (each
// tile's sum in the same order whichever tiles share its pass).
inline void score_tiles(const float* q, int G, int r, const float* tiles, int64_t ts, int64_t lo, int64_t hi,
                        bool relu_sum, float* s) {
  constexpr int W = 4;
  alignas(64) float acc[W][16], t[W][16];
  for (int64_t t0 = lo / 16; t0 * 16 < hi; t0 += W) {
    const int w = (int)std::min<int64_t>(W, (hi + 15) / 16 - t0);
    for (int g = 0; g < G; g++) {
      const float* qg = q + (int64_t)g * r;
      float(*dst)[16] = g == 0 ? acc : t;
#if KV_AVX512
      __m512 a[W];
      for (int j = 0; j < w; j++) a[j] = _mm512_mul_ps(_mm512_set1_ps(qg[0]), _mm512_loadu_ps(tiles + (t0 + j) * ts));
      for (int c = 1; c < r; c++) {
        const __m512 qc = _mm512_set1_ps(qg[c]);
        for (int j = 0; j < w; j++) a[j] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(tiles + (t0 + j) * ts + c * 16), a[j]);
      }
      for (int j = 0; j < w; j++) _mm512_store_ps(dst[j], a[j]);
#else
      for (int j = 0; j < w; j++) {
        const float* T = tiles + (t0 + j) * ts;
        for (int i = 0; i < 16; i++) dst[j][i] = qg[0] * T[i];
        for (int c = 1; c < r; c++)
          for (int i = 0; i < 16; i++) dst[j][i] = std::fma(qg[c], T[c * 16 + i], dst[j][i]);
      }
#endif
      for (int j = 0; j < w; j++) combine(acc[j], dst[j], 16, g == 0, relu_sum);
    }
    for (int j = 0; j < w; j++) {
      const int64_t first = (t0 + j) * 16, a = std::max(lo, first), b = std::min(hi, first + 16);
      std::memcpy(s + (a - lo), acc[j] + (a - first), sizeof(float) * (b - a));
    }
  }
}

// The k best of the n = hi - lo scores s (positions lo ..), ascending into out. A score that is NaN
// ranks last; equal scores rank the lower position first. Scores become order-preserving integer keys
// (one pass, with a histogram of their top 12 bits: sign, exponent, 3 mantissa bits), the histogram
// finds the bin holding the k-th best, a selection over that bin alone finds it, and one pass writes
// every position above it and the lowest of those equal to it.
inline void pick(const float* s, int64_t lo, int64_t hi, int64_t k, int64_t* out) {
  constexpr int SHIFT = 20;
  const int64_t n = hi - lo;
  std::vector<uint32_t> key(n);
  std::vector<int32_t> hist(1 << (32 - SHIFT), 0);
  const uint32_t nan_key = order_key(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i++) {
    key[i] = std::isnan(s[i]) ? nan_key : order_key(s[i]);
    hist[key[i] >> SHIFT]++;
  }
  int64_t above = 0;
  uint32_t bin = (1u << (32 - SHIFT)) - 1;
  while (above + hist[bin] < k) above += hist[bin--];
  std::vector<uint32_t> in_bin;
  in_bin.reserve(hist[bin]);
  for (int64_t i = 0; i < n; i++)
    if ((key[i] >> SHIFT) == bin) in_bin.push_back(key[i]);
  const int64_t j = k - above - 1;  // the k-th best is the (j+1)-th best of its bin
  std::nth_element(in_bin.begin(), in_bin.begin() + j, in_bin.end(), std::greater<uint32_t>());
  const uint32_t kth = in_bin[j];
  for (uint32_t x : in_bin) above += x > kth;
  int64_t ties = k - above, m = 0;
  for (int64_t i = 0; i < n && m < k; i++)
    if (key[i] > kth || (key[i] == kth && ties-- > 0)) out[m++] = lo + i;
}

}  // namespace
}  // namespace kv

// q: [B, Hk, G, r] float32 (each KV head's query heads, projected as its index rows are); rows:
// [B, Hk, n, r] float32 (last dim contiguous), or the same rows held transposed in tiles of 16,
// [B, Hk, n / 16, r, 16] (contiguous past dim 1). Per KV head, ascending: with `end` < 0 the k
// positions in [lo, hi) scoring highest ([B, Hk, k]); else what a sparse step reads, [0, lo) (the
// sinks), those k and [hi, end) (the recent window): [B, Hk, lo + k + end - hi].
inline torch::Tensor read_positions(torch::Tensor q, torch::Tensor rows, int64_t k, int64_t lo, int64_t hi,
                                    int64_t end, bool relu_sum) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == torch::kFloat32, "q must be float32 [B, Hk, G, r]");
  const bool tiled = rows.dim() == 5;
  TORCH_CHECK((rows.dim() == 4 || (tiled && rows.size(4) == 16 && rows[0][0].is_contiguous())) &&
                  rows.scalar_type() == torch::kFloat32 && rows.stride(-1) == 1,
              "rows must be float32 [B, Hk, n, r] with a contiguous last dimension, or [B, Hk, n / 16, r, 16]");
  q = q.contiguous();
  const int64_t B = q.size(0), Hk = q.size(1), G = q.size(2), r = q.size(3);
  const int64_t n = tiled ? rows.size(2) * 16 : rows.size(2);
  TORCH_CHECK(rows.size(0) == B && rows.size(1) == Hk && rows.size(3) == r, "q and rows disagree on shape");
  TORCH_CHECK(0 <= lo && lo <= hi && hi <= n && 1 <= k && k <= hi - lo, "need 0 <= lo <= hi <= n and 1 <= k <= hi - lo");
  TORCH_CHECK(end < 0 || end >= hi, "need end >= hi (or end < 0: the k positions alone)");
  const int64_t head = end < 0 ? 0 : lo, tail = end < 0 ? 0 : end - hi, width = head + k + tail;
  auto out = torch::empty({B, Hk, width}, torch::dtype(torch::kInt64));
  const float* qp = q.data_ptr<float>();
  const float* rp = rows.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B * Hk, 1, [&](int64_t a, int64_t b) {
    std::vector<float> s(hi - lo);
    for (int64_t bh = a; bh < b; bh++) {
      const float* heads = rp + (bh / Hk) * rows.stride(0) + (bh % Hk) * rows.stride(1);
      const float* qh = qp + bh * G * r;
      if (tiled)
        kv::score_tiles(qh, (int)G, (int)r, heads, rows.stride(2), lo, hi, relu_sum, s.data());
      else
        kv::score_rows(qh, (int)G, (int)r, heads, rows.stride(2), lo, hi, relu_sum, s.data());
      int64_t* o = op + bh * width;
      for (int64_t i = 0; i < head; i++) o[i] = i;
      kv::pick(s.data(), lo, hi, k, o + head);
      for (int64_t i = 0; i < tail; i++) o[head + k + i] = hi + i;
    }
  });
  return out;
}

inline torch::Tensor topk_positions(torch::Tensor q, torch::Tensor rows, int64_t k, int64_t lo, int64_t hi,
                                    bool relu_sum) {
  return read_positions(q, rows, k, lo, hi, -1, relu_sum);
}

// Lowrank index rows as the index holds them, kept up in place (`kvstrata.read.sparse._held_rows`):
// raw: [B, Hk, >= n, r] float32 index rows; held: [B, Hk, >= n, r] float32, rows [0, kept) already
// rounded under `kept_scale`; tiles: the held rows again, transposed in tiles of 16 rows
// ([B, Hk, >= n / 16, r, 16], what `read_positions` scores fastest), or empty (none kept). The largest magnitude of rows [0, stable) is `top` (that of rows
// [counted, stable) joins it here), of all n rows `top` and rows [stable, n); the tensor scale is
// NVFP4's for it (`tensor_scale`, in float32). Rows from `kept` (from 0 when the scale moved) are
// rounded to NVFP4 under it as the codec's round trip does, block by block along r. Returns (largest
// magnitude of rows [0, stable), the scale, the first row rounded), or a first row of -1 when a row
// is not finite (nothing rounded: the caller refuses as the codec does).
inline std::vector<double> hold_lowrank(torch::Tensor raw, torch::Tensor held, torch::Tensor tiles,
                                        int64_t counted, int64_t stable, int64_t n, double top, int64_t kept,
                                        double kept_scale) {
  TORCH_CHECK(raw.dim() == 4 && raw.scalar_type() == torch::kFloat32 && raw.stride(-1) == 1 &&
                  held.dim() == 4 && held.scalar_type() == torch::kFloat32 && held.stride(-1) == 1,
              "raw and held must be float32 [B, Hk, rows, r] with a contiguous last dimension");
  const int64_t B = raw.size(0), Hk = raw.size(1), r = raw.size(3);
  TORCH_CHECK(held.size(0) == B && held.size(1) == Hk && held.size(3) == r && r % 16 == 0,
              "raw and held disagree on shape, or r is not a multiple of 16");
  TORCH_CHECK(0 <= counted && 0 <= stable && stable <= n && n <= raw.size(2) && n <= held.size(2) &&
                  0 <= kept && kept <= n, "need 0 <= counted, stable <= n <= rows and 0 <= kept <= n");
  const bool tiled = tiles.numel() > 0;
  TORCH_CHECK(!tiled || (tiles.dim() == 5 && tiles.scalar_type() == torch::kFloat32 && tiles.size(0) == B &&
                         tiles.size(1) == Hk && tiles.size(3) == r && tiles.size(4) == 16 &&
                         tiles.size(2) * 16 >= n && tiles.stride(4) == 1 && tiles.stride(3) == 16 &&
                         tiles.stride(2) == r * 16),
              "tiles must be float32 [B, Hk, >= n / 16, r, 16], contiguous past dim 1 (or empty: none kept)");
  const float* rp = raw.data_ptr<float>();
  float* hp = held.data_ptr<float>();
  float* tp = tiled ? tiles.data_ptr<float>() : nullptr;
  auto row = [&](const float* base, int64_t bh, int64_t i) {
    return base + (bh / Hk) * raw.stride(0) + (bh % Hk) * raw.stride(1) + i * raw.stride(2);
  };
  auto amax = [&](int64_t a, int64_t b, float m) {
    for (int64_t bh = 0; bh < B * Hk; bh++)
      for (int64_t i = a; i < b; i++) {
        const float* x = row(rp, bh, i);
        for (int64_t c = 0; c < r; c++) m = std::max(m, std::fabs(x[c]));
      }
    return m;
  };
  const float top_stable = amax(std::min(counted, stable), stable, (float)top);
  const float wanted = amax(stable, n, top_stable) / (448.0f * 6.0f);
  const float scale = wanted >= 0x1p-100f ? wanted : 1.0f;
  const int64_t from = (double)scale == kept_scale ? kept : 0;
  for (int64_t bh = 0; bh < B * Hk; bh++)
    for (int64_t i = from; i < n; i++)
      for (int64_t c = 0; c < r; c++)
        if (!std::isfinite(row(rp, bh, i)[c])) return {top_stable, scale, -1.0};
  constexpr float VALUES[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float tiny = std::numeric_limits<float>::min();
  for (int64_t bh = 0; bh < B * Hk; bh++)
    for (int64_t i = from; i < n; i++) {
      const float* x = row(rp, bh, i);
      float* y = hp + (bh / Hk) * held.stride(0) + (bh % Hk) * held.stride(1) + i * held.stride(2);
      for (int64_t c0 = 0; c0 < r; c0 += 16) {
        float m = 0.0f;
        for (int c = 0; c < 16; c++) m = std::max(m, std::fabs(x[c0 + c]));
        const float eff = static_cast<float>(c10::Float8_e4m3fn(m / 6.0f / scale)) * scale;
        const float div = std::max(eff, tiny);
        for (int c = 0; c < 16; c++) {
          if (!(eff > 0.0f)) {
            y[c0 + c] = 0.0f;
            continue;
          }
          const uint8_t code = kv::e2m1_code(x[c0 + c] / div);
          const float v = VALUES[code & 7] * eff;
          y[c0 + c] = code & 8 ? -v : v;
        }
      }
      if (tiled) {  // the same row, transposed into its tile
        float* T = tp + (bh / Hk) * tiles.stride(0) + (bh % Hk) * tiles.stride(1) + (i / 16) * tiles.stride(2) + i % 16;
        for (int64_t c = 0; c < r; c++) T[c * 16] = y[c];
      }
    }
  return {top_stable, scale, (double)from};
}
