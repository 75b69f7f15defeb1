// Packing documents into windows: exact contents of a hand-planned example, and over whole
// shuffled epochs every token in exactly one window, every eligible target exactly once,
// segments and positions that restart at each document (and at each cut).
#include <map>
#include <set>

#include "catch.h"
#include "core/data/packing.h"
#include "core/data/sampler.h"
#include "test_data_support.h"

namespace moetrain {
namespace {

using testing::DataScratchDir;
using testing::numbered_documents;

struct PackedWindow {
  std::vector<int32_t> input_ids, labels, positions, segments;
};

PackedWindow pack(const IndexedDataset& dataset, const EpochPlan& plan, int64_t window, int64_t seq_len,
                  int64_t vocab = 1 << 20) {
  PackedWindow w;
  w.input_ids.assign(seq_len, -7);
  w.labels.assign(seq_len, -7);
  w.positions.assign(seq_len, -7);
  pack_window(WindowOut{w.input_ids.data(), w.labels.data(), w.positions.data()}, w.segments, dataset, plan, window,
              seq_len, vocab);
  return w;
}

EpochPlan file_order_plan(const IndexedDataset& dataset, int64_t seq_len) {
  EpochPlan plan;
  for (int64_t d = 0; d < dataset.num_documents(); ++d) plan.document_order.push_back(d);
  plan.document_starts.push_back(0);
  for (int64_t d = 0; d < dataset.num_documents(); ++d) {
    plan.document_starts.push_back(plan.document_starts.back() + dataset.document_length(d));
  }
  for (int64_t w = 0; w < windows_per_epoch(dataset.num_tokens(), seq_len); ++w) plan.window_order.push_back(w);
  return plan;
}

TEST_CASE("a hand-planned packing: segments, positions, labels, mask, cut and padding") {
  DataScratchDir dir("pack_hand");
  IndexedDatasetContents contents;
  contents.dtype_code = 8;
  // A = 11 12 13, B = 21 22 (22's mask is 0: a prompt token), C = 31 32 33 34 35 36
  contents.documents = {{11, 12, 13}, {21, 22}, {31, 32, 33, 34, 35, 36}};
  contents.loss_masks = {{1, 1, 1}, {1, 0}, {1, 1, 1, 1, 1, 1}};
  write_indexed_dataset(dir.file("d"), contents);
  IndexedDataset dataset(dir.file("d"));
  const EpochPlan plan = file_order_plan(dataset, 4);
  REQUIRE(plan.window_order.size() == 3);  // 11 tokens in windows of 4

  PackedWindow w0 = pack(dataset, plan, 0, 4);
  CHECK(w0.input_ids == std::vector<int32_t>{11, 12, 13, 21});
  CHECK(w0.positions == std::vector<int32_t>{0, 1, 2, 0});
  CHECK(w0.labels == std::vector<int32_t>{12, 13, -1, -1});  // 22 is not a target (mask 0)
  CHECK(w0.segments == std::vector<int32_t>{3, 1});

  PackedWindow w1 = pack(dataset, plan, 1, 4);
  CHECK(w1.input_ids == std::vector<int32_t>{22, 31, 32, 33});
  CHECK(w1.positions == std::vector<int32_t>{0, 0, 1, 2});
  // B's continuation is its own segment; C's last token here is labelled with C's next token,
  // which lies in the next window.
  CHECK(w1.labels == std::vector<int32_t>{-1, 32, 33, 34});
  CHECK(w1.segments == std::vector<int32_t>{1, 3});

  PackedWindow w2 = pack(dataset, plan, 2, 4);
  CHECK(w2.input_ids == std::vector<int32_t>{34, 35, 36, kPadToken});
  CHECK(w2.positions == std::vector<int32_t>{0, 1, 2, 0});  // C's continuation restarts at 0
  CHECK(w2.labels == std::vector<int32_t>{35, 36, -1, -1});
  CHECK(w2.segments == std::vector<int32_t>{3, 1});
}

// Checks one whole epoch of a numbered dataset (token k is first_id + k in file order).
void check_epoch(const IndexedDataset& dataset, const std::vector<int64_t>& lengths, const EpochPlan& plan,
                 int64_t seq_len) {
  std::map<int32_t, int64_t> document_of;  // token id -> document
  std::set<int32_t> document_firsts, document_lasts;
  int32_t id = 1;
  for (size_t d = 0; d < lengths.size(); ++d) {
    for (int64_t i = 0; i < lengths[d]; ++i, ++id) {
      document_of[id] = static_cast<int64_t>(d);
      if (i == 0) document_firsts.insert(id);
      if (i + 1 == lengths[d]) document_lasts.insert(id);
    }
  }
  std::map<int32_t, int> seen_as_input, seen_as_label;
  int64_t padding = 0;
  for (int64_t w = 0; w < static_cast<int64_t>(plan.window_order.size()); ++w) {
    PackedWindow win = pack(dataset, plan, plan.window_order[w], seq_len);
    int64_t at = 0;
    int64_t segment_sum = 0;
    for (int32_t length : win.segments) {
      REQUIRE(length > 0);
      segment_sum += length;
      for (int64_t t = 0; t < length; ++t, ++at) {
        CHECK(win.positions[at] == t);
        const int32_t token = win.input_ids[at];
        if (token == kPadToken) {
          ++padding;
          CHECK(win.labels[at] == -1);
          continue;
        }
        ++seen_as_input[token];
        // Only a window's first segment may continue a document cut by the previous window.
        if (t == 0 && at > 0) CHECK(document_firsts.count(token) == 1);
        // A segment holds one document, consecutively.
        if (t > 0) CHECK(win.input_ids[at - 1] == token - 1);
        if (t > 0) CHECK(document_of[win.input_ids[at - 1]] == document_of[token]);
        // The label is the document's next token, or none at its end.
        const int32_t expected_label = document_lasts.count(token) ? -1 : token + 1;
        CHECK(win.labels[at] == expected_label);
        if (win.labels[at] >= 0) ++seen_as_label[win.labels[at]];
      }
    }
    CHECK(segment_sum == seq_len);
  }
  const int64_t total = dataset.num_tokens();
  CHECK(padding == static_cast<int64_t>(plan.window_order.size()) * seq_len - total);
  CHECK(static_cast<int64_t>(seen_as_input.size()) == total);
  for (const auto& [token, count] : seen_as_input) CHECK(count == 1);
  // Every token but each document's first is a target exactly once.
  CHECK(static_cast<int64_t>(seen_as_label.size()) == total - static_cast<int64_t>(document_firsts.size()));
  for (const auto& [token, count] : seen_as_label) {
    CHECK(count == 1);
    CHECK(document_firsts.count(token) == 0);
  }
}

TEST_CASE("over a shuffled epoch every token is packed once and every target labelled once") {
  DataScratchDir dir("pack_epoch");
  // Documents shorter than, equal to, and several times longer than a window, and an empty one.
  const std::vector<int64_t> lengths = {5, 1, 12, 0, 3, 7, 20, 2, 8, 9, 1, 4};
  write_indexed_dataset(dir.file("d"), numbered_documents(lengths));
  IndexedDataset dataset(dir.file("d"));
  for (int64_t seq_len : {8, 5, 72, 100}) {
    EpochPlan e0 = make_epoch_plan(dataset.document_lengths(), seq_len, 42, 0, 0);
    EpochPlan e1 = make_epoch_plan(dataset.document_lengths(), seq_len, 42, 0, 1);
    INFO("seq_len " << seq_len);
    check_epoch(dataset, lengths, e0, seq_len);
    check_epoch(dataset, lengths, e1, seq_len);
    // The epochs concatenate the documents in different orders.
    CHECK(e0.document_order != e1.document_order);
    // Deterministic: the same (seed, dataset, epoch) gives the same plan.
    EpochPlan again = make_epoch_plan(dataset.document_lengths(), seq_len, 42, 0, 1);
    CHECK(again.document_order == e1.document_order);
    CHECK(again.window_order == e1.window_order);
  }
  // The window order is shuffled too (with 10 windows, identity for both epochs is unlikely
  // enough that a fixed seed showing it would be a bug).
  EpochPlan e0 = make_epoch_plan(dataset.document_lengths(), 8, 42, 0, 0);
  EpochPlan e1 = make_epoch_plan(dataset.document_lengths(), 8, 42, 0, 1);
  CHECK(e0.window_order != e1.window_order);
}

TEST_CASE("loss mask 0 tokens are never targets") {
  DataScratchDir dir("pack_mask");
  IndexedDatasetContents contents = numbered_documents({6, 4, 9});
  contents.loss_masks = {{0, 0, 1, 1, 0, 1}, {1, 1, 1, 1}, {0, 0, 0, 0, 1, 1, 1, 0, 1}};
  write_indexed_dataset(dir.file("d"), contents);
  IndexedDataset dataset(dir.file("d"));
  std::set<int32_t> expected_targets;
  int32_t id = 1;
  for (size_t d = 0; d < contents.documents.size(); ++d) {
    for (size_t i = 0; i < contents.documents[d].size(); ++i, ++id) {
      if (i > 0 && contents.loss_masks[d][i]) expected_targets.insert(id);
    }
  }
  const EpochPlan plan = make_epoch_plan(dataset.document_lengths(), 4, 7, 0, 0);
  std::multiset<int32_t> targets;
  for (int64_t w : plan.window_order) {
    PackedWindow win = pack(dataset, plan, w, 4);
    for (int32_t label : win.labels) {
      if (label >= 0) targets.insert(label);
    }
  }
  CHECK(targets == std::multiset<int32_t>(expected_targets.begin(), expected_targets.end()));
}

}  // namespace
}  // namespace moetrain
