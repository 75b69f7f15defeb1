// Fuzzes the checkpoint manifest and slice-table parsers (core/checkpoint/checkpoint_format.h):
// the input is a manifest.json, and also a shard's "moetrain.slices" metadata value. A manifest
// that parses must hold the numbers the file holds (not a truncated or wrapped cast of them) and
// survive a round trip through manifest_to_json.
#include "core/checkpoint/checkpoint_format.h"

#include <nlohmann/json.hpp>

#include "fuzz_support.h"

using namespace moetrain;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  fuzz::expect_only({ExitCode::kBadCheckpoint}, [&] {
    Manifest manifest = parse_manifest(text, "fuzz/step_1/manifest.json");
    const nlohmann::json json = nlohmann::json::parse(text);
    bool same = json["step"] == manifest.step && json["tokens"] == manifest.tokens &&
                json["optimizer_steps"] == manifest.optimizer_steps && json["world"]["size"] == manifest.world &&
                json["world"]["fsdp"] == manifest.fsdp && json["world"]["ep"] == manifest.ep;
    for (size_t r = 0; r < manifest.ranks.size(); ++r) {
      same = same && json["ranks"][r]["rank"] == manifest.ranks[r].rank &&
             json["ranks"][r]["data_cursor"] == manifest.ranks[r].data_cursor &&
             json["ranks"][r]["rng_state"] == manifest.ranks[r].rng_state &&
             json["files"][r]["rank"] == manifest.files[r].rank && json["files"][r]["bytes"] == manifest.files[r].bytes;
    }
    if (!same) {
      std::fprintf(stderr, "fuzz: the manifest read holds other numbers than the file\n");
      std::abort();
    }
    Manifest again = parse_manifest(manifest_to_json(manifest), "round trip");
    if (again.step != manifest.step || again.files.size() != manifest.files.size() ||
        again.ranks.size() != manifest.ranks.size() || again.config_yaml != manifest.config_yaml) {
      std::fprintf(stderr, "fuzz: manifest_to_json does not round-trip\n");
      std::abort();
    }
  });
  fuzz::expect_only({ExitCode::kBadCheckpoint}, [&] {
    std::map<std::string, TensorSlice> slices = parse_slices(text, "fuzz/rank_00000.safetensors");
    (void)parse_slices(slices_to_json(slices), "round trip");
  });
  return 0;
}
