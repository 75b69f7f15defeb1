// The process groups a model needs when it runs on several ranks (docs/ARCHITECTURE.md §5), as typed
// communicators whose buffers live where the model's tensors do (MPI: host, NCCL: device).
// A model built without one runs alone.
#pragma once

#include "parallel/comm.h"
#include "parallel/mesh.h"

namespace moetrain {

struct ParallelGroups {
  MeshCoordinates coordinates;            // this rank's place: its expert block, its groups
  Communicator* data = nullptr;           // every data-parallel rank (the world): token counts,
                                          // non-expert adapter gradients
  Communicator* ep = nullptr;             // the token exchange of expert parallelism
  Communicator* expert_replica = nullptr; // ranks holding the same experts: their adapter gradients
  Communicator* fsdp = nullptr;           // the shard set: all-gathers the frozen non-expert weights
  Communicator* cp = nullptr;             // context parallelism: the ranks sharing one micro-batch

  int64_t first_expert() const { return coordinates.first_expert; }
  int64_t local_experts() const { return coordinates.local_experts; }
  bool expert_parallel() const { return ep != nullptr && ep->size() > 1; }
  bool fsdp_sharded() const { return fsdp != nullptr && fsdp->size() > 1; }
  bool context_parallel() const { return cp != nullptr && cp->size() > 1; }
};

}  // namespace moetrain
