// The message of a config error, for tests that check a rule names the right key.
#pragma once

#include <string>
#include <vector>

#include "catch.h"
#include "core/base/error.h"
#include "core/config/config.h"

namespace moetrain::testing {

// The message of the Error parsing `yaml` (named `name`, with `overrides`) raises, which must be a
// config error; "" when it parses.
inline std::string config_error(const std::string& yaml, const std::string& name,
                                const std::vector<std::string>& overrides) {
  try {
    parse_config(yaml, name, overrides);
  } catch (const Error& e) {
    CHECK(e.code() == ExitCode::kBadConfig);
    return e.what();
  }
  return "";
}

}  // namespace moetrain::testing
