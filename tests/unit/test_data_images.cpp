// Images beside a dataset (tests/fixtures/data/vision_toy, written by scripts/prepare_data.py from
// tests/fixtures/data/vision_toy.jsonl): the index's grids, placeholder runs and patch values
// against what the chats and images are by construction, and packing: a window carries exactly the
// images whose placeholders it holds whole, and blanks the placeholders of an image it cuts.
#include <array>
#include <cmath>
#include <vector>

#include "catch.h"
#include "core/data/indexed_dataset.h"
#include "core/data/packing.h"
#include "core/data/sampler.h"

using namespace moetrain;

namespace {

const std::string kPrefix = std::string(MOETRAIN_FIXTURE_DIR) + "/data/vision_toy";
constexpr int32_t kPlaceholder = 258;  // the byte tokenizer's image token

EpochPlan file_order_plan(const IndexedDataset& dataset, int64_t seq_len) {
  EpochPlan plan;
  plan.document_starts.push_back(0);
  for (int64_t d = 0; d < dataset.num_documents(); ++d) {
    plan.document_order.push_back(d);
    plan.document_starts.push_back(plan.document_starts.back() + dataset.document_length(d));
  }
  for (int64_t w = 0; w < windows_per_epoch(dataset.num_tokens(), seq_len); ++w) plan.window_order.push_back(w);
  return plan;
}

}  // namespace

TEST_CASE("the image index holds each chat's image: grid, placeholders and normalised patches", "[data][vision]") {
  const IndexedDataset dataset(kPrefix);
  const ImageIndex* images = dataset.images();
  REQUIRE(images != nullptr);
  CHECK(images->patch_values() == 3 * 14 * 14);
  CHECK(images->placeholder() == kPlaceholder);
  // make_vision_toy.py: red 56 x 28, green 28 x 56, blue 56 x 56, yellow 56 x 28 (width x height),
  // one image per chat, then a text document; within the 3136-pixel budget no image is resized.
  const std::vector<std::array<int32_t, 3>> grids = {{1, 2, 4}, {1, 4, 2}, {1, 4, 4}, {1, 2, 4}};
  REQUIRE(dataset.num_documents() == 5);
  for (int64_t d = 0; d < 4; ++d) {
    REQUIRE(images->first_image(d) == d);
    CHECK(images->grid(d) == grids[static_cast<size_t>(d)]);
    CHECK(images->tokens(d) == (grids[d][1] / 2) * (grids[d][2] / 2));
    // The placeholders sit where the index says, and only there.
    std::vector<int32_t> tokens(static_cast<size_t>(dataset.document_length(d)));
    dataset.read(tokens.data(), nullptr, d, 0, dataset.document_length(d), 259);
    int64_t count = 0;
    for (size_t t = 0; t < tokens.size(); ++t) {
      const bool inside = static_cast<int64_t>(t) >= images->token_offset(d) &&
                          static_cast<int64_t>(t) < images->token_offset(d) + images->tokens(d);
      CHECK((tokens[t] == kPlaceholder) == inside);
      count += inside;
    }
    CHECK(count == images->tokens(d));
  }
  CHECK(images->first_image(4) == 4);  // the text document has none
  // Red's pixel (0, 0) is (220 - 8, 30 - 8, 30 - 8): channel-major patch values (v / 255 - 0.5) / 0.5.
  const float* red = images->patches(0);
  CHECK(std::fabs(red[0] - (212.0 / 127.5 - 1.0)) < 1e-6);
  CHECK(std::fabs(red[14 * 14] - (22.0 / 127.5 - 1.0)) < 1e-6);
}

TEST_CASE("packing carries whole images and blanks cut ones", "[data][vision]") {
  const IndexedDataset dataset(kPrefix);
  const ImageIndex& images = *dataset.images();
  for (const int64_t seq_len : {16, 40, 64, 256}) {
    INFO("seq_len " << seq_len);
    const EpochPlan plan = file_order_plan(dataset, seq_len);
    int64_t carried = 0;
    for (int64_t w = 0; w < static_cast<int64_t>(plan.window_order.size()); ++w) {
      std::vector<int32_t> ids(seq_len), labels(seq_len), positions(seq_len), segments;
      std::vector<float> patches;
      std::vector<int32_t> grids;
      pack_window(WindowOut{ids.data(), labels.data(), positions.data(), &patches, &grids}, segments, dataset, plan,
                  w, seq_len, 259);
      int64_t placeholders = 0, tokens = 0, patch_count = 0;
      for (int32_t id : ids) placeholders += id == kPlaceholder;
      for (int32_t label : labels) CHECK(label != kPlaceholder);
      for (size_t g = 0; g < grids.size(); g += 3) {
        tokens += (grids[g + 1] / 2) * (grids[g + 2] / 2);
        patch_count += int64_t{grids[g]} * grids[g + 1] * grids[g + 2];
      }
      CHECK(placeholders == tokens);
      CHECK(static_cast<int64_t>(patches.size()) == patch_count * images.patch_values());
      carried += static_cast<int64_t>(grids.size() / 3);
    }
    // Windows as long as the whole epoch cut nothing: every image comes through.
    if (seq_len == 256) CHECK(carried == 4);
  }
}
