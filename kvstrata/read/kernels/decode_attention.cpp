// Decode attention straight from encoded KV (one query token per sequence), flash-decoding style.
//
// The layer's K and V are runs of encoded tokens (bf16, FP8 E4M3, NVFP4, MXFP4, INT4/INT3/INT2 with
// keys per token or grouped per channel as KIVI stores them, or float32 for the full-precision
// tail). Each work item (batch row, KV head, slice of tokens) decodes a tile of at most 64 tokens
// into a small buffer, scores it against every query head of the KV group (GQA: one pass over the
// codes), and folds it into an online softmax; slices are merged at the end. Nothing the size of
// the layer is ever decoded.
#include "codes.h"
#include "encode.h"
#include "fused.h"
#include "int8.h"
#include "linalg.h"
#include "linear.h"
#include "topk.h"

#include <ATen/Parallel.h>

#include <memory>

namespace {

using namespace kv;

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


// bias (or null): [G, total] scores added before scaling at each token's logical position (`starts`:
// where each run's visible tokens begin); int8: E2M1 keys scored in integers (int8.h)
void attend_tiles(const std::vector<Run>& K, const std::vector<Run>& V, const Tile* tiles, int ntiles,
                  const int64_t* rows, const float* q, int G, int d, int dp, int64_t b, int64_t h, float scaling,
                  float softcap, const float* bias, const int64_t* starts, int64_t total, bool int8, Partial& out) {
  std::vector<float> kbuf(TILE * dp), vbuf(TILE * dp), s(G * TILE);
  std::unique_ptr<QInt8> qi;  // the query rounded to int8, once, where a run is scored in integers
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
      if (!channel_scores_from_codes(kr, b, h, tile.row, n, d, q, G, s.data())) {
        decode_channel_tile(kr, b, h, tile.row, n, d, kbuf.data());
        channel_scores(q, G, d, kbuf.data(), n, s.data());
      }
    } else if (int8 && int8_scorable(kr, d, G)) {
      if (!qi) {
        qi = std::make_unique<QInt8>();
        quantize_query(q, G, d, *qi);
      }
      int8_scores(kr, b, h, rows ? rows + ti * TILE : nullptr, tile.row, n, d, G, *qi, s.data());
    } else if (fusable(kr, d, G)) {
      scores_from_codes(kr, b, h, rows ? rows + ti * TILE : nullptr, tile.row, n, d, q, G, s.data());
    } else {
      decode_tile(kr, b, h, rows ? rows + ti * TILE : nullptr, tile.row, n, d, dp, kbuf.data());
      dots_group(q, G, kbuf.data(), n, d, dp, s.data());
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
      if (softcap > 0.f) {
        for (int i = 0; i < n; i++) sg[i] = softcap * std::tanh(sg[i] * scaling / softcap);
      } else {
#pragma omp simd
        for (int i = 0; i < n; i++) sg[i] *= scaling;
      }
      const float mt = max_of(sg, n);
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
    if (fusable(vr, d, G)) {
      accumulate_from_codes(vr, b, h, rows ? rows + ti * TILE : nullptr, tile.row, n, d, s.data(), G, out.acc.data());
    } else {
      decode_tile(vr, b, h, rows ? rows + ti * TILE : nullptr, tile.row, n, d, dp, vbuf.data());
      accumulate_group(s.data(), G, vbuf.data(), n, d, dp, out.acc.data());
    }
  }
}

// Tiles covering the visible tokens of every run in order; a channel-grouped run's first tile ends
// at a group boundary, so every later tile starts on one (and decodes group by group).
std::vector<Tile> dense_tiles(const std::vector<Run>& K) {
  std::vector<Tile> tiles;
  for (int sgi = 0; sgi < (int)K.size(); sgi++) {
    const Run& r = K[sgi];
    int64_t t = r.skip;
    while (t < r.length) {
      int64_t end = std::min<int64_t>(r.length, t + TILE);
      if (r.channel && t % r.block) end = std::min<int64_t>(end, (t / r.block + 1) * r.block);
      tiles.push_back({sgi, t, (int)(end - t)});
      t = end;
    }
  }
  return tiles;
}

// One sequence's attention problem: its runs, tiles and work split. A varlen call holds one per
// request; each is split exactly as a single call would split it, so every row's result is the
// single-request kernel's, bit for bit.
using Ints = std::vector<int64_t>;  // run descriptors come as Python lists: no tensor built per step
using Floats = std::vector<double>;

struct Problem {
  torch::Tensor q, idx, bias, out;
  std::vector<Run> K, V;
  std::vector<int64_t> starts;  // logical position where each run's visible tokens begin
  std::vector<Tile> all;        // dense tiles (empty when sparse)
  std::vector<Partial> parts;
  std::vector<float> scaled;  // per NVFP4 run: its 256 scale values times its tensor scale
  int64_t B = 0, Hq = 0, Hk = 1, total = 0, m = 0, units = 0, splits = 1;
  int d = 0, dp = 0, G = 1;
  bool sparse = false, biased = false, int8 = false;  // int8: KVSTRATA_KERNEL_SCORES, read once per call
  int64_t work() const { return B * Hk * splits; }
};

// q: [B, Hq, d] float32; parts: 3 tensors per run (codes, scales, mins; undefined/empty when unused);
// meta: 5 ints per run, flat (kind, channel, length, skip, block); tscale: one per run; K and V runs
// pair up (same tokens). idx: int64 [B, Hk, m] logical positions over the visible tokens of the runs
// in order (sorted), or empty for every token. bias: float32 [B, Hq, visible tokens] added to the
// scores before scaling (outlier key channels kept apart), or empty.
void prepare(Problem& p, const torch::Tensor& q, const std::vector<torch::Tensor>& kparts, const Ints& kmeta,
             const Floats& kts, const std::vector<torch::Tensor>& vparts, const Ints& vmeta, const Floats& vts,
             const torch::Tensor& idx, const torch::Tensor& bias, int threads) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q must be contiguous float32 [B, Hq, d]");
  p.q = q;
  p.B = q.size(0);
  p.Hq = q.size(1);
  p.d = (int)q.size(2);
  TORCH_CHECK(p.d <= MAX_DIM, "head_dim too large");
  const int64_t nruns = (int64_t)kts.size();
  TORCH_CHECK((int64_t)kmeta.size() == 5 * nruns && (int64_t)vmeta.size() == 5 * nruns && (int64_t)vts.size() == nruns &&
                  (int64_t)kparts.size() == 3 * nruns && (int64_t)vparts.size() == 3 * nruns,
              "K and V need the same runs: 3 parts, 5 meta ints and 1 scale each");
  p.dp = p.d;
  for (int64_t i = 0; i < nruns; i++) {
    p.K.push_back(make_run(kparts, kmeta.data() + 5 * i, (float)kts[i], i));
    p.V.push_back(make_run(vparts, vmeta.data() + 5 * i, (float)vts[i], i));
    for (const Run* r : {&p.K.back(), &p.V.back()})
      if (!r->channel && r->block > 0) p.dp = std::max(p.dp, (int)((p.d + r->block - 1) / r->block * r->block));
  }
  p.scaled.resize(2 * nruns * 256);
  for (int64_t i = 0; i < 2 * nruns; i++) {
    Run& r = i < nruns ? p.K[i] : p.V[i - nruns];
    if (r.kind != NVFP4) continue;
    float* t = p.scaled.data() + 256 * i;
    for (int x = 0; x < 256; x++) t[x] = T.e4m3[x] * r.tscale;
    r.scaled = t;
  }
  // Channel-grouped key runs decode into a [d, TILE] buffer; rows need dp columns
  p.Hk = p.K.empty() ? 1 : (kparts[0].dim() >= 2 ? kparts[0].size(1) : 1);
  TORCH_CHECK(p.Hq % p.Hk == 0, "query heads must be a multiple of KV heads");
  p.G = (int)(p.Hq / p.Hk);
  p.sparse = idx.defined() && idx.numel() > 0;
  p.int8 = int8_scores_asked();
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
                 p.starts.data(), p.total, p.int8, p.parts[w]);
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
               p.starts.data(), p.total, p.int8, p.parts[w]);
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
torch::Tensor decode_attention(torch::Tensor q, std::vector<torch::Tensor> kparts, Ints kmeta, Floats kts,
                               std::vector<torch::Tensor> vparts, Ints vmeta, Floats vts, double scaling,
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
    std::vector<torch::Tensor> qs, std::vector<std::vector<torch::Tensor>> kparts, std::vector<Ints> kmeta,
    std::vector<Floats> kts, std::vector<std::vector<torch::Tensor>> vparts, std::vector<Ints> vmeta,
    std::vector<Floats> vts, double scaling, double softcap, std::vector<torch::Tensor> idx,
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
  m.def("isa", []() { return std::string(kv::isa()); }, "the instruction set this build decodes with");
  m.def("int8_scores", []() { return kv::INT8_SCORES; }, "whether this build can score E2M1 keys in int8 (VNNI)");
  m.def("reads_in_registers", []() { return kv::READS_IN_REGISTERS; }, "whether token-major codes are read in registers");
  m.def("decode_attention", &decode_attention, "decode attention over encoded KV runs");
  m.def("topk_positions", &topk_positions, "the k best index positions per KV head (sparse reads)");
  m.def("read_positions", &read_positions, "the positions a sparse decode step reads per KV head: sinks, the k best, window");
  m.def("hold_lowrank", &hold_lowrank, "lowrank index rows rounded to NVFP4 in place, under their largest magnitude's scale");
  m.def("decode_attention_varlen", &decode_attention_varlen, "decode attention for many sequences in one call");
  m.def("linear_rows", &kv::linear_rows, "y = x w^T + b for a decode step's few rows, batch-invariant");
  m.def("linear_rows_ok", &kv::linear_rows_ok, "whether this build computes linear_rows");
  m.def("encode_nvfp4", &kv::encode_nvfp4, "NVFP4 blocks -> (E2M1 codes, E4M3 scales), as the PyTorch codec encodes them");
}
