// The public config entry points: load/parse with --set overrides, the world-size rules, and
// the resolved config as YAML. The strict reading lives in config_reader.cpp, the rules in
// config_rules.cpp, the list of keys in config_schema.h.
#include "core/config/config.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <numeric>
#include <sstream>

#include <yaml-cpp/yaml.h>

#include "core/base/error.h"
#include "core/config/config_reader.h"
#include "core/config/config_rules.h"
#include "core/config/config_schema.h"

namespace moetrain {
namespace {

using config_detail::KeyOrigin;
using config_detail::Problem;
using config_detail::ReadState;

// "--set model.mla.num_heads=8" as the nested map {model: {mla: {num_heads: 8}}}, so it goes
// through exactly the same strict reader as the file. Returns false (with a problem) when the
// argument is malformed.
bool override_as_yaml(const std::string& text, const KeyOrigin& where, YAML::Node* tree,
                      std::vector<Problem>* problems) {
  size_t equals = text.find('=');
  if (equals == std::string::npos || equals == 0) {
    problems->push_back({where, "expected key.path=value, e.g. --set train.lr=1e-4"});
    return false;
  }
  std::string key = text.substr(0, equals);
  std::vector<std::string> parts;
  std::stringstream stream(key);
  for (std::string part; std::getline(stream, part, '.');) parts.push_back(part);
  if (key.back() == '.') parts.push_back("");
  for (const std::string& part : parts) {
    if (part.empty() || part.find_first_of(" \t[]") != std::string::npos) {
      problems->push_back({where, "`" + key + "` is not a key path: write dot-separated names like "
                                  "model.mla.num_heads (a list is set whole: --set model.layers=[mla,kda])"});
      return false;
    }
  }
  YAML::Node value;
  try {
    value = YAML::Load(text.substr(equals + 1));
  } catch (const YAML::Exception& e) {
    problems->push_back({where, "the value is not valid YAML (" + e.msg + "); quote it if it is a string"});
    return false;
  }
  for (auto part = parts.rbegin(); part != parts.rend(); ++part) {
    YAML::Node map(YAML::NodeType::Map);
    map[*part] = value;
    value = map;
  }
  *tree = value;
  return true;
}

std::vector<std::string> divisors(int64_t n) {
  std::vector<std::string> result;
  for (int64_t d = 1; d <= n; ++d) {
    if (n % d == 0) result.push_back(std::to_string(d));
  }
  return result;
}

std::string join(const std::vector<std::string>& items, const char* separator) {
  std::string text;
  for (size_t i = 0; i < items.size(); ++i) text += (i ? separator : "") + items[i];
  return text;
}

// A string as YAML: plain when it cannot be misread, double-quoted otherwise.
std::string yaml_string(const std::string& text) {
  static const char* const kReserved[] = {"null", "Null", "NULL", "~",   "true", "True", "TRUE", "false",
                                          "False", "FALSE", "yes", "Yes", "YES", "no",  "No",   "NO",
                                          "on",   "On",   "ON",   "off", "Off", "OFF", "y",    "n",
                                          "Y",    "N"};
  bool plain = !text.empty() && (std::isalpha(static_cast<unsigned char>(text[0])) || text[0] == '_' || text[0] == '/');
  for (char ch : text) {
    if (!(std::isalnum(static_cast<unsigned char>(ch)) || ch == '_' || ch == '.' || ch == '/' || ch == '-')) plain = false;
  }
  for (const char* word : kReserved) {
    if (text == word) plain = false;
  }
  if (plain) return text;
  std::string quoted = "\"";
  for (char ch : text) {
    unsigned char byte = static_cast<unsigned char>(ch);
    if (ch == '"' || ch == '\\') quoted += std::string("\\") + ch;
    else if (ch == '\n') quoted += "\\n";
    else if (ch == '\t') quoted += "\\t";
    else if (byte < 0x20 || byte == 0x7f) {
      char escape[8];
      std::snprintf(escape, sizeof(escape), "\\x%02x", byte);
      quoted += escape;
    } else quoted += ch;
  }
  return quoted + "\"";
}

std::string yaml_value(int64_t value) { return std::to_string(value); }
std::string yaml_value(double value) { return config_detail::format_number(value); }
std::string yaml_value(bool value) { return value ? "true" : "false"; }
std::string yaml_value(const std::string& value) { return yaml_string(value); }
template <class T>
std::string yaml_value(const std::optional<T>& value) {
  return value ? yaml_value(*value) : "null";
}
std::string yaml_value(const std::vector<std::string>& values) {
  std::vector<std::string> items;
  for (const std::string& value : values) items.push_back(yaml_string(value));
  return "[" + join(items, ", ") + "]";
}
// A pattern map as a flow map in its order: {"key": value, ...}.
template <class T>
std::string yaml_value(const PatternMap<T>& values) {
  std::vector<std::string> items;
  for (const auto& [key, value] : values) items.push_back(yaml_string(key) + ": " + yaml_value(value));
  return "{" + join(items, ", ") + "}";
}
// data.source: the string, or the mixture as a flow list the reader takes back.
std::string yaml_value(const config_schema::DataSourceField& source) {
  if (source.mixture.empty()) return yaml_string(source.selector);
  std::vector<std::string> items;
  for (const DataSourceSpec& entry : source.mixture) {
    items.push_back("{path: " + yaml_string(entry.path) + ", weight: " + yaml_value(entry.weight) + "}");
  }
  return "[" + join(items, ", ") + "]";
}

// Writes every field, sections as nested blocks.
struct YamlWriter {
  std::string out;
  std::string indent;
  template <class T>
  void field(const char* key, T& value) {
    out += indent + key + ": " + yaml_value(value) + "\n";
  }
  template <class S>
  void section(const char* key, S& value) {
    if (indent.empty() && !out.empty()) out += "\n";
    out += indent + key + ":\n";
    indent += "  ";
    config_schema::visit_fields(*this, value);
    indent.resize(indent.size() - 2);
  }
};

// Every leaf as (path, YAML text): two configs with equal lists hold the same settings.
struct FlatValues {
  std::vector<std::pair<std::string, std::string>> values;
  std::string prefix;
  template <class T>
  void field(const char* key, T& value) {
    values.emplace_back(prefix + key, yaml_value(value));
  }
  template <class S>
  void section(const char* key, S& value) {
    std::string saved = prefix;
    prefix += std::string(key) + ".";
    config_schema::visit_fields(*this, value);
    prefix = saved;
  }
};

}  // namespace

Config parse_config(const std::string& yaml_text, const std::string& source_name,
                    const std::vector<std::string>& overrides) {
  Config config;
  config.source_path = source_name;
  ReadState state;
  KeyOrigin file_origin;
  file_origin.source = source_name;

  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    throw Error(ExitCode::kBadConfig, source_name + ":" + std::to_string(e.mark.line + 1) + ":" +
                                          std::to_string(e.mark.column + 1) + ": YAML syntax error: " + e.msg);
  }
  config_detail::apply_yaml(config, state, root, file_origin);

  for (const std::string& text : overrides) {
    KeyOrigin set_origin;
    set_origin.source = "--set " + text;
    set_origin.from_set = true;
    YAML::Node tree;
    if (override_as_yaml(text, set_origin, &tree, &state.problems)) {
      config_detail::apply_yaml(config, state, tree, set_origin);
    }
  }
  // Wrong keys and types first: rules over half-read values would only add noise.
  config_detail::throw_if_problems(state.problems);

  config_detail::RuleContext context;
  context.origins = &state.origins;
  context.source = source_name;
  context.model_from_hf_pending = config.model.hf_dir.has_value();
  std::vector<Problem> problems;
  config_detail::check_rules(config, context, &problems);
  config_detail::throw_if_problems(problems);

  for (const auto& entry : state.origins) {
    if (entry.first.rfind("model.", 0) == 0) config.explicit_model_keys.push_back(entry.first);
  }
  // The boolean of export_adapter in one spelling, so that what reads it compares with "true" / "false".
  const config_detail::BooleanWord export_word = config_detail::boolean_word(config.checkpoint.export_adapter);
  if (export_word == config_detail::BooleanWord::kTrue) config.checkpoint.export_adapter = "true";
  if (export_word == config_detail::BooleanWord::kFalse) config.checkpoint.export_adapter = "false";
  return config;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    throw Error(ExitCode::kBadConfig,
                "cannot read config file `" + path + "`: " + std::strerror(errno) + " (check the --config path)");
  }
  std::stringstream text;
  text << file.rdbuf();
  return parse_config(text.str(), path, overrides);
}

void validate_config(const Config& config) {
  config_detail::RuleContext context;
  context.source = config.source_path;
  context.check_required_keys = false;
  std::vector<Problem> problems;
  config_detail::check_rules(config, context, &problems);
  config_detail::throw_if_problems(problems);
}

void validate_config(const Config& config, const std::map<std::string, std::string>& sources) {
  // Every key counts as set (so a rule over several keys is placed at the first of them): at
  // the place `sources` names, else in the config's own file.
  std::map<std::string, KeyOrigin> origins;
  for (const std::string& path : config_detail::all_key_paths()) {
    KeyOrigin where;
    auto it = sources.find(path);
    where.source = it != sources.end() ? it->second : config.source_path;
    origins[path] = where;
  }
  config_detail::RuleContext context;
  context.origins = &origins;
  context.source = config.source_path;
  context.check_required_keys = false;
  std::vector<Problem> problems;
  config_detail::check_rules(config, context, &problems);
  config_detail::throw_if_problems(problems);
}

void validate_for_world(const Config& config, int world_size) {
  MOETRAIN_ASSERT(world_size >= 1, "world size " + std::to_string(world_size));
  KeyOrigin where;
  where.source = (config.source_path.empty() ? std::string("config") : config.source_path) +
                 " with world size " + std::to_string(world_size);
  const int64_t world = world_size;
  const int64_t fsdp = config.parallel.fsdp;
  const int64_t ep = config.parallel.ep;
  const int64_t experts = config.model.moe.num_experts;
  std::vector<Problem> problems;
  if (fsdp >= 1 && world % fsdp != 0) {
    problems.push_back({where, "`parallel.fsdp` = " + std::to_string(fsdp) + " does not divide the world size " +
                                   std::to_string(world) + " (world = fsdp x replicate): set parallel.fsdp to one of " +
                                   join(divisors(world), ", ") + ", or run on a multiple of " +
                                   std::to_string(fsdp) + " ranks"});
  }
  if (ep >= 1) {
    // ep values that would work for both rules, to suggest.
    std::vector<std::string> good_ep;
    for (int64_t d = 1; d <= std::min(world, experts); ++d) {
      if (world % d == 0 && experts % d == 0) good_ep.push_back(std::to_string(d));
    }
    std::string fix = ": set parallel.ep to one of " + join(good_ep, ", ") + " (dividing both)";
    if (experts % ep != 0) {
      problems.push_back({where, "`model.moe.num_experts` = " + std::to_string(experts) +
                                     " is not divisible by `parallel.ep` = " + std::to_string(ep) +
                                     " (each expert-parallel rank holds num_experts / ep experts)" + fix});
    }
    if (world % ep != 0) {
      problems.push_back({where, "`parallel.ep` = " + std::to_string(ep) + " does not divide the world size " +
                                     std::to_string(world) + fix + ", or run on a multiple of " +
                                     std::to_string(ep) + " ranks"});
    }
  }
  const int64_t cp = config.parallel.cp;
  if (cp >= 1 && world % cp != 0) {
    problems.push_back({where, "`parallel.cp` = " + std::to_string(cp) + " does not divide the world size " +
                                   std::to_string(world) + " (each group of cp ranks shares one micro-batch): set " +
                                   "parallel.cp to one of " + join(divisors(world), ", ") +
                                   ", or run on a multiple of " + std::to_string(cp) + " ranks"});
  }
  config_detail::throw_if_problems(problems);
}

std::string config_to_yaml(const Config& config) {
  Config copy = config;  // the visitor takes mutable references
  YamlWriter writer;
  config_schema::visit_fields(writer, copy);
  std::string header;
  if (!config.source_path.empty()) {
    std::string source = config.source_path;
    for (char& ch : source) {
      if (ch == '\n' || ch == '\r') ch = ' ';
    }
    header = "# moetrain resolved config (from " + source + ")\n";
  }
  return header + writer.out;
}

bool same_settings(const Config& a, const Config& b) {
  Config copy_a = a, copy_b = b;
  FlatValues flat_a, flat_b;
  config_schema::visit_fields(flat_a, copy_a);
  config_schema::visit_fields(flat_b, copy_b);
  return flat_a.values == flat_b.values;
}

std::vector<std::string> config_differences(const Config& a, const Config& b) {
  Config copy_a = a, copy_b = b;
  FlatValues flat_a, flat_b;
  config_schema::visit_fields(flat_a, copy_a);
  config_schema::visit_fields(flat_b, copy_b);
  std::vector<std::string> differences;
  for (size_t i = 0; i < flat_a.values.size() && i < flat_b.values.size(); ++i) {
    const auto& [key, value_a] = flat_a.values[i];
    const std::string& value_b = flat_b.values[i].second;
    if (value_a != value_b) differences.push_back(key + ": " + value_a + " -> " + value_b);
  }
  return differences;
}

}  // namespace moetrain
