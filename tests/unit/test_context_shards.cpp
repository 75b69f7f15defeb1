// ContextShards (core/data/context_shards.h): where each rank's shard of a packed window sits
// among its documents, worked out by hand for one window.
#include <vector>

#include "catch.h"
#include "core/base/error.h"
#include "core/data/batch.h"
#include "core/data/context_shards.h"

using namespace moetrain;

TEST_CASE("context shards: local segments, document links and visible keys of an even split", "[context_parallel]") {
  // Documents [0, 40) [40, 100) [100, 130) [130, 150); four shards: [0, 37) [37, 75) [75, 112) [112, 150).
  const ContextShards shards = ContextShards::even({0, 40, 100, 130, 150}, 4);
  REQUIRE(shards.ranks() == 4);
  CHECK(shards.longest_shard() == 38);
  REQUIRE(shards.spans().size() == 4);
  CHECK(shards.spans()[1].begin == 37);
  CHECK(shards.spans()[1].end == 75);
  CHECK(shards.spans()[1].rank == 1);
  CHECK(shards.spans_of(1) == std::vector<int>{1});
  CHECK(shards.visible_rows(2) == 72);  // [40, 112)

  CHECK(shards.local_cu(0) == std::vector<int32_t>{0, 37});
  CHECK_FALSE(shards.continues_document(0));
  CHECK(shards.within_one_document(0));
  CHECK(shards.key_cu(0) == std::vector<int32_t>{0, 37});

  // [37, 75): the end of the first document, then the second from 40.
  CHECK(shards.local_cu(1) == std::vector<int32_t>{0, 3, 38});
  CHECK(shards.continues_document(1));
  CHECK_FALSE(shards.within_one_document(1));
  CHECK(shards.document_start(1) == 0);
  CHECK(shards.key_cu(1) == std::vector<int32_t>{0, 40, 75});

  // [75, 112): the second document from 75 (its keys from 40), the third from 100.
  CHECK(shards.local_cu(2) == std::vector<int32_t>{0, 25, 37});
  CHECK(shards.continues_document(2));
  CHECK(shards.document_start(2) == 40);
  CHECK(shards.key_cu(2) == std::vector<int32_t>{0, 60, 72});

  // [112, 150): the third document from 112 (keys from 100), the fourth from 130.
  CHECK(shards.local_cu(3) == std::vector<int32_t>{0, 18, 38});
  CHECK(shards.document_start(3) == 100);
  CHECK(shards.key_cu(3) == std::vector<int32_t>{0, 30, 50});
}

TEST_CASE("context shards: a document starting at a shard's start, and an empty shard", "[context_parallel]") {
  const ContextShards shards({0, 50, 120}, {0, 50, 50, 120});
  CHECK_FALSE(shards.continues_document(1));  // the second document starts at shard 1's start
  CHECK(shards.local_cu(1) == std::vector<int32_t>{0, 0});
  CHECK(shards.tokens(1) == 0);
  CHECK_FALSE(shards.continues_document(2));  // shard 2 also starts at 50
  CHECK(shards.document_start(2) == 50);
  CHECK(shards.key_cu(2) == std::vector<int32_t>{0, 70});
  const ContextShards inside({0, 120}, {0, 50, 50, 120});
  CHECK(inside.continues_document(1));
  CHECK(inside.continues_document(2));
  CHECK(inside.within_one_document(1));
}

TEST_CASE("context shards: the balanced layout pairs chunk r with chunk 2 cp - 1 - r", "[context_parallel]") {
  // One window of 16, documents [0, 5) [5, 11) [11, 16); cp 2: chunks [0, 4) [4, 8) [8, 12) [12, 16),
  // rank 0 holding the first and the last, rank 1 the middle two.
  const ContextShards shards = ContextShards::balanced({0, 5, 11, 16}, 2, 16);
  REQUIRE(shards.spans().size() == 4);
  CHECK(shards.spans_of(0) == std::vector<int>{0, 3});
  CHECK(shards.spans_of(1) == std::vector<int>{1, 2});
  CHECK(shards.spans()[3].rank == 0);
  CHECK(shards.spans()[3].row == 4);  // rank 0's second span follows its first in its rows
  CHECK(shards.tokens(0) == 8);
  CHECK(shards.longest_shard() == 8);
  CHECK(shards.most_spans() == 2);

  // Rank 0: [0, 4) then [12, 16) (inside the third document); rank 1: [4, 8) with 5 inside, then
  // [8, 12) with 11 inside.
  CHECK(shards.local_cu(0) == std::vector<int32_t>{0, 4, 8});
  CHECK(shards.local_cu(1) == std::vector<int32_t>{0, 1, 4, 7, 8});
  CHECK(shards.span_cu(2) == std::vector<int32_t>{0, 3, 4});
  CHECK(shards.continues_document(3));
  CHECK(shards.within_one_document(3));
  CHECK(shards.document_start(3) == 11);
  CHECK(shards.key_cu(3) == std::vector<int32_t>{0, 5});
  CHECK(shards.continues_document(2));  // chunk 2 goes on with [5, 11) from rank 1's own chunk 1
  CHECK_FALSE(shards.within_one_document(2));
  CHECK(shards.key_cu(2) == std::vector<int32_t>{0, 6, 7});

  // Rank 0 sees [0, 4) and [11, 16), apart; rank 1 sees [0, 8) and [5, 12), one range.
  const std::vector<ContextShards::Range> seen = shards.visible_ranges(0);
  REQUIRE(seen.size() == 2);
  CHECK((seen[0].begin == 0 && seen[0].end == 4 && seen[1].begin == 11 && seen[1].end == 16));
  CHECK(shards.visible_rows(0) == 9);
  CHECK(shards.visible_row(0, 12) == 5);
  CHECK(shards.visible_rows(1) == 12);
  CHECK(shards.visible_row(1, 9) == 9);
  CHECK_THROWS_AS(shards.visible_row(0, 6), Error);  // no query of rank 0 sees token 6

  CHECK_THROWS_AS(ContextShards::balanced({0, 16}, 3, 16), Error);  // 16 is no multiple of 6
}

TEST_CASE("context shards: cuts that do not cover the window are refused", "[context_parallel]") {
  CHECK_THROWS_AS(ContextShards({0, 100}, {0, 60, 90}), Error);
  CHECK_THROWS_AS(ContextShards({0, 100}, {0, 70, 50, 100}), Error);
}

TEST_CASE("context_shard: a micro-batch of two windows cut into three shards of its token stream", "[context_parallel]") {
  // Two windows of 6: documents [0, 4) [4, 6) | [6, 12); shards [0, 4) [4, 8) [8, 12).
  Batch batch = Batch::of_windows(2, 6);
  for (int32_t t = 0; t < 12; ++t) {
    batch.input_ids[t] = 100 + t;
    batch.labels[t] = t == 3 || t == 5 || t == 11 ? -1 : 101 + t;
    batch.positions[t] = t < 4 ? t : t < 6 ? t - 4 : t - 6;
  }
  batch.set_segments({4, 2, 6});

  const Batch middle = context_shard(batch, 3, 1);
  CHECK(middle.input_ids == std::vector<int32_t>{104, 105, 106, 107});
  // Labels and positions as the whole micro-batch has them: the shard's last label is token 8's id.
  CHECK(middle.labels == std::vector<int32_t>{105, -1, 107, 108});
  CHECK(middle.positions == std::vector<int32_t>{0, 1, 0, 1});
  CHECK(middle.cu_seqlens == std::vector<int32_t>{0, 2, 4});
  CHECK(middle.num_tokens() == 4);
  CHECK(middle.num_targets() == 3);
  REQUIRE(middle.context.has_value());
  CHECK(middle.context_rank == 1);
  CHECK(middle.context->ranks() == 3);
  CHECK(middle.context->continues_document(2));  // shard 2 continues the document [6, 12)

  int64_t targets = 0;
  for (int r = 0; r < 3; ++r) targets += context_shard(batch, 3, r).num_targets();
  CHECK(targets == batch.num_targets());
  CHECK_THROWS_AS(context_shard(middle, 3, 0), Error);  // a shard is not cut again
}

TEST_CASE("context_shard: the balanced layout pairs the chunks of every window", "[context_parallel]") {
  // Two windows of 8, one document each; cp 2: chunks of 2, rank 1 holding [2, 6) of each window.
  Batch batch = Batch::of_windows(2, 8);
  for (int32_t t = 0; t < 16; ++t) {
    batch.input_ids[t] = 100 + t;
    batch.labels[t] = t % 8 == 7 ? -1 : 101 + t;
    batch.positions[t] = t % 8;
  }
  batch.set_segments({8, 8});
  const Batch second = context_shard(batch, 2, 1, ContextLayout::kBalanced);
  CHECK(second.input_ids == std::vector<int32_t>{102, 103, 104, 105, 110, 111, 112, 113});
  CHECK(second.positions == std::vector<int32_t>{2, 3, 4, 5, 2, 3, 4, 5});  // global, not restarted per chunk
  CHECK(second.labels == std::vector<int32_t>{103, 104, 105, 106, 111, 112, 113, 114});
  CHECK(second.cu_seqlens == std::vector<int32_t>{0, 2, 4, 6, 8});
  const Batch first = context_shard(batch, 2, 0, ContextLayout::kBalanced);
  CHECK(first.input_ids == std::vector<int32_t>{100, 101, 106, 107, 108, 109, 114, 115});
  CHECK(first.num_targets() + second.num_targets() == batch.num_targets());
  CHECK(context_layout_of("contiguous") == ContextLayout::kContiguous);
  CHECK_THROWS_AS(context_layout_of("zigzag"), Error);
}
