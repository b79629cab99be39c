// y = x W^T + b for the few rows of a decode step (`kvstrata.hf.linear`): each weight row streams from
// memory once for every row of x, and each output is one fixed sum (16-lane FMAs along K in order,
// then one horizontal add) whatever the number of rows, so a row's result does not depend on the
// rows beside it (batch-invariant: a batched step computes what a single one does). float32 or bf16
// weights (widened in registers, summed in float32); AVX-512 builds only (`linear_rows_ok`).
#pragma once

#include "codes.h"

#include <ATen/Parallel.h>

namespace kv {
namespace {

#if KV_AVX512
template <bool BF>
inline __m512 weights16(const char* w, int64_t k, __mmask16 mask) {
  if constexpr (BF) {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, reinterpret_cast<const uint16_t*>(w) + k);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_maskz_loadu_ps(mask, reinterpret_cast<const float*>(w) + k);
  }
}

// out[m * R + r] = x[m] . w[r] for R weight rows (byte stride ws) and M rows of x (stride K).
// Accumulators stay in registers (M * R <= 16); the tail of K goes through masked loads.
template <bool BF, int R, int M>
inline void dot_block(const char* w, int64_t ws, const float* x, int64_t K, float* out, const char* next) {
  __m512 acc[M * R];
#pragma GCC unroll 16
  for (int i = 0; i < M * R; i++) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
    __m512 wv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) wv[r] = weights16<BF>(w + r * ws, k, mask);
    if (next && (!BF || (k & 16) == 0))  // the next block's rows, a cache line per row per 64 bytes
#pragma GCC unroll 4
      for (int r = 0; r < R; r++) _mm_prefetch(next + r * ws + k * (BF ? 2 : 4), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int m = 0; m < M; m++) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * K + k);
#pragma GCC unroll 4
      for (int r = 0; r < R; r++) acc[m * R + r] = _mm512_fmadd_ps(wv[r], xv, acc[m * R + r]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < M * R; i++) out[i] = _mm512_reduce_add_ps(acc[i]);
}

template <bool BF, int R>
inline void dot_rows(const char* w, int64_t ws, const float* x, int64_t K, int M, float* out, const char* next) {
  switch (M) {
    case 1: dot_block<BF, R, 1>(w, ws, x, K, out, next); break;
    case 2: dot_block<BF, R, 2>(w, ws, x, K, out, next); break;
    case 3: dot_block<BF, R, 3>(w, ws, x, K, out, next); break;
    default: dot_block<BF, R, 4>(w, ws, x, K, out, next);
  }
}

// four weight rows at a time (one at a time for the last few), x's rows four at a time
template <bool BF>
void linear_rows_impl(const float* x, const char* w, const float* bias, int64_t M, int64_t N, int64_t K, float* y) {
  constexpr int R = 4;
  const int64_t ws = K * (BF ? 2 : 4);
  at::parallel_for(0, (N + R - 1) / R, 16, [&](int64_t lo, int64_t hi) {
    float part[4 * R];
    for (int64_t blk = lo; blk < hi; blk++) {
      const int64_t n0 = blk * R;
      const int r = (int)std::min<int64_t>(R, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int mm = (int)std::min<int64_t>(4, M - m0);
        if (r == R) {  // the first pass over x's rows prefetches the next block's weights
          const char* next = m0 == 0 && n0 + 2 * R <= N ? w + (n0 + R) * ws : nullptr;
          dot_rows<BF, R>(w + n0 * ws, ws, x + m0 * K, K, mm, part, next);
        } else {
          for (int i = 0; i < r; i++) {
            float one[4];
            dot_rows<BF, 1>(w + (n0 + i) * ws, ws, x + m0 * K, K, mm, one, nullptr);
            for (int m = 0; m < mm; m++) part[m * R + i] = one[m];
          }
        }
        for (int m = 0; m < mm; m++)
          for (int i = 0; i < r; i++) y[(m0 + m) * N + n0 + i] = part[m * R + i] + (bias ? bias[n0 + i] : 0.f);
      }
    }
  });
}
#endif

}  // namespace

// Whether this build computes `linear_rows` (AVX-512 builds; others leave linears to torch).
inline bool linear_rows_ok() { return KV_AVX512 != 0; }

// x [..., K] and w [N, K] of one dtype (float32 or bf16), bias [N] or undefined -> [..., N] in x's dtype.
inline torch::Tensor linear_rows(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(linear_rows_ok(), "linear_rows needs an AVX-512 build");
  TORCH_CHECK(w.dim() == 2 && x.dim() >= 1 && x.size(-1) == w.size(1), "linear_rows: x [..., K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "linear_rows: x and w differ in dtype");
  const bool bf = w.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf || w.scalar_type() == torch::kFloat32, "linear_rows: float32 or bf16 weights");
  const int64_t K = w.size(1), N = w.size(0);
  const torch::Tensor xf = x.reshape({-1, K}).to(torch::kFloat32).contiguous();
  const torch::Tensor wc = w.contiguous();
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "linear_rows: bias [N]");
    b = bias->to(torch::kFloat32).contiguous();
  }
  const int64_t M = xf.size(0);
  torch::Tensor y = torch::empty({M, N}, xf.options());
#if KV_AVX512
  const char* wp = reinterpret_cast<const char*>(wc.data_ptr());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  if (bf) linear_rows_impl<true>(xf.data_ptr<float>(), wp, bp, M, N, K, y.data_ptr<float>());
  else linear_rows_impl<false>(xf.data_ptr<float>(), wp, bp, M, N, K, y.data_ptr<float>());
#endif
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  return y.to(x.scalar_type()).reshape(sizes);
}

}  // namespace kv
