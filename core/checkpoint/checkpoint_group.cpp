#include "core/checkpoint/checkpoint_group.h"

#include <mpi.h>

#include <cstdint>

#include "core/base/error.h"
#include "parallel/watchdog.h"

namespace moetrain {
namespace {

class SingleProcessGroup final : public CheckpointGroup {
 public:
  int rank() const override { return 0; }
  int world() const override { return 1; }
  void barrier() override {}
  bool any(bool flag) override { return flag; }
  std::vector<std::string> gather_to_root(const std::string& text) override { return {text}; }
  std::string broadcast_from_root(const std::string& text) override { return text; }
};

void check_mpi(int rc, const char* what) {
  MOETRAIN_CHECK(rc == MPI_SUCCESS, ExitCode::kInternal, std::string("checkpoint collective ") + what + " failed");
}

class MpiGroup final : public CheckpointGroup {
 public:
  MpiGroup() {
    check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &rank_), "MPI_Comm_rank");
    check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &world_), "MPI_Comm_size");
  }
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  void barrier() override { check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier"); }
  bool any(bool flag) override {
    int local = flag ? 1 : 0, global = 0;
    check_mpi(MPI_Allreduce(&local, &global, 1, MPI_INT, MPI_LOR, MPI_COMM_WORLD), "MPI_Allreduce");
    return global != 0;
  }
  std::vector<std::string> gather_to_root(const std::string& text) override {
    int length = static_cast<int>(text.size());
    std::vector<int> lengths(rank_ == 0 ? world_ : 0);
    check_mpi(MPI_Gather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, 0, MPI_COMM_WORLD), "MPI_Gather");
    std::vector<int> displacements(lengths.size(), 0);
    int total = 0;
    for (size_t r = 0; r < lengths.size(); ++r) displacements[r] = total, total += lengths[r];
    std::string all(static_cast<size_t>(total), '\0');
    check_mpi(MPI_Gatherv(text.data(), length, MPI_CHAR, all.data(), lengths.data(), displacements.data(), MPI_CHAR,
                          0, MPI_COMM_WORLD),
              "MPI_Gatherv");
    std::vector<std::string> texts;
    for (size_t r = 0; r < lengths.size(); ++r) texts.push_back(all.substr(displacements[r], lengths[r]));
    return texts;
  }
  std::string broadcast_from_root(const std::string& text) override {
    uint64_t length = rank_ == 0 ? text.size() : 0;
    check_mpi(MPI_Bcast(&length, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD), "MPI_Bcast");
    std::string result = rank_ == 0 ? text : std::string(length, '\0');
    check_mpi(MPI_Bcast(result.data(), static_cast<int>(length), MPI_CHAR, 0, MPI_COMM_WORLD), "MPI_Bcast");
    return result;
  }

 private:
  int rank_ = 0;
  int world_ = 1;
};

}  // namespace

void decide_on_root(CheckpointGroup& group, const std::function<void()>& decide) {
  std::string failure;  // "<exit code> <message>"
  if (group.is_root()) {
    try {
      decide();
    } catch (const Error& e) {
      failure = std::to_string(static_cast<int>(e.code())) + " " + e.what();
    }
  }
  failure = group.broadcast_from_root(failure);
  if (failure.empty()) return;
  const size_t space = failure.find(' ');
  throw Error(static_cast<ExitCode>(std::stoi(failure.substr(0, space))), failure.substr(space + 1));
}

void run_agreed(CheckpointGroup& group, const std::string& progress, const Error& elsewhere,
                const std::function<void()>& phase) {
  std::string error;
  ExitCode code = ExitCode::kInternal;
  watchdog_progress(progress);
  try {
    phase();
  } catch (const Error& e) {
    error = e.what();
    code = e.code();
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (!group.any(!error.empty())) return;
  if (!error.empty()) throw Error(code, error);
  throw elsewhere;
}

std::unique_ptr<CheckpointGroup> make_single_process_group() { return std::make_unique<SingleProcessGroup>(); }
std::unique_ptr<CheckpointGroup> make_mpi_checkpoint_group() { return std::make_unique<MpiGroup>(); }

}  // namespace moetrain
