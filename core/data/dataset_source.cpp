#include "core/data/dataset_source.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/base/error.h"
#include "core/base/log.h"
#include "core/base/random.h"
#include "core/data/packing.h"

namespace moetrain {
namespace {

std::vector<double> weights_of(const std::vector<DatasetEntry>& entries) {
  std::vector<double> weights;
  for (const DatasetEntry& e : entries) weights.push_back(e.weight);
  return weights;
}

constexpr uint64_t kHoldoutStream = 0x686f6c646f7574ull;

}  // namespace

std::vector<int64_t> held_out_documents(int64_t documents, double fraction, uint64_t seed, int dataset,
                                        const std::string& name) {
  MOETRAIN_CHECK(documents >= 2, ExitCode::kBadData,
                 fmt::format("{}: data.eval.holdout needs at least two documents to split into training and eval, "
                             "and the dataset has {}: give a separate eval dataset (data.eval.source)",
                             name, documents));
  const int64_t count =
      std::clamp<int64_t>(std::llround(fraction * static_cast<double>(documents)), 1, documents - 1);
  std::vector<int64_t> order =
      random_permutation(documents, derive_seed(seed, kHoldoutStream, static_cast<uint64_t>(dataset)));
  order.resize(static_cast<size_t>(count));
  std::sort(order.begin(), order.end());
  return order;
}

std::vector<int64_t> documents_except(int64_t documents, const std::vector<int64_t>& held_out) {
  std::vector<int64_t> kept;
  kept.reserve(static_cast<size_t>(documents) - held_out.size());
  size_t next = 0;
  for (int64_t d = 0; d < documents; ++d) {
    if (next < held_out.size() && held_out[next] == d) ++next;
    else kept.push_back(d);
  }
  return kept;
}

DatasetSource::DatasetSource(const std::vector<DatasetEntry>& entries, const DataConfig& config, int64_t vocab_size,
                             int rank, int world)
    : entries_(entries),
      schedule_(weights_of(entries)),
      seq_len_(config.seq_len),
      micro_batch_(config.micro_batch),
      seed_(static_cast<uint64_t>(config.seed)),
      vocab_size_(vocab_size),
      rank_(rank),
      world_(world) {
  MOETRAIN_ASSERT(world >= 1 && rank >= 0 && rank < world, "rank out of range");
  MOETRAIN_CHECK(seq_len_ >= 1 && micro_batch_ >= 1, ExitCode::kBadConfig,
                 "data.seq_len and data.micro_batch must be at least 1");
  for (const DatasetEntry& entry : entries_) {
    datasets_.push_back(std::make_unique<IndexedDataset>(entry.path));
    const IndexedDataset& d = *datasets_.back();
    MOETRAIN_CHECK(d.num_tokens() > 0, ExitCode::kBadData,
                   fmt::format("{}: the dataset holds no tokens ({} documents)", d.idx_path(), d.num_documents()));
    std::vector<int64_t> lengths;
    if (entry.documents.empty()) {
      lengths = d.document_lengths();
    } else {
      for (int64_t doc : entry.documents) {
        MOETRAIN_ASSERT(doc >= 0 && doc < d.num_documents(), "a selected document past the dataset's end");
        lengths.push_back(d.document_length(doc));
      }
    }
    int64_t tokens = 0;
    for (int64_t length : lengths) tokens += length;
    MOETRAIN_CHECK(tokens > 0, ExitCode::kBadData,
                   fmt::format("{}: the {} documents selected (data.eval.holdout) hold no tokens", d.idx_path(),
                               lengths.size()));
    windows_.push_back(moetrain::windows_per_epoch(tokens, seq_len_));
    lengths_.push_back(std::move(lengths));
  }
  plans_.resize(datasets_.size());
  check_contents();
}

void DatasetSource::check_contents() const {
  bool checked_all = true;
  int64_t targets = 0;
  for (size_t j = 0; j < datasets_.size(); ++j) {
    const IndexedDataset& d = *datasets_[j];
    if (d.token_file_bytes() > IndexedDataset::kContentCheckBytes) {
      checked_all = false;
      if (rank_ == 0) {
        log::info(fmt::format("{}: {:.1f} GB of tokens, too many to read at start: each token is checked when its "
                              "window is drawn (`moetrain data-stats {}` checks them all now)",
                              d.bin_path(), static_cast<double>(d.token_file_bytes()) / 1e9, d.prefix()));
      }
      continue;
    }
    const int64_t found = d.check_contents(entries_[j].documents, vocab_size_);
    if (found == 0 && rank_ == 0) {
      log::warn(fmt::format("{}: none of its tokens is a training target (its loss mask is all 0)", d.mask_path()));
    }
    targets += found;
  }
  MOETRAIN_CHECK(!checked_all || targets > 0, ExitCode::kBadData,
                 fmt::format("the data ({}) has no target tokens: every loss-mask byte is 0, so every step would be "
                             "skipped and nothing trained. Check how the .mask files were written (scripts/"
                             "prepare_data.py's masking options)",
                             datasets_.size() == 1 ? datasets_.front()->mask_path() : "every dataset of the mixture"));
}

std::string DatasetSource::describe() const {
  std::string text;
  for (size_t j = 0; j < datasets_.size(); ++j) {
    const IndexedDataset& d = *datasets_[j];
    const bool part = !entries_[j].documents.empty();
    int64_t tokens = 0;
    for (int64_t length : lengths_[j]) tokens += length;
    text += fmt::format("{}{} ({}{} documents, {} tokens, {} windows of {} per epoch{}{})", j ? "; " : "", d.prefix(),
                        part ? fmt::format("{} of ", lengths_[j].size()) : "", d.num_documents(), tokens, windows_[j],
                        seq_len_,
                        d.has_loss_mask() ? ", loss mask" : "",
                        datasets_.size() > 1 ? fmt::format(", weight {}", entries_[j].weight) : "");
  }
  return text;
}

SampleLocation DatasetSource::locate(uint64_t global_sample) const {
  const auto [dataset, local] = schedule_.locate(global_sample);
  const uint64_t windows = static_cast<uint64_t>(windows_[static_cast<size_t>(dataset)]);
  SampleLocation where;
  where.dataset = dataset;
  where.epoch = static_cast<int64_t>(local / windows);
  where.window = static_cast<int64_t>(local % windows);  // the position in the epoch's window order
  return where;
}

const EpochPlan& DatasetSource::plan(int dataset, int64_t epoch) {
  std::optional<EpochPlan>& cached = plans_[static_cast<size_t>(dataset)];
  if (!cached || cached->epoch != epoch) {
    cached = make_epoch_plan(lengths_[static_cast<size_t>(dataset)], seq_len_, seed_, dataset, epoch);
    // The plan orders the selected documents; packing reads them by their number in the dataset.
    const std::vector<int64_t>& selected = entries_[static_cast<size_t>(dataset)].documents;
    if (!selected.empty()) {
      for (int64_t& doc : cached->document_order) doc = selected[static_cast<size_t>(doc)];
    }
  }
  return *cached;
}

void DatasetSource::pack_sample(const WindowOut& out, std::vector<int32_t>& segments, uint64_t global_sample) {
  SampleLocation where = locate(global_sample);
  const EpochPlan& p = plan(where.dataset, where.epoch);
  pack_window(out, segments, *datasets_[static_cast<size_t>(where.dataset)], p,
              p.window_order[static_cast<size_t>(where.window)], seq_len_, vocab_size_);
}

Batch DatasetSource::next() {
  Batch batch = Batch::of_windows(micro_batch_, seq_len_);
  std::vector<int32_t> segments;
  const uint64_t first = first_sample_of_rank(cursor_, micro_batch_, rank_);
  for (int64_t b = 0; b < micro_batch_; ++b) {
    const size_t offset = static_cast<size_t>(b * seq_len_);
    WindowOut out{batch.input_ids.data() + offset, batch.labels.data() + offset, batch.positions.data() + offset,
                  &batch.image_patches, &batch.image_grids};
    pack_sample(out, segments, first + static_cast<uint64_t>(b));
  }
  cursor_ += static_cast<uint64_t>(world_) * static_cast<uint64_t>(micro_batch_);
  batch.set_segments(segments);
  return batch;
}

Batch DatasetSource::sample(uint64_t global_sample) {
  Batch batch = Batch::of_windows(1, seq_len_);
  std::vector<int32_t> segments;
  pack_sample(WindowOut{batch.input_ids.data(), batch.labels.data(), batch.positions.data(), &batch.image_patches,
                        &batch.image_grids},
              segments, global_sample);
  batch.set_segments(segments);
  return batch;
}

}  // namespace moetrain
