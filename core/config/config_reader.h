// Strict YAML -> Config: the machinery behind load_config/parse_config (internal to core/config).
//
// A YAML map is applied onto a Config that already holds defaults (and, for --set overrides,
// the file's values): only the keys present change. Every problem is collected with where it
// came from, so one run of `moetrain validate` reports all of them, sorted by line.
#pragma once

#include <map>
#include <string>
#include <vector>

#include <yaml-cpp/yaml.h>

#include "core/config/config.h"

namespace moetrain::config_detail {

// Where a value came from: a file position (line/column 1-based) or a --set override.
struct KeyOrigin {
  std::string source;  // the file path, or the whole "--set key=value" argument
  int line = 0;        // 0 for --set overrides and for values never set (defaults)
  int column = 0;
  bool from_set = false;
};

// "file.yaml:12:5", "--set model.x=3" or "default".
std::string describe(const KeyOrigin& origin);

struct Problem {
  KeyOrigin where;
  std::string message;
};

// Throws Error(kBadConfig) listing every problem ("where: message", sorted by position), if any.
void throw_if_problems(std::vector<Problem> problems);

// What reading produced besides the values: where each leaf key was set, and what was wrong.
struct ReadState {
  std::map<std::string, KeyOrigin> origins;  // full leaf path ("model.mla.num_heads") -> origin
  std::vector<Problem> problems;
};

// Applies the map `root` onto `config`. `source` names the file or the --set argument.
void apply_yaml(Config& config, ReadState& state, const YAML::Node& root, const KeyOrigin& source);

// Every key path the schema knows, leaves and sections ("model", "model.mla", "model.mla.num_heads").
const std::vector<std::string>& all_key_paths();

// The one rule for booleans (docs: README's config notes): YAML 1.2's core schema spellings
// true/True/TRUE and false/False/FALSE are booleans; the words YAML 1.1 also reads as booleans
// (yes/no/on/off/y/n in their cases) and 0/1 are refused as ambiguous, with "write true or
// false". checkpoint.export_adapter, a boolean or a directory, follows the same rule.
enum class BooleanWord { kTrue, kFalse, kAmbiguous, kNotBoolean };
BooleanWord boolean_word(const std::string& text);

// The shortest decimal text that reads back to exactly `value` ("0.0002", "1e-06", "2.0").
std::string format_number(double value);

// Levenshtein distance (insert, delete, substitute all cost 1).
size_t edit_distance(const std::string& a, const std::string& b);

// " (did you mean `x`?)" or " (valid keys here: a, b, c)" for an unknown key `key` found at
// `level_path` ("" for the top level) where `known` are the valid keys.
std::string unknown_key_hint(const std::string& level_path, const std::string& key,
                             const std::vector<std::string>& known);

}  // namespace moetrain::config_detail
