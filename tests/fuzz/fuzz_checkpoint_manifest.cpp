// Fuzzes the checkpoint manifest and slice-table parsers (core/checkpoint/checkpoint_format.h):
// the input is a manifest.json, and also a shard's "moetrain.slices" metadata value. A manifest
// that parses must survive a round trip through manifest_to_json.
#include "core/checkpoint/checkpoint_format.h"

#include "fuzz_support.h"

using namespace moetrain;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  fuzz::expect_only({ExitCode::kBadCheckpoint}, [&] {
    Manifest manifest = parse_manifest(text, "fuzz/step_1/manifest.json");
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
