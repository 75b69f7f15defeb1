// data.source in the config: a string (synthetic or a path prefix) or a list of {path, weight},
// read strictly, checked by the rules, written back and read again to the same settings.
#include <iostream>

#include "catch.h"
#include "core/base/error.h"
#include "core/config/config.h"

namespace moetrain {
namespace {

const char* const kModel = "model:\n  vocab_size: 64\n  hidden_size: 32\n  num_layers: 2\n";

Config parse_data(const std::string& data_yaml, const std::vector<std::string>& overrides = {}) {
  return parse_config(std::string(kModel) + "data:\n" + data_yaml, "test.yaml", overrides);
}

std::string error_of(const std::string& data_yaml, const std::vector<std::string>& overrides = {}) {
  try {
    parse_data(data_yaml, overrides);
  } catch (const Error& e) {
    CHECK(e.code() == ExitCode::kBadConfig);
    return e.what();
  }
  FAIL("no error for: " << data_yaml);
  return "";
}

bool contains(const std::string& text, const std::string& part) {
  const bool found = text.find(part) != std::string::npos;
  if (!found) std::cerr << "expected `" << part << "` in:\n" << text << "\n";
  return found;
}

TEST_CASE("data.source as a string: synthetic or a path prefix") {
  CHECK(parse_data("  seq_len: 16\n").data.source == "synthetic");
  Config config = parse_data("  source: /data/chat/train\n");
  CHECK(config.data.source == "/data/chat/train");
  CHECK(config.data.mixture.empty());
  CHECK(same_settings(parse_config(config_to_yaml(config), "resolved.yaml"), config));
}

TEST_CASE("data.source as a list of {path, weight}") {
  Config config = parse_data("  source:\n    - {path: /d/a, weight: 3}\n    - path: /d/b\n      weight: 0.5\n"
                             "    - {path: /d/c}\n");
  CHECK(config.data.source == kDataSourceMixture);
  REQUIRE(config.data.mixture.size() == 3);
  CHECK(config.data.mixture[0] == DataSourceSpec{"/d/a", 3.0});
  CHECK(config.data.mixture[1] == DataSourceSpec{"/d/b", 0.5});
  CHECK(config.data.mixture[2] == DataSourceSpec{"/d/c", 1.0});  // weight defaults to 1
  // The resolved YAML writes the list and reads back to the same settings.
  const std::string yaml = config_to_yaml(config);
  CHECK(contains(yaml, "source: [{path: /d/a, weight: 3.0}, {path: /d/b, weight: 0.5}, {path: /d/c, weight: 1.0}]"));
  CHECK(same_settings(parse_config(yaml, "resolved.yaml"), config));
  // Two configs differing only in a weight are different settings.
  Config other = config;
  other.data.mixture[1].weight = 0.25;
  CHECK_FALSE(same_settings(config, other));
  // --set replaces the list with a string, and a string with a list.
  CHECK(parse_data("  source: [{path: /d/a}]\n", {"data.source=synthetic"}).data.mixture.empty());
  Config set = parse_data("  source: synthetic\n", {"data.source=[{path: /x, weight: 2}]"});
  CHECK(set.data.source == kDataSourceMixture);
  CHECK(set.data.mixture == std::vector<DataSourceSpec>{{"/x", 2.0}});
}

TEST_CASE("bad data.source values are config errors with the key, line and fix") {
  CHECK(contains(error_of("  source: [{path: /d/a, wieght: 2}]\n"),
                 "test.yaml:6:25: unknown key `wieght` in `data.source[0]` (did you mean `data.source[0].weight`?)"));
  CHECK(contains(error_of("  source: [{weight: 2}]\n"), "`data.source[0]` needs a `path`"));
  CHECK(contains(error_of("  source: [{path: /d/a, weight: two}]\n"), "`data.source[0].weight` expects a number"));
  CHECK(contains(error_of("  source: [/d/a, /d/b]\n"), "`data.source[0]` expects a map {path: prefix, weight: number}"));
  CHECK(contains(error_of("  source: []\n"), "`data.source` expects a string (synthetic or a dataset path prefix) or "
                                             "a list of {path, weight}"));
  CHECK(contains(error_of("  source: {path: /d/a}\n"), "`data.source` expects a string"));
  CHECK(contains(error_of("  source: [{path: /d/a, weight: 0}]\n"), "`data.source[0].weight` = 0.0 must be > 0"));
  CHECK(contains(error_of("  source: [{path: /d/a, weight: -1}, {path: synthetic}]\n"),
                 "2 problems in the config"));
  CHECK(contains(error_of("  source: [{path: \"\"}]\n"), "`data.source[0].path` must not be empty"));
  CHECK(contains(error_of("  source: mixture\n"), "`data.source` = `mixture` needs the list form"));
  CHECK(contains(error_of("  source: \"\"\n"), "`data.source` must not be empty"));
  // validate_config (configs built in code) applies the same rules.
  Config config = parse_data("  source: /d/a\n");
  config.data.mixture = {{"/d/b", 1.0}};
  CHECK_THROWS_AS(validate_config(config), Error);
}

}  // namespace
}  // namespace moetrain
