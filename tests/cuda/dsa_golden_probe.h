// A probe of the deepseek_v32 golden case (test_cuda_golden_model.cpp's DeepSeek-V3.2 case, which
// holds the GPU to the reference with its top-k choices): where does a run leave the reference?
// ProbeBackend forwards every op to the backend it wraps (it is a disabled TimingBackend, which
// always has every op) and records, in a forward, the residual stream (the input of every
// hidden-size RMSNorm: each layer's input, its sum after attention, the final norm's input) and
// each DSA layer's indexer operands and own selection; it can also replace every selection by a
// given one (the fixture's), which separates the effect of flipped top-k choices from everything
// else. No CUDA here: the same code probes the CPU reference.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/base/host_convert.h"
#include "core/io/hf_index.h"
#include "core/io/safetensors.h"
#include "core/model/model.h"
#include "core/model/peft_adapter.h"
#include "golden_files.h"
#include "kernels/ops.h"
#include "kernels/timing_backend.h"

namespace moetrain::testing {

// One dsa_indexer_topk call, on the host: q [n, Hi, di], k [n, di], w [n, Hi] (F64) and the
// selection [n, top_k] (I32).
struct IndexerCall {
  Tensor q, k, w, selected;
  double scale = 1.0;
};

class ProbeBackend final : public kernels::TimingBackend {
 public:
  // `inner` must outlive this. hidden: the residual stream's width; layers: DSA layers per forward.
  ProbeBackend(kernels::Backend& inner, int64_t hidden, int64_t layers)
      : TimingBackend(inner), hidden_(hidden), layers_(layers) {
    disable();  // timing off: every other op is forwarded as it is
  }

  std::vector<Tensor> residual;      // F64 [tokens, hidden], in call order
  std::vector<IndexerCall> indexer;  // in call order
  std::vector<Tensor> forced;        // I32 [tokens, top_k] per layer; empty: keep the backend's selection

  void rmsnorm_forward(const kernels::RmsNormArgs& args) override {
    if (args.x.ndim() == 2 && args.x.size(1) == hidden_) residual.push_back(host_f64(args.x));
    TimingBackend::rmsnorm_forward(args);
  }
  // Records the backend's own selection, then (when forcing) overwrites it.
  void dsa_indexer_topk(const kernels::DsaIndexerArgs& args) override {
    TimingBackend::dsa_indexer_topk(args);
    IndexerCall call{host_f64(args.q), host_f64(args.k), host_f64(args.weights),
                     Tensor(args.topk_index.shape, DType::kI32), args.scale};
    copy(call.selected, args.topk_index);
    indexer.push_back(std::move(call));
    if (!forced.empty()) copy(args.topk_index, forced[static_cast<size_t>(calls_ % layers_)]);
    ++calls_;
  }

 private:
  Tensor host_f64(const TensorView& v) {
    Tensor staged(v.shape, v.dtype);
    copy(staged, v);
    Tensor out(v.shape, DType::kF64);
    convert_host(out, staged);
    return out;
  }

  int64_t hidden_, layers_;
  int64_t calls_ = 0;
};

// What one forward (logits()) of the fixture's model saw: the recordings, the logits (host F64)
// and their loss.
struct ProbeRun {
  std::vector<Tensor> residual;
  std::vector<IndexerCall> indexer;
  Tensor logits;
  double loss = 0.0;
};

inline ProbeRun probe_fixture(kernels::Backend& backend, DType dtype, const std::string& dir,
                              std::vector<Tensor> forced = {}) {
  SafetensorsFile golden(dir + "/golden.safetensors");
  const Batch batch = golden_batch(golden);
  Config config;
  config.model.hf_dir = dir;
  config.data.seq_len = batch.seq_len;
  const ModelSpec spec = resolve_model_spec(config);
  ProbeBackend probe(backend, spec.config.hidden_size, static_cast<int64_t>(spec.mixers.size()));
  probe.forced = std::move(forced);
  ProbeRun run;
  {
    ModelOptions options = golden_model_options(dir, spec);
    options.dtype = dtype;
    Model model(spec, probe, options);
    model.load_weights(HfCheckpoint(dir));
    load_peft_adapter(model, dir + "/adapter");
    run.logits = model.logits(batch);
  }
  // The mean cross-entropy of those logits over the targets (what the training step computes).
  const int64_t vocab = run.logits.size(1);
  for (size_t t = 0; t < batch.labels.size(); ++t) {
    if (batch.labels[t] < 0) continue;
    const double* row = run.logits.ptr<double>() + static_cast<int64_t>(t) * vocab;
    const double top = *std::max_element(row, row + vocab);
    double total = 0.0;
    for (int64_t v = 0; v < vocab; ++v) total += std::exp(row[v] - top);
    run.loss += (top + std::log(total) - row[batch.labels[t]]) / static_cast<double>(batch.num_targets());
  }
  run.residual = std::move(probe.residual);
  run.indexer = std::move(probe.indexer);
  return run;
}

// Indexer scores of query t over keys [start, t] in double from a recorded call's operands.
inline std::vector<double> indexer_scores(const IndexerCall& c, int64_t t, int64_t start) {
  const int64_t heads = c.q.size(1), dim = c.q.size(2);
  const double* q = c.q.ptr<double>();
  const double* k = c.k.ptr<double>();
  const double* w = c.w.ptr<double>();
  std::vector<double> scores;
  for (int64_t s = start; s <= t; ++s) {
    double score = 0.0;
    for (int64_t j = 0; j < heads; ++j) {
      double dot = 0.0;
      for (int64_t d = 0; d < dim; ++d) dot += q[(t * heads + j) * dim + d] * k[s * dim + d];
      score += w[t * heads + j] * std::max(dot, 0.0);
    }
    scores.push_back(c.scale * score);
  }
  return scores;
}

// Query t's selected keys (ascending, padding dropped).
inline std::vector<int32_t> selected_keys(const Tensor& selection, int64_t t) {
  const int64_t k = selection.size(1);
  std::vector<int32_t> keys;
  for (int64_t i = 0; i < k; ++i) {
    const int32_t s = selection.ptr<int32_t>()[t * k + i];
    if (s >= 0) keys.push_back(s);
  }
  std::sort(keys.begin(), keys.end());
  return keys;
}

// k-th minus (k+1)-th largest score, relative to the largest |score| (inf with <= k keys).
inline double relative_margin(std::vector<double> scores, size_t k) {
  if (scores.size() <= k) return INFINITY;
  std::sort(scores.begin(), scores.end(), [](double a, double b) { return a > b; });
  const double top = std::max(std::fabs(scores.front()), 1e-300);
  return (scores[k - 1] - scores[k]) / top;
}

// Prints, per layer: the residual stream's scaled error against the fixture (layer input, after
// attention); the indexer operands' scaled error against `reference` (a CPU F32 run); how many
// queries and (query, key) choices differ from the fixture's selection, with the reference's
// relative top-k margin at those queries (the run's own selection, before any forcing); how many
// queries that selection differs from a float64 top-k of the run's own operands at (non-zero: the
// kernel's F32 score rounding flipped a choice, or a kernel bug); then the logits' scaled error
// and the loss. Returns that last count summed over the layers.
inline int report_probe(const std::string& label, const ProbeRun& run, const ProbeRun& reference,
                         const SafetensorsFile& golden, int64_t seq_len) {
  const int64_t layers = static_cast<int64_t>(run.indexer.size());
  int total_own_flips = 0;
  std::printf("== %s\n", label.c_str());
  for (int64_t l = 0; l < layers; ++l) {
    const std::string in_name = l == 0 ? "hidden.embed" : "hidden.layers." + std::to_string(l - 1);
    Tensor input = golden.read_as(in_name, DType::kF64);
    Tensor mid = golden.read_as("attn_out.layers." + std::to_string(l), DType::kF64);
    for (int64_t i = 0; i < mid.numel(); ++i) mid.ptr<double>()[i] += input.ptr<double>()[i];
    const IndexerCall& ours = run.indexer[static_cast<size_t>(l)];
    const IndexerCall& ref = reference.indexer[static_cast<size_t>(l)];
    const Tensor want = fixture_selection(golden, l, seq_len);
    const int64_t tokens = ours.selected.size(0), k = ours.selected.size(1);
    int queries = 0, choices = 0, own_flips = 0;
    double worst_margin = 0.0, min_margin = INFINITY;
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t start = t / seq_len * seq_len;
      const double margin = relative_margin(indexer_scores(ref, t, start), static_cast<size_t>(k));
      min_margin = std::min(min_margin, margin);
      const std::vector<int32_t> got = selected_keys(ours.selected, t), expected = selected_keys(want, t);
      if (got != expected) {
        std::vector<int32_t> missing;
        std::set_difference(expected.begin(), expected.end(), got.begin(), got.end(), std::back_inserter(missing));
        ++queries;
        choices += static_cast<int>(missing.size());
        worst_margin = std::max(worst_margin, margin);
        std::printf("   layer %lld query %lld: keys differ by %zu, reference relative margin %.3g\n",
                    static_cast<long long>(l), static_cast<long long>(t), missing.size(), margin);
      }
      // The run's own operands in float64: which keys would an exact top-k take (ties to lower s)?
      std::vector<double> own = indexer_scores(ours, t, start);
      std::vector<int32_t> order(own.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(start + static_cast<int64_t>(i));
      std::stable_sort(order.begin(), order.end(),
                       [&](int32_t a, int32_t b) { return own[a - start] > own[b - start]; });
      order.resize(std::min(order.size(), static_cast<size_t>(k)));
      std::sort(order.begin(), order.end());
      own_flips += order != got;
    }
    std::printf(
        "layer %lld: stream error in %.3g, after attention %.3g | indexer vs reference run: q %.3g k %.3g w %.3g | "
        "selection vs fixture: %d queries, %d keys differ (largest reference margin among them %.3g; smallest "
        "margin of any query %.3g) | own selection vs a float64 top-k of its own operands: %d queries differ\n",
        static_cast<long long>(l), scaled_error(run.residual[static_cast<size_t>(2 * l)], input),
        scaled_error(run.residual[static_cast<size_t>(2 * l + 1)], mid), scaled_error(ours.q, ref.q),
        scaled_error(ours.k, ref.k), scaled_error(ours.w, ref.w), queries, choices, worst_margin, min_margin,
        own_flips);
    total_own_flips += own_flips;
  }
  std::printf("logits scaled error %.3g, loss %.6f vs %.6f (%.2g relative)\n",
              scaled_error(run.logits, golden.read_as("logits", DType::kF64)), run.loss,
              golden.read_as("loss", DType::kF64).ptr<double>()[0],
              std::fabs(run.loss / golden.read_as("loss", DType::kF64).ptr<double>()[0] - 1.0));
  return total_own_flips;
}

}  // namespace moetrain::testing
