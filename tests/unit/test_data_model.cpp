// Packing is invisible to the model: a window holding two documents gives each document the same
// logits, the same loss, and the same adapter gradients as running the documents on their own
// (in double precision, to rounding): attention masks, KDA's conv and recurrent state and DSA's
// key selection restart at the document boundary. Every mixer the model has joins this test
// through tiny_model_config's layers (MLA, KDA and DSA).
#include <cmath>
#include <memory>

#include "catch.h"
#include "core/data/packing.h"
#include "core/model/model.h"
#include "gradcheck.h"
#include "kernels/ops.h"
#include "test_data_support.h"
#include "tiny_model.h"

namespace moetrain {
namespace {

using testing::DataScratchDir;

// The plan that concatenates `documents` in this order, in one window of their total length.
EpochPlan plan_of(const IndexedDataset& dataset, const std::vector<int64_t>& documents) {
  EpochPlan plan;
  plan.document_order = documents;
  plan.document_starts.push_back(0);
  for (int64_t d : documents) plan.document_starts.push_back(plan.document_starts.back() + dataset.document_length(d));
  plan.window_order = {0};
  return plan;
}

Batch one_window(const IndexedDataset& dataset, const std::vector<int64_t>& documents, int64_t vocab) {
  const EpochPlan plan = plan_of(dataset, documents);
  Batch batch;
  batch.batch_size = 1;
  batch.seq_len = plan.document_starts.back();
  batch.input_ids.resize(batch.seq_len);
  batch.labels.resize(batch.seq_len);
  batch.positions.resize(batch.seq_len);
  std::vector<int32_t> segments;
  pack_window(WindowOut{batch.input_ids.data(), batch.labels.data(), batch.positions.data()}, segments, dataset, plan,
              0, batch.seq_len, vocab);
  batch.cu_seqlens.push_back(0);
  for (int32_t s : segments) batch.cu_seqlens.push_back(batch.cu_seqlens.back() + s);
  return batch;
}

// Summed cross-entropy over rows [begin, end) of `logits` against `labels`.
double loss_of_rows(const Tensor& logits, const std::vector<int32_t>& labels, int64_t begin, int64_t end) {
  const int64_t vocab = logits.size(1);
  double loss = 0.0;
  for (int64_t t = begin; t < end; ++t) {
    if (labels[t] < 0) continue;
    const double* row = logits.ptr<double>() + t * vocab;
    double max = row[0];
    for (int64_t v = 1; v < vocab; ++v) max = std::max(max, row[v]);
    double sum = 0.0;
    for (int64_t v = 0; v < vocab; ++v) sum += std::exp(row[v] - max);
    loss += max + std::log(sum) - row[labels[t]];
  }
  return loss;
}

std::vector<std::vector<double>> gradients(Model& model, kernels::Backend& backend) {
  std::vector<std::vector<double>> grads;
  for (Parameter* p : model.parameters()) {
    Tensor g(p->grad.shape(), DType::kF64);
    backend.copy(g, p->grad);
    grads.emplace_back(g.ptr<double>(), g.ptr<double>() + g.numel());
  }
  return grads;
}

void zero_gradients(Model& model, kernels::Backend& backend) {
  for (Parameter* p : model.parameters()) backend.fill(p->grad, 0.0);
}

TEST_CASE("a packed window of two documents trains exactly like the documents apart") {
  DataScratchDir dir("model");
  Config config = testing::tiny_model_config(/*q_lora=*/true);
  const int64_t vocab = config.model.vocab_size;
  IndexedDatasetContents contents;
  contents.dtype_code = 8;
  contents.documents = {{3, 17, 5, 30, 8, 1, 22}, {11, 4, 36, 9, 0}};
  contents.loss_masks = {{1, 1, 1, 1, 1, 1, 1}, {1, 1, 0, 1, 1}};  // a context-only token in the second
  write_indexed_dataset(dir.file("d"), contents);
  IndexedDataset dataset(dir.file("d"));

  const Batch packed = one_window(dataset, {0, 1}, vocab);
  const Batch first = one_window(dataset, {0}, vocab);
  const Batch second = one_window(dataset, {1}, vocab);
  REQUIRE(packed.cu_seqlens == std::vector<int32_t>{0, 7, 12});
  REQUIRE(packed.num_targets() == first.num_targets() + second.num_targets());
  REQUIRE(second.num_targets() == 3);  // 11 -> 4, 4 -> (36 masked), 36 -> 9, 9 -> 0

  std::unique_ptr<kernels::Backend> backend = kernels::make_cpu_backend();
  ModelOptions options;
  options.dtype = DType::kF64;
  options.lora = LoraSettings{4, 8.0, false};
  options.lora_targets = testing::all_lora_targets(true);
  Model model(resolve_model_spec(config), *backend, options);
  model.init_random_weights();
  uint64_t seed = 7;
  for (Parameter* p : model.parameters()) testing::fill_random(p->value, seed++, 0.05, 0.3);  // B != 0

  // Logits: each document's rows of the packed window equal its rows alone.
  const Tensor packed_logits = model.logits(packed);
  const Tensor first_logits = model.logits(first);
  const Tensor second_logits = model.logits(second);
  double max_logit_diff = 0.0;
  for (int64_t t = 0; t < 12; ++t) {
    const Tensor& alone = t < 7 ? first_logits : second_logits;
    const int64_t row = t < 7 ? t : t - 7;
    for (int64_t v = 0; v < vocab; ++v) {
      max_logit_diff = std::max(max_logit_diff, std::abs(packed_logits.ptr<double>()[t * vocab + v] -
                                                         alone.ptr<double>()[row * vocab + v]));
    }
  }
  CHECK(max_logit_diff < 1e-10);

  // Per-document losses and the adapters' gradients.
  zero_gradients(model, *backend);
  const StepResult packed_step = model.forward_backward(packed, 1.0);
  const std::vector<std::vector<double>> packed_grads = gradients(model, *backend);
  zero_gradients(model, *backend);
  const StepResult first_step = model.forward_backward(first, 1.0);
  const StepResult second_step = model.forward_backward(second, 1.0);  // accumulates onto the first's
  const std::vector<std::vector<double>> apart_grads = gradients(model, *backend);

  const double packed_first = loss_of_rows(packed_logits, packed.labels, 0, 7);
  const double packed_second = loss_of_rows(packed_logits, packed.labels, 7, 12);
  CHECK(std::abs(packed_first - first_step.loss_sum) < 1e-10);
  CHECK(std::abs(packed_second - second_step.loss_sum) < 1e-10);
  CHECK(std::abs(packed_step.loss_sum - (first_step.loss_sum + second_step.loss_sum)) < 1e-10);
  CHECK(first_step.loss_sum > 0.1);  // a real loss, not an empty sum

  REQUIRE(packed_grads.size() == apart_grads.size());
  double max_grad = 0.0, max_grad_diff = 0.0;
  for (size_t i = 0; i < packed_grads.size(); ++i) {
    for (size_t k = 0; k < packed_grads[i].size(); ++k) {
      max_grad = std::max(max_grad, std::abs(packed_grads[i][k]));
      max_grad_diff = std::max(max_grad_diff, std::abs(packed_grads[i][k] - apart_grads[i][k]));
    }
  }
  CHECK(max_grad > 1e-3);
  CHECK(max_grad_diff < 1e-10 * std::max(1.0, max_grad));
}

}  // namespace
}  // namespace moetrain
