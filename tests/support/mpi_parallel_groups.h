// The parallel groups a distributed test's model takes: a DeviceMesh of `layout` and a `Comm` on
// each of its groups, wired into ParallelGroups: MpiCommunicator for the CPU backend's collectives,
// HostStagedCommunicator for CUDA ranks sharing one GPU. Construction is collective over
// MPI_COMM_WORLD.
#pragma once

#include "core/model/parallel_groups.h"
#include "parallel/comm.h"
#include "parallel/mesh.h"

namespace moetrain::testing {

template <typename Comm>
struct MeshParallelGroups {
  DeviceMesh mesh;
  Comm data, ep, expert_replica, fsdp, cp;
  ParallelGroups groups;

  explicit MeshParallelGroups(const MeshLayout& layout)
      : mesh(layout),
        data(mesh.world_comm()),
        ep(mesh.ep_comm()),
        expert_replica(mesh.expert_replica_comm()),
        fsdp(mesh.fsdp_comm()),
        cp(mesh.cp_comm()) {
    groups.coordinates = mesh.coordinates();
    groups.data = &data;
    groups.ep = &ep;
    groups.expert_replica = &expert_replica;
    groups.fsdp = &fsdp;
    groups.cp = &cp;
  }
  MeshParallelGroups(const MeshParallelGroups&) = delete;  // `groups` points at the members
  MeshParallelGroups& operator=(const MeshParallelGroups&) = delete;
};

using MpiParallelGroups = MeshParallelGroups<MpiCommunicator>;

}  // namespace moetrain::testing
