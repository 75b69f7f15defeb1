// Packing: a dataset epoch's documents, concatenated in the plan's order, cut into windows of
// seq_len tokens. Window w holds tokens [w seq_len, (w + 1) seq_len) of the concatenation, so
// over an epoch every token lands in exactly one window.
//
// Inside a window each document (or the part of it that falls in the window) is one segment:
// positions restart at 0 and attention / convolution / recurrent state never cross into the next
// document (Batch's cu_seqlens). A document longer than what is left of a window continues in the
// next window of the concatenation as a NEW segment (positions from 0 again): the model sees the
// continuation without the earlier context. Training is not lost for it, though: labels follow
// the document, not the window, so the last token of a cut segment is labelled with the
// document's next token (the first of the continuation).
//
// Labels: the label of a token is the document's next token, or -1 when there is none (the
// document's last token) or the next token's loss mask is 0 (prompt or user-turn tokens are
// context, not targets). The first token of a document is never a target: nothing before it
// belongs to its document. So over an epoch every token that is not a document's first and whose
// mask is 1 is a target exactly once.
//
// The last window of an epoch is padded to seq_len with token kPadToken as one extra segment whose
// labels are all -1.
//
// Images (a dataset with <prefix>.images): an image whose placeholder tokens all land in the
// window comes with it (WindowOut's image vectors, in token order); one the window cuts, or any
// when the caller takes no images, leaves its placeholders in the window as kPadToken, not targets
// (the model needs every placeholder to have its image token).
#pragma once

#include <cstdint>
#include <vector>

#include "core/data/indexed_dataset.h"
#include "core/data/sampler.h"

namespace moetrain {

constexpr int32_t kPadToken = 0;

// Where one window goes: seq_len tokens each of input ids, labels and positions.
struct WindowOut {
  int32_t* input_ids;
  int32_t* labels;
  int32_t* positions;
  std::vector<float>* image_patches = nullptr;  // appended: Batch::image_patches
  std::vector<int32_t>* image_grids = nullptr;  // appended: Batch::image_grids
};

// Writes window `window` of `plan` into `out` and appends its segment lengths to `segments`.
// Token ids are checked against vocab_size as they are read (Error(kBadData) naming the file and
// byte offset).
void pack_window(const WindowOut& out, std::vector<int32_t>& segments, const IndexedDataset& dataset,
                 const EpochPlan& plan, int64_t window, int64_t seq_len, int64_t vocab_size);

}  // namespace moetrain
