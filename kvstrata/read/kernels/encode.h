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
#include <cstring>
#include <limits>

namespace kv {

// magnitudes above these (strictly) take the next code: the midpoints between E2M1's magnitudes,
// those where a tie goes up (0.75, 1.75, 3.5) taken at the float just below them
constexpr float E2M1_ABOVE[7] = {0.25f, 0x1.7ffffep-1f, 1.25f, 0x1.bffffep+0f, 2.5f, 0x1.bffffep+1f, 5.0f};

inline uint8_t e2m1_code(float x) {
  const float a = std::fabs(x);
  uint8_t mag = 0;
  for (float t : E2M1_ABOVE) mag += a > t;
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
      if (!(eff > 0.0f)) {  // the block scale underflowed: the block encodes as zeros
        std::memset(c + b * 8, 0, 8);
        continue;
      }
      const float div = std::max(eff, tiny);
      for (int i = 0; i < 8; i++) c[b * 8 + i] = e2m1_code(v[2 * i] / div) | (e2m1_code(v[2 * i + 1] / div) << 4);
    }
  });
  return {codes, scales};
}

}  // namespace kv
