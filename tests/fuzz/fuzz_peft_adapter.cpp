// Fuzzes the PEFT adapter reader (core/model/peft_adapter.h): the input is an adapter directory's
// two files, adapter_config.json, one NUL byte, then adapter_model.safetensors (no NUL: no
// weights file). The config is read alone (read_peft_adapter_config), then the whole adapter is
// loaded into the tiny golden "noqlora" model (tests/fixtures/golden, built once per process),
// so that keys, ranks, layouts and shapes meet a real model's adapters.
#include "core/model/peft_adapter.h"

#include <cstdlib>
#include <cstring>
#include <memory>

#include <nlohmann/json.hpp>

#include "core/io/hf_index.h"
#include "core/model/model_spec.h"
#include "fuzz_support.h"
#include "kernels/ops.h"

using namespace moetrain;

namespace {

Model& golden_model() {
  static std::unique_ptr<kernels::Backend> backend = kernels::make_cpu_backend();
  static std::unique_ptr<Model> model = [] {
    // The environment's fixture directory wins, for running a built harness elsewhere.
    const char* fixtures = std::getenv("MOETRAIN_FIXTURE_DIR");
    const std::string dir = std::string(fixtures ? fixtures : MOETRAIN_FIXTURE_DIR) + "/golden/noqlora";
    Config config;
    config.model.hf_dir = dir;
    config.data.seq_len = 16;
    ModelOptions options;
    options.dtype = DType::kF32;
    options.lora = LoraSettings{4, 8.0, false};
    options.lora_targets = {"q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
                            "up_proj", "down_proj", "shared_experts", "experts"};
    auto m = std::make_unique<Model>(resolve_model_spec(config), *backend, options);
    m->load_weights(HfCheckpoint(dir));
    return m;
  }();
  return *model;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Model& model = golden_model();
  const std::filesystem::path dir = fuzz::scratch_dir() / "adapter";
  static const bool made = std::filesystem::create_directories(dir);
  (void)made;
  const uint8_t* nul = static_cast<const uint8_t*>(std::memchr(data, 0, size));
  const size_t config_len = nul ? static_cast<size_t>(nul - data) : size;
  fuzz::write_file(dir / "adapter_config.json", data, config_len);
  std::error_code ec;
  if (nul) {
    fuzz::write_file(dir / "adapter_model.safetensors", nul + 1, size - config_len - 1);
  } else {
    std::filesystem::remove(dir / "adapter_model.safetensors", ec);
  }
  fuzz::expect_only({ExitCode::kBadCheckpoint}, [&] {
    PeftAdapterConfig config = read_peft_adapter_config(dir.string());
    // The rank read is the file's (not a truncated cast of 4.5 or 2^32 + 4).
    const nlohmann::json json = nlohmann::json::parse(std::string(reinterpret_cast<const char*>(data), config_len));
    if (json.at("r") != config.rank) {
      std::fprintf(stderr, "fuzz: adapter_config.json's r is %s, read as %lld\n", json.at("r").dump().c_str(),
                   static_cast<long long>(config.rank));
      std::abort();
    }
  });
  // A rank, alpha or layout that is not the model's is the user's config to change (kBadConfig).
  fuzz::expect_only({ExitCode::kBadCheckpoint, ExitCode::kBadConfig}, [&] { load_peft_adapter(model, dir.string()); });
  return 0;
}
