// The device mesh: which ranks form which process group, from the world size and the
// `parallel` section (docs/ARCHITECTURE.md §5).
//
// Rank layout (rank r of a world of W = fsdp x replicate ranks, ep and cp dividing W):
//
//   FSDP group        ranks {b*fsdp, ..., b*fsdp + fsdp - 1} for b = r / fsdp: contiguous blocks.
//                     Together they hold one full copy of the non-expert weights, each rank the
//                     shard number r % fsdp (all-gather / reduce-scatter run here).
//   replicate group   ranks {s, s + fsdp, s + 2*fsdp, ...} for s = r % fsdp: the ranks holding the
//                     same shard of the frozen weights.
//   EP group          ranks {g*ep, ..., g*ep + ep - 1} for g = r / ep: contiguous blocks, so with
//                     ep <= ranks per node the token all-to-all never leaves a node. Position
//                     p = r % ep in it holds experts [p*E/ep, (p+1)*E/ep) (E = num_experts).
//   expert replicas   ranks {p, p + ep, p + 2*ep, ...} for p = r % ep: the W / ep ranks holding
//                     the same experts (their adapters' gradients are reduce-scattered and their
//                     optimizer state sharded here; the other adapters' over all W ranks).
//   CP group          ranks {c*cp, ..., c*cp + cp - 1} for c = r / cp: contiguous blocks sharing one
//                     micro-batch, each rank a contiguous shard of its tokens (context parallelism;
//                     the W / cp groups read different data). FSDP and EP do not depend on it: the
//                     frozen weights and the experts serve any rank's tokens alike.
//
// Within every group, ranks are ordered by global rank, and a rank's index in the group is its
// rank in the group's communicator. Two layers: MeshLayout is the pure arithmetic (testable
// without MPI); DeviceMesh creates the MPI communicators with MPI_Comm_split.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

namespace moetrain {

// One process group as seen from one rank.
struct MeshGroup {
  std::vector<int> ranks;  // global ranks, ascending
  int index = 0;           // this rank's position in `ranks` (its rank in the group communicator)
  int color = 0;           // which group of this kind it is (the MPI_Comm_split color)
  int size() const { return static_cast<int>(ranks.size()); }
};

// Where one rank sits in the mesh.
struct MeshCoordinates {
  int rank = 0;
  MeshGroup fsdp;            // shard set; index = shard number
  MeshGroup replicate;       // same shard
  MeshGroup ep;              // token exchange; index = expert block
  MeshGroup expert_replica;  // same experts
  MeshGroup cp;              // one micro-batch split by tokens; index = shard number
  int64_t first_expert = 0;  // global id of this rank's first local expert
  int64_t local_experts = 0; // num_experts / ep, contiguous from first_expert
};

// The mesh's shape as a job asks for it (the config's parallel.fsdp, ep and cp): the
// parallel layer's own plain description, so it does not depend on core/config.
struct MeshShape {
  int64_t fsdp = 1;
  int64_t ep = 1;
  int64_t cp = 1;
};

class MeshLayout {
 public:
  // Checks every rule of the mesh (world >= 1; fsdp, ep, cp >= 1; fsdp and cp divide world; ep
  // divides world and num_experts) and throws Error(kBadConfig) naming the keys, the world size and a fix.
  // `source` names the config in messages (its path).
  MeshLayout(int world, const MeshShape& parallel, int64_t num_experts, const std::string& source = "config");

  int world() const { return world_; }
  int fsdp() const { return fsdp_; }
  int replicate() const { return world_ / fsdp_; }
  int ep() const { return ep_; }
  int expert_replicas() const { return world_ / ep_; }
  int cp() const { return cp_; }
  int data_groups() const { return world_ / cp_; }  // the groups that read different micro-batches
  int64_t num_experts() const { return num_experts_; }
  int64_t experts_per_rank() const { return num_experts_ / ep_; }

  // Membership of every group for `rank` (0 <= rank < world).
  MeshCoordinates coordinates(int rank) const;
  // The EP-group position that holds global expert `expert` (its owner within any EP group).
  int expert_owner(int64_t expert) const { return static_cast<int>(expert / experts_per_rank()); }

 private:
  int world_;
  int fsdp_;
  int ep_;
  int cp_;
  int64_t num_experts_;
};

// The layout plus this rank's MPI communicators, split from a parent (normally MPI_COMM_WORLD,
// whose size must be layout.world()). Construction is collective over the parent. Movable,
// not copyable; frees its communicators.
class DeviceMesh {
 public:
  DeviceMesh(const MeshLayout& layout, MPI_Comm parent = MPI_COMM_WORLD);
  ~DeviceMesh();
  DeviceMesh(DeviceMesh&& other) noexcept;
  DeviceMesh& operator=(DeviceMesh&& other) = delete;
  DeviceMesh(const DeviceMesh&) = delete;
  DeviceMesh& operator=(const DeviceMesh&) = delete;

  const MeshLayout& layout() const { return layout_; }
  const MeshCoordinates& coordinates() const { return coordinates_; }
  MPI_Comm world_comm() const { return parent_; }
  MPI_Comm fsdp_comm() const { return fsdp_; }
  MPI_Comm replicate_comm() const { return replicate_; }
  MPI_Comm ep_comm() const { return ep_; }
  MPI_Comm expert_replica_comm() const { return expert_replica_; }
  MPI_Comm cp_comm() const { return cp_; }

 private:
  MeshLayout layout_;
  MeshCoordinates coordinates_;
  MPI_Comm parent_ = MPI_COMM_NULL;
  MPI_Comm fsdp_ = MPI_COMM_NULL;
  MPI_Comm replicate_ = MPI_COMM_NULL;
  MPI_Comm ep_ = MPI_COMM_NULL;
  MPI_Comm expert_replica_ = MPI_COMM_NULL;
  MPI_Comm cp_ = MPI_COMM_NULL;
};

}  // namespace moetrain
