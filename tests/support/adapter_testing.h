// Shared by the tests of the adapter forms (fused gate_up, shared expert A, per-target ranks):
// random non-zero adapters that an F32 export keeps exactly, lookup by name, the adapters as F32
// host tensors (what a checkpoint holds), adapter load errors, the resume check and scratch
// directories.
#pragma once

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "catch.h"
#include "core/base/error.h"
#include "core/base/host_convert.h"
#include "core/checkpoint/adapter_export.h"
#include "core/model/model.h"
#include "core/model/peft_adapter.h"
#include "gradcheck.h"
#include "training_run.h"

namespace moetrain::testing {

// Non-zero random values for every adapter (B included), as after some training, each one an F32
// value (so that an F32 export changes nothing).
inline void randomize_adapters(Model& model, uint64_t seed) {
  for (Parameter* p : model.parameters()) {
    fill_random(p->value, seed++, 0.05, 0.3);
    for (int64_t i = 0; i < p->value.numel(); ++i)
      p->value.ptr<double>()[i] = static_cast<float>(p->value.ptr<double>()[i]);
  }
}

inline Parameter* find_parameter(Model& model, const std::string& name) {
  for (Parameter* p : model.parameters())
    if (p->name == name) return p;
  return nullptr;
}

// The adapters as F32 host tensors, as a checkpoint holds them, and (name, view) pairs of them.
struct HostParameters {
  std::vector<Tensor> values;
  std::vector<std::pair<std::string, TensorView>> views;
  explicit HostParameters(Model& model) {
    for (Parameter* p : model.parameters()) {
      values.emplace_back(p->value.shape(), DType::kF32);
      convert_host(values.back(), p->value);
    }
    std::vector<Parameter*> params = model.parameters();
    for (size_t i = 0; i < params.size(); ++i) views.emplace_back(params[i]->name, values[i].view());
  }
};

// Whether two models' adapters hold the same F32 bytes, tensor by tensor.
inline bool same_adapter_bytes(Model& a, Model& b) {
  const HostParameters x(a), y(b);
  if (x.values.size() != y.values.size()) return false;
  for (size_t i = 0; i < x.values.size(); ++i) {
    if (x.values[i].nbytes() != y.values[i].nbytes() ||
        std::memcmp(x.values[i].data(), y.values[i].data(), x.values[i].nbytes()) != 0)
      return false;
  }
  return true;
}

// The resume check of the adapter forms: `c` (four_step_run_config) stopped after 2 of its 4
// steps and resumed in new objects reproduces `straight` (the same run trained through, which
// gave the losses `expected`) bit for bit, losses and adapters. Returns the resumed run.
inline std::unique_ptr<TrainingRun> check_resume_matches(const Config& c, TrainingRun& straight,
                                                         const std::vector<double>& expected) {
  std::vector<double> losses;
  std::unique_ptr<TrainingRun> resumed = run_with_resume(c, 2, losses);
  REQUIRE(losses.size() == 4);
  for (int i = 0; i < 4; ++i) CHECK(losses[i] == expected[i]);
  CHECK(same_adapter_bytes(*resumed->model, *straight.model));
  return resumed;
}

// The losses of `run` (a four_step_run_config) trained straight through its 4 steps.
inline std::vector<double> four_step_losses(TrainingRun& run) {
  std::vector<double> losses = run.trainer->run();
  REQUIRE(losses.size() == 4);
  return losses;
}

// The adapter of the newest checkpoint of the run `c` exported (`moetrain export`) into
// <run_dir>/adapter; returns that directory.
inline std::filesystem::path export_run_adapter(const Config& c) {
  const std::filesystem::path adapter = std::filesystem::path(c.logging.run_dir) / "adapter";
  export_checkpoint_adapter(c.logging.run_dir + "/checkpoints", adapter.string());
  return adapter;
}

// The Error (and its code) that loading the PEFT adapter `dir` into `model` throws; kOk and ""
// when it loads.
inline std::pair<ExitCode, std::string> load_error(Model& model, const std::filesystem::path& dir) {
  try {
    load_peft_adapter(model, dir.string());
  } catch (const Error& e) {
    return {e.code(), e.what()};
  }
  return {ExitCode::kOk, ""};
}

// Loading the PEFT adapter `dir` into `model` is refused with `code`, the message naming each of
// `parts`.
inline void check_load_refused(Model& model, const std::filesystem::path& dir, ExitCode code,
                               const std::vector<std::string>& parts) {
  auto [got, message] = load_error(model, dir);
  INFO(message);
  CHECK(got == code);
  for (const std::string& part : parts) CHECK(contains(message, part));
}

// An empty directory <tmp>/moetrain_test_<test>_<name>.
inline std::filesystem::path scratch_dir(const std::string& test, const std::string& name) {
  std::filesystem::path dir = std::filesystem::temp_directory_path() / ("moetrain_test_" + test + "_" + name);
  std::filesystem::remove_all(dir);
  return dir;
}

}  // namespace moetrain::testing
