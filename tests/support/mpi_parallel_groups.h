// The parallel groups a distributed test's model takes: a DeviceMesh of `layout` and an
// MpiCommunicator on each of its groups, wired into ParallelGroups (the CPU backend's collectives).
// Construction is collective over MPI_COMM_WORLD.
#pragma once

#include "core/model/parallel_groups.h"
#include "parallel/comm.h"
#include "parallel/mesh.h"

namespace moetrain::testing {

struct MpiParallelGroups {
  DeviceMesh mesh;
  MpiCommunicator data, ep, expert_replica, fsdp, cp;
  ParallelGroups groups;

  explicit MpiParallelGroups(const MeshLayout& layout)
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
  MpiParallelGroups(const MpiParallelGroups&) = delete;  // `groups` points at the members
  MpiParallelGroups& operator=(const MpiParallelGroups&) = delete;
};

}  // namespace moetrain::testing
