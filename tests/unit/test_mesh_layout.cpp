// MeshLayout: the rank arithmetic of the device mesh, without MPI.
#include <set>
#include <string>

#include "catch.h"
#include "core/base/error.h"
#include "parallel/mesh.h"

using namespace moetrain;

namespace {

MeshShape parallel(int64_t fsdp, int64_t ep) {
  MeshShape p;
  p.fsdp = fsdp;
  p.ep = ep;
  return p;
}

}  // namespace

TEST_CASE("mesh layout of the seed: 128 ranks, fsdp 128, ep 64, 896 experts") {
  MeshLayout layout(128, parallel(128, 64), 896);
  CHECK(layout.replicate() == 1);
  CHECK(layout.experts_per_rank() == 14);
  CHECK(layout.expert_replicas() == 2);
  MeshCoordinates c = layout.coordinates(70);
  CHECK(c.fsdp.size() == 128);
  CHECK(c.fsdp.index == 70);
  CHECK(c.replicate.ranks == std::vector<int>{70});
  // EP groups are contiguous blocks: ranks 64..127, position 6.
  CHECK(c.ep.ranks.front() == 64);
  CHECK(c.ep.ranks.back() == 127);
  CHECK(c.ep.index == 6);
  CHECK(c.first_expert == 6 * 14);
  CHECK(c.local_experts == 14);
  CHECK(c.expert_replica.ranks == std::vector<int>{6, 70});
  CHECK(c.expert_replica.index == 1);
  CHECK(layout.expert_owner(895) == 63);
  CHECK(layout.expert_owner(84) == 6);
}

TEST_CASE("mesh groups partition the world consistently for every legal (fsdp, ep)") {
  const int world = 8;
  for (int fsdp : {1, 2, 4, 8}) {
    for (int ep : {1, 2, 4, 8}) {
      MeshLayout layout(world, parallel(fsdp, ep), 16);
      std::set<std::vector<int>> groups[4];
      std::set<int64_t> experts_of_ep_group0;
      for (int r = 0; r < world; ++r) {
        MeshCoordinates c = layout.coordinates(r);
        const MeshGroup* all[4] = {&c.fsdp, &c.replicate, &c.ep, &c.expert_replica};
        for (int k = 0; k < 4; ++k) {
          const MeshGroup& g = *all[k];
          REQUIRE(g.index >= 0);
          REQUIRE(g.index < g.size());
          CHECK(g.ranks[g.index] == r);  // a rank's index is its position in its group
          groups[k].insert(g.ranks);
        }
        CHECK(c.fsdp.size() == fsdp);
        CHECK(c.replicate.size() == world / fsdp);
        CHECK(c.ep.size() == ep);
        CHECK(c.expert_replica.size() == world / ep);
        // Same shard <=> same fsdp index; same experts <=> same ep index.
        for (int other : c.replicate.ranks) CHECK(layout.coordinates(other).fsdp.index == c.fsdp.index);
        for (int other : c.expert_replica.ranks) CHECK(layout.coordinates(other).first_expert == c.first_expert);
        if (c.ep.color == 0) {
          for (int64_t e = c.first_expert; e < c.first_expert + c.local_experts; ++e) {
            CHECK(experts_of_ep_group0.insert(e).second);
            CHECK(layout.expert_owner(e) == c.ep.index);
          }
        }
      }
      // Each kind of group splits the world into world / size disjoint groups.
      CHECK(groups[0].size() == static_cast<size_t>(world / fsdp));
      CHECK(groups[1].size() == static_cast<size_t>(fsdp));
      CHECK(groups[2].size() == static_cast<size_t>(world / ep));
      CHECK(groups[3].size() == static_cast<size_t>(ep));
      CHECK(experts_of_ep_group0.size() == 16);  // one EP group holds every expert once
    }
  }
}

// The message of the config error `make` throws ("" if it throws none or another kind).
template <typename F>
std::string config_error(F make) {
  try {
    make();
  } catch (const moetrain::Error& e) {
    return e.code() == ExitCode::kBadConfig ? e.what() : "";
  }
  return "";
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST_CASE("mesh rules: bad sizes are config errors naming the keys and the world") {
  std::string fsdp = config_error([] { MeshLayout(6, parallel(4, 1), 8, "seed.yaml"); });
  CHECK(has(fsdp, "seed.yaml with world size 6"));
  CHECK(has(fsdp, "`parallel.fsdp` = 4 does not divide the world size"));
  CHECK(has(fsdp, "one of 1, 2, 3, 6"));
  std::string ep = config_error([] { MeshLayout(8, parallel(8, 3), 9); });
  CHECK(has(ep, "set parallel.ep to one of 1"));
  CHECK(has(config_error([] { MeshLayout(8, parallel(8, 4), 6); }), "one of 1, 2"));
  CHECK(has(config_error([] { MeshLayout(4, parallel(0, 1), 4); }), "`parallel.fsdp` = 0 must be >= 1"));
  CHECK(config_error([] { MeshLayout(4, parallel(2, 2), 4); }).empty());
  MeshShape cp3 = parallel(2, 2);
  cp3.cp = 3;
  std::string cp = config_error([&] { MeshLayout(4, cp3, 4); });
  CHECK(has(cp, "`parallel.cp` = 3 does not divide the world size"));
  CHECK(has(cp, "one of 1, 2, 4"));
}

TEST_CASE("mesh layout with context parallelism: cp groups are contiguous blocks beside fsdp and ep") {
  MeshShape shape = parallel(4, 8);
  shape.cp = 2;
  MeshLayout layout(8, shape, 16);
  CHECK(layout.cp() == 2);
  CHECK(layout.data_groups() == 4);
  MeshCoordinates c = layout.coordinates(5);
  CHECK(c.cp.ranks == std::vector<int>{4, 5});
  CHECK(c.cp.index == 1);
  CHECK(c.cp.color == 2);
  // FSDP and EP are as without cp: the experts of one EP group span the cp ranks.
  CHECK(c.fsdp.ranks == std::vector<int>{4, 5, 6, 7});
  CHECK(c.ep.ranks.size() == 8);
  CHECK(c.first_expert == 10);
  CHECK(MeshLayout(8, parallel(4, 8), 16).coordinates(5).cp.ranks == std::vector<int>{5});
}
