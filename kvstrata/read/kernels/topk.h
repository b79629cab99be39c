// Top-k selection for sparse decode reads, scored straight from a layer's index rows: each KV
// head's projected queries dotted with every candidate row (the decode kernel's `dots`), reduced
// over the group's query heads (max, or V4.1's sum of ReLUs), and the k best kept by a partial
// selection -- no score tensor, sort or sliced copy per layer and step.
#pragma once

#include "linalg.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <functional>

namespace kv {
namespace {

// The k best of positions [lo, hi) for one KV head, ascending: q [G, r] queries, rows[i * rs ..]
// index row i. A score that is NaN ranks last; equal scores rank the lower position first.
inline void topk_one(const float* q, int G, int r, const float* rows, int64_t rs, int64_t lo, int64_t hi,
                     int64_t k, bool relu_sum, int64_t* out) {
  const int64_t n = hi - lo;
  std::vector<float> s(n), t(n);
  for (int g = 0; g < G; g++) {
    float* dst = g == 0 ? s.data() : t.data();
    dots(q + (int64_t)g * r, rows + lo * rs, (int)n, r, (int)rs, dst);
    if (relu_sum) {
      for (int64_t i = 0; i < n; i++) dst[i] = std::max(dst[i], 0.f);
    }
    if (g > 0) {
      if (relu_sum)
        for (int64_t i = 0; i < n; i++) s[i] += t[i];
      else
        for (int64_t i = 0; i < n; i++) s[i] = std::max(s[i], t[i]);
    }
  }
  for (int64_t i = 0; i < n; i++)
    if (std::isnan(s[i])) s[i] = -std::numeric_limits<float>::infinity();
  // the k-th best score by a selection over the scores themselves, then one ascending pass: every
  // position above it, and of those equal to it the lowest ones
  t.assign(s.begin(), s.end());
  std::nth_element(t.begin(), t.begin() + (k - 1), t.end(), std::greater<float>());
  const float kth = t[k - 1];
  int64_t above = 0;
  for (int64_t i = 0; i < n; i++) above += s[i] > kth;
  int64_t ties = k - above, m = 0;
  for (int64_t i = 0; i < n && m < k; i++)
    if (s[i] > kth || (s[i] == kth && ties-- > 0)) out[m++] = lo + i;
}

}  // namespace
}  // namespace kv

// q: [B, Hk, G, r] float32 (each KV head's query heads, projected as its index rows are); rows:
// [B, Hk, n, r] float32 (last dim contiguous). Returns int64 [B, Hk, k]: per KV head the k positions
// in [lo, hi) scoring highest, ascending.
inline torch::Tensor topk_positions(torch::Tensor q, torch::Tensor rows, int64_t k, int64_t lo, int64_t hi,
                                    bool relu_sum) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == torch::kFloat32, "q must be float32 [B, Hk, G, r]");
  TORCH_CHECK(rows.dim() == 4 && rows.scalar_type() == torch::kFloat32 && rows.stride(-1) == 1,
              "rows must be float32 [B, Hk, n, r] with a contiguous last dimension");
  q = q.contiguous();
  const int64_t B = q.size(0), Hk = q.size(1), G = q.size(2), r = q.size(3), n = rows.size(2);
  TORCH_CHECK(rows.size(0) == B && rows.size(1) == Hk && rows.size(3) == r, "q and rows disagree on shape");
  TORCH_CHECK(0 <= lo && lo <= hi && hi <= n && 1 <= k && k <= hi - lo, "need 0 <= lo <= hi <= n and 1 <= k <= hi - lo");
  auto out = torch::empty({B, Hk, k}, torch::dtype(torch::kInt64));
  const float* qp = q.data_ptr<float>();
  const float* rp = rows.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B * Hk, 1, [&](int64_t a, int64_t b) {
    for (int64_t bh = a; bh < b; bh++) {
      const float* head = rp + (bh / Hk) * rows.stride(0) + (bh % Hk) * rows.stride(1);
      kv::topk_one(qp + bh * G * r, (int)G, (int)r, head, rows.stride(2), lo, hi, k, relu_sum, op + bh * k);
    }
  });
  return out;
}
