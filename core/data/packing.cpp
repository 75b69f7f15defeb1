#include "core/data/packing.h"

#include <algorithm>

#include "core/base/error.h"

namespace moetrain {
namespace {

// The images of document `doc` that tokens [offset, offset + n) of it (window rows from `row`)
// touch: whole ones to `out`'s image vectors, cut ones blanked (packing.h).
void take_images(const WindowOut& out, const ImageIndex& images, int64_t doc, int64_t offset, int64_t n, int64_t row) {
  for (int64_t i = images.first_image(doc); i < images.first_image(doc + 1); ++i) {
    const int64_t begin = images.token_offset(i), end = begin + images.tokens(i);
    if (end <= offset || begin >= offset + n) continue;
    if (begin >= offset && end <= offset + n && out.image_patches != nullptr) {
      const std::array<int32_t, 3> grid = images.grid(i);
      const int64_t values = int64_t{grid[0]} * grid[1] * grid[2] * images.patch_values();
      out.image_patches->insert(out.image_patches->end(), images.patches(i), images.patches(i) + values);
      out.image_grids->insert(out.image_grids->end(), grid.begin(), grid.end());
      continue;
    }
    for (int64_t t = std::max(begin, offset); t < std::min(end, offset + n); ++t) {
      out.input_ids[row + t - offset] = kPadToken;
      out.labels[row + t - offset] = -1;
    }
  }
}

}  // namespace

void pack_window(const WindowOut& out, std::vector<int32_t>& segments, const IndexedDataset& dataset,
                 const EpochPlan& plan, int64_t window, int64_t seq_len, int64_t vocab_size) {
  const std::vector<int64_t>& starts = plan.document_starts;
  const int64_t total = starts.back();
  const int64_t begin = window * seq_len;
  MOETRAIN_ASSERT(window >= 0 && begin < std::max<int64_t>(total, 1), "window past the epoch's end");
  const int64_t end = std::min(begin + seq_len, total);

  // The document holding token `begin`: the last start <= begin (an empty document shares its
  // start with the next one, and upper_bound steps past it).
  size_t i = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin()) - 1;
  std::vector<int32_t> tokens(static_cast<size_t>(seq_len) + 1);
  std::vector<uint8_t> mask(static_cast<size_t>(seq_len) + 1);
  int64_t filled = 0;
  for (int64_t at = begin; at < end; ++i) {
    const int64_t doc = plan.document_order[i];
    const int64_t doc_length = starts[i + 1] - starts[i];
    const int64_t offset = at - starts[i];
    const int64_t n = std::min(starts[i + 1], end) - at;
    if (n <= 0) continue;
    // One token more when the document goes on, for the last token's label.
    const int64_t with_next = std::min(n + 1, doc_length - offset);
    dataset.read(tokens.data(), mask.data(), doc, offset, with_next, vocab_size);
    for (int64_t t = 0; t < n; ++t) {
      out.input_ids[filled + t] = tokens[t];
      out.positions[filled + t] = static_cast<int32_t>(t);
      out.labels[filled + t] = t + 1 < with_next && mask[t + 1] != 0 ? tokens[t + 1] : -1;
    }
    if (const ImageIndex* images = dataset.images()) take_images(out, *images, doc, offset, n, filled);
    segments.push_back(static_cast<int32_t>(n));
    filled += n;
    at += n;
  }
  if (filled < seq_len) {
    for (int64_t t = filled; t < seq_len; ++t) {
      out.input_ids[t] = kPadToken;
      out.positions[t] = static_cast<int32_t>(t - filled);
      out.labels[t] = -1;
    }
    segments.push_back(static_cast<int32_t>(seq_len - filled));
  }
}

}  // namespace moetrain
