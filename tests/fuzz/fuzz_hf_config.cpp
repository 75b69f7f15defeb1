// Fuzzes the Hugging Face config.json reader (core/model/hf_config.cpp, model_spec.h): the input
// is <hf_dir>/config.json, resolved as train and validate do (resolve_model_spec: the import, the
// YAML's defaults overlaid, validate_config and the per-layer kinds).
#include "core/model/model_spec.h"

#include <nlohmann/json.hpp>
#include <utility>

#include "fuzz_support.h"

using namespace moetrain;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::filesystem::path dir = fuzz::scratch_dir() / "hf";
  static const bool made = std::filesystem::create_directories(dir);
  (void)made;
  fuzz::write_file(dir / "config.json", data, size);
  const std::string text(reinterpret_cast<const char*>(data), size);
  fuzz::expect_only({ExitCode::kBadConfig}, [&] {
    ModelConfig model = model_config_from_hf_json(text, "fuzz/config.json");
    // What was read is what the file says (not a truncated or wrapped cast of it).
    const nlohmann::json json = nlohmann::json::parse(text);
    for (auto [key, value] : {std::pair<const char*, int64_t>{"vocab_size", model.vocab_size},
                              {"hidden_size", model.hidden_size}, {"num_hidden_layers", model.num_layers}}) {
      if (json.contains(key) && json[key].is_number() && json[key] != value) {
        std::fprintf(stderr, "fuzz: config.json's %s is %s, read as %lld\n", key, json[key].dump().c_str(),
                     static_cast<long long>(value));
        std::abort();
      }
    }
  });
  fuzz::expect_only({ExitCode::kBadConfig}, [&] {
    Config config;
    config.model.hf_dir = dir.string();
    config.data.seq_len = 16;  // the default (256) is longer than the tiny golden models allow
    ModelSpec spec = resolve_model_spec(config);
    if (static_cast<int64_t>(spec.mixers.size()) != spec.num_layers() ||
        static_cast<int64_t>(spec.ffns.size()) != spec.num_layers()) {
      std::fprintf(stderr, "fuzz: a resolved spec without one mixer and one FFN per layer\n");
      std::abort();
    }
  });
  return 0;
}
