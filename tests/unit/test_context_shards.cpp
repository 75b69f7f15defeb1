// ContextShards (core/model/context_shards.h): where each rank's shard of a packed window sits
// among its documents, worked out by hand for one window.
#include <vector>

#include "catch.h"
#include "core/base/error.h"
#include "core/model/context_shards.h"

using namespace moetrain;

TEST_CASE("context shards: local segments, document links and visible keys of an even split", "[context_parallel]") {
  // Documents [0, 40) [40, 100) [100, 130) [130, 150); four shards: [0, 37) [37, 75) [75, 112) [112, 150).
  const ContextShards shards = ContextShards::even({0, 40, 100, 130, 150}, 4);
  REQUIRE(shards.ranks() == 4);
  CHECK(shards.longest_shard() == 38);
  CHECK(shards.begin(1) == 37);
  CHECK(shards.end(1) == 75);

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

TEST_CASE("context shards: cuts that do not cover the window are refused", "[context_parallel]") {
  CHECK_THROWS_AS(ContextShards({0, 100}, {0, 60, 90}), Error);
  CHECK_THROWS_AS(ContextShards({0, 100}, {0, 70, 50, 100}), Error);
}
