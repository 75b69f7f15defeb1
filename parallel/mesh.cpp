#include "parallel/mesh.h"

#include <string>
#include <utility>

#include "core/base/error.h"
#include "parallel/checks.h"

namespace moetrain {
namespace {

std::string divisors_of(int64_t n, int64_t also_divides = 0) {
  std::string text;
  for (int64_t d = 1; d <= n; ++d) {
    if (n % d != 0 || (also_divides > 0 && also_divides % d != 0)) continue;
    text += (text.empty() ? "" : ", ") + std::to_string(d);
  }
  return text;
}

// The group `kind` of `rank`: groups are either contiguous blocks of `block` ranks or strided
// sets {offset, offset + stride, ...}.
MeshGroup block_group(int rank, int block) {
  MeshGroup g;
  g.color = rank / block;
  g.index = rank % block;
  for (int i = 0; i < block; ++i) g.ranks.push_back(g.color * block + i);
  return g;
}

MeshGroup strided_group(int rank, int stride, int world) {
  MeshGroup g;
  g.color = rank % stride;
  g.index = rank / stride;
  for (int r = g.color; r < world; r += stride) g.ranks.push_back(r);
  return g;
}

}  // namespace

MeshLayout::MeshLayout(int world, const MeshShape& parallel, int64_t num_experts, const std::string& source)
    : world_(world), fsdp_(0), ep_(0), cp_(0), num_experts_(num_experts) {
  const std::string where = source + " with world size " + std::to_string(world) + ": ";
  std::string problems;
  auto fail = [&](const std::string& text) { problems += (problems.empty() ? "" : "\n") + where + text; };
  if (world < 1) fail("the world size must be at least 1");
  if (parallel.fsdp < 1) fail("`parallel.fsdp` = " + std::to_string(parallel.fsdp) + " must be >= 1");
  if (parallel.ep < 1) fail("`parallel.ep` = " + std::to_string(parallel.ep) + " must be >= 1");
  if (parallel.cp < 1) fail("`parallel.cp` = " + std::to_string(parallel.cp) + " must be >= 1");
  if (num_experts < 1) fail("`model.moe.num_experts` = " + std::to_string(num_experts) + " must be >= 1");
  if (problems.empty()) {
    if (world % parallel.fsdp != 0) {
      fail("`parallel.fsdp` = " + std::to_string(parallel.fsdp) + " does not divide the world size (world = fsdp x "
           "replicate): set parallel.fsdp to one of " + divisors_of(world) + ", or run on a multiple of " +
           std::to_string(parallel.fsdp) + " ranks");
    }
    if (world % parallel.ep != 0 || num_experts % parallel.ep != 0) {
      fail("`parallel.ep` = " + std::to_string(parallel.ep) + " must divide both the world size and " +
           "`model.moe.num_experts` = " + std::to_string(num_experts) +
           " (each expert-parallel rank holds num_experts / ep contiguous experts): set parallel.ep to one of " +
           divisors_of(world, num_experts));
    }
    if (world % parallel.cp != 0) {
      fail("`parallel.cp` = " + std::to_string(parallel.cp) + " does not divide the world size (each group of cp "
           "ranks shares one micro-batch, world / cp groups read different data): set parallel.cp to one of " +
           divisors_of(world) + ", or run on a multiple of " + std::to_string(parallel.cp) + " ranks");
    }
  }
  MOETRAIN_CHECK(problems.empty(), ExitCode::kBadConfig, problems);
  fsdp_ = static_cast<int>(parallel.fsdp);
  ep_ = static_cast<int>(parallel.ep);
  cp_ = static_cast<int>(parallel.cp);
}

MeshCoordinates MeshLayout::coordinates(int rank) const {
  MOETRAIN_ASSERT(rank >= 0 && rank < world_, "rank " + std::to_string(rank) + " outside the mesh");
  MeshCoordinates c;
  c.rank = rank;
  c.fsdp = block_group(rank, fsdp_);
  c.replicate = strided_group(rank, fsdp_, world_);
  c.ep = block_group(rank, ep_);
  c.expert_replica = strided_group(rank, ep_, world_);
  c.cp = block_group(rank, cp_);
  c.local_experts = experts_per_rank();
  c.first_expert = static_cast<int64_t>(c.ep.index) * c.local_experts;
  return c;
}

namespace {

MPI_Comm split(MPI_Comm parent, const MeshGroup& group) {
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_CHECK(MPI_Comm_split(parent, group.color, group.index, &comm));
  int size = 0;
  int rank = 0;
  MPI_CHECK(MPI_Comm_size(comm, &size));
  MPI_CHECK(MPI_Comm_rank(comm, &rank));
  MOETRAIN_ASSERT(size == group.size() && rank == group.index,
                  "MPI_Comm_split gave rank " + std::to_string(rank) + " of " + std::to_string(size) +
                      ", the mesh expects " + std::to_string(group.index) + " of " + std::to_string(group.size()));
  return comm;
}

void free_comm(MPI_Comm* comm) {
  int finalized = 0;
  MPI_Finalized(&finalized);
  // No check: this runs in destructors, possibly after MPI_Finalize freed everything anyway.
  if (*comm != MPI_COMM_NULL && !finalized) MPI_Comm_free(comm);
  *comm = MPI_COMM_NULL;
}

}  // namespace

DeviceMesh::DeviceMesh(const MeshLayout& layout, MPI_Comm parent) : layout_(layout), parent_(parent) {
  int world = 0;
  int rank = 0;
  MPI_CHECK(MPI_Comm_size(parent, &world));
  MPI_CHECK(MPI_Comm_rank(parent, &rank));
  // Every rank sees the same layout, so this check fails on all of them or none: no rank is
  // left waiting in the splits below.
  MOETRAIN_CHECK(world == layout.world(), ExitCode::kBadConfig,
                 "the mesh was planned for a world of " + std::to_string(layout.world()) + " ranks but the job has " +
                     std::to_string(world) + ": launch " + std::to_string(layout.world()) +
                     " ranks or change parallel.fsdp / parallel.ep / parallel.cp");
  coordinates_ = layout.coordinates(rank);
  fsdp_ = split(parent, coordinates_.fsdp);
  replicate_ = split(parent, coordinates_.replicate);
  ep_ = split(parent, coordinates_.ep);
  expert_replica_ = split(parent, coordinates_.expert_replica);
  cp_ = split(parent, coordinates_.cp);
}

DeviceMesh::DeviceMesh(DeviceMesh&& other) noexcept
    : layout_(other.layout_),
      coordinates_(std::move(other.coordinates_)),
      parent_(other.parent_),
      fsdp_(std::exchange(other.fsdp_, MPI_COMM_NULL)),
      replicate_(std::exchange(other.replicate_, MPI_COMM_NULL)),
      ep_(std::exchange(other.ep_, MPI_COMM_NULL)),
      expert_replica_(std::exchange(other.expert_replica_, MPI_COMM_NULL)),
      cp_(std::exchange(other.cp_, MPI_COMM_NULL)) {}

DeviceMesh::~DeviceMesh() {
  free_comm(&fsdp_);
  free_comm(&replicate_);
  free_comm(&ep_);
  free_comm(&expert_replica_);
  free_comm(&cp_);
}

}  // namespace moetrain
