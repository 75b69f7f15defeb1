// Fuzzes the YAML config reader (core/config/config.h): the input is a config file. A config
// that is accepted must print (config_to_yaml) to YAML that reads back to the same settings, as
// config.h promises (a run's saved RUN/config.yaml is read back on resume). That promise is for a
// resolved config: one with a model.hf_dir still to read defers the rules on the keys its
// config.json gives, which its printed form states, so only configs without one are read back
// (moetrain prints and saves a config after merging config.json).
#include "core/config/config.h"

#include "fuzz_support.h"

using namespace moetrain;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  fuzz::expect_only({ExitCode::kBadConfig}, [&] {
    Config config = parse_config(text, "fuzz.yaml");
    if (config.model.hf_dir) return;
    std::string printed = config_to_yaml(config);
    Config again;
    fuzz::expect_only({}, [&] { again = parse_config(printed, "printed fuzz.yaml"); });
    if (!same_settings(config, again)) {
      std::fprintf(stderr, "fuzz: config_to_yaml does not read back to the same settings:\n%s\n", printed.c_str());
      std::abort();
    }
  });
  return 0;
}
