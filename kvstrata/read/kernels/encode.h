// Encoding a step's new rows in one call: NVFP4 blocks (E2M1 codes under E4M3 block scales).
//
// The same arithmetic as the PyTorch codec (`kvstrata.codecs.nvfp4`, minmax fit), in the same order,
// so the codes equal it bit for bit (tests): block scale = E4M3((amax / 6) / tensor scale) through
// torch's own float -> E4M3 conversion, the block divided by its effective scale, each magnitude's
// code the count of rounding midpoints below it (ties to the even code), the sign kept unless the
// code is 0, two codes per byte (low nibble first).
#pragma once

#include <torch/extension.h>

#include <c10/util/Float8_e4m3fn.h>

#include <cmath>
#include <limits>

namespace kv {

// magnitudes above these (strictly) take the next code: the midpoints between E2M1's magnitudes,
// those where a tie goes up taken at the float just below them
inline float e2m1_midpoint(int i) {
  static const float up[3] = {std::nextafter(0.75f, 0.0f), std::nextafter(1.75f, 0.0f),
                              std::nextafter(3.5f, 0.0f)};
  static const float above[7] = {0.25f, up[0], 1.25f, up[1], 2.5f, up[2], 5.0f};
  return above[i];
}

inline uint8_t e2m1_code(float x) {
  const float a = std::fabs(x);
  uint8_t mag = 0;
  for (int i = 0; i < 7; i++) mag += a > e2m1_midpoint(i);
  return mag | ((x < 0.0f && mag > 0) ? 8 : 0);
}

// blocks: float32 [n, 16]; tscale: float32 [n] (each block's tensor scale) -> (codes uint8 [n, 8],
// scales uint8 [n]: the E4M3 bits).
inline std::vector<torch::Tensor> encode_nvfp4(const torch::Tensor& blocks, const torch::Tensor& tscale) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(1) == 16 && blocks.scalar_type() == torch::kFloat32 &&
                  blocks.is_contiguous(), "blocks must be contiguous float32 [n, 16]");
  const int64_t n = blocks.size(0);
  TORCH_CHECK(tscale.dim() == 1 && tscale.size(0) == n && tscale.scalar_type() == torch::kFloat32 &&
                  tscale.is_contiguous(), "tscale must be contiguous float32 [n]");
  auto codes = torch::empty({n, 8}, torch::kUInt8);
  auto scales = torch::empty({n}, torch::kUInt8);
  const float* x = blocks.data_ptr<float>();
  const float* ts = tscale.data_ptr<float>();
  uint8_t* c = codes.data_ptr<uint8_t>();
  uint8_t* s = scales.data_ptr<uint8_t>();
  const float tiny = std::numeric_limits<float>::min();
  at::parallel_for(0, n, 1024, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; b++) {
      const float* v = x + b * 16;
      float amax = 0.0f;
      for (int i = 0; i < 16; i++) amax = std::max(amax, std::fabs(v[i]));
      const c10::Float8_e4m3fn scale(amax / 6.0f / ts[b]);
      s[b] = scale.x;
      const float eff = static_cast<float>(scale) * ts[b];
      const float div = std::max(eff, tiny);
      for (int i = 0; i < 8; i++) {
        const uint8_t lo4 = eff > 0.0f ? e2m1_code(v[2 * i] / div) : 0;
        const uint8_t hi4 = eff > 0.0f ? e2m1_code(v[2 * i + 1] / div) : 0;
        c[b * 8 + i] = lo4 | (hi4 << 4);
      }
    }
  });
  return {codes, scales};
}

}  // namespace kv
