#include "core/config/config_reader.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <tuple>

#include "core/base/error.h"
#include "core/config/config_schema.h"

namespace moetrain::config_detail {

std::string describe(const KeyOrigin& origin) {
  if (origin.from_set) return origin.source;
  if (origin.line <= 0) return origin.source.empty() ? "default" : origin.source;
  return origin.source + ":" + std::to_string(origin.line) + ":" + std::to_string(origin.column);
}

void throw_if_problems(std::vector<Problem> problems) {
  if (problems.empty()) return;
  // File problems by position, then --set problems in command-line order.
  std::stable_sort(problems.begin(), problems.end(), [](const Problem& a, const Problem& b) {
    return std::make_tuple(a.where.from_set, a.where.line, a.where.column) <
           std::make_tuple(b.where.from_set, b.where.line, b.where.column);
  });
  std::string text;
  if (problems.size() > 1) text = std::to_string(problems.size()) + " problems in the config:\n";
  for (size_t i = 0; i < problems.size(); ++i) {
    if (problems.size() > 1) text += "  ";
    text += describe(problems[i].where) + ": " + problems[i].message;
    if (i + 1 < problems.size()) text += "\n";
  }
  throw Error(ExitCode::kBadConfig, text);
}

BooleanWord boolean_word(const std::string& text) {
  static const std::set<std::string> truthy = {"true", "True", "TRUE"};
  static const std::set<std::string> falsy = {"false", "False", "FALSE"};
  static const std::set<std::string> ambiguous = {"yes", "Yes", "YES", "no", "No",  "NO", "on", "On", "ON",
                                                  "off", "Off", "OFF", "y",  "Y",   "n",  "N",  "0",  "1"};
  if (truthy.count(text)) return BooleanWord::kTrue;
  if (falsy.count(text)) return BooleanWord::kFalse;
  if (ambiguous.count(text)) return BooleanWord::kAmbiguous;
  return BooleanWord::kNotBoolean;
}

std::string format_number(double value) {
  // The shortest text that reads back to the same double, so a written config round-trips.
  char buffer[64];
  for (int precision = 6; precision <= 17; ++precision) {
    std::snprintf(buffer, sizeof(buffer), "%.*g", precision, value);
    if (std::strtod(buffer, nullptr) == value) break;
  }
  std::string text = buffer;
  // Keep a number-looking number: "2" -> "2.0", so the YAML says "a float was meant".
  if (text.find_first_of(".eEn") == std::string::npos) text += ".0";
  return text;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> previous(b.size() + 1), current(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) previous[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    current[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t substitute = previous[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      current[j] = std::min({previous[j] + 1, current[j - 1] + 1, substitute});
    }
    std::swap(previous, current);
  }
  return previous[b.size()];
}

namespace {

std::string join_path(const std::string& prefix, const std::string& key) {
  return prefix.empty() ? key : prefix + "." + key;
}

std::string last_component(const std::string& path) {
  size_t dot = path.rfind('.');
  return dot == std::string::npos ? path : path.substr(dot + 1);
}

std::string quoted_list(const std::vector<std::string>& items, const char* separator) {
  std::string text;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) text += separator;
    text += "`" + items[i] + "`";
  }
  return text;
}

// Collects every key path of the schema.
struct PathCollector {
  std::vector<std::string> paths;
  std::string prefix;
  template <class T>
  void field(const char* key, T&) {
    paths.push_back(join_path(prefix, key));
  }
  template <class S>
  void section(const char* key, S& value) {
    std::string saved = prefix;
    prefix = join_path(prefix, key);
    paths.push_back(prefix);
    config_schema::visit_fields(*this, value);
    prefix = saved;
  }
};

}  // namespace

const std::vector<std::string>& all_key_paths() {
  static const std::vector<std::string> paths = [] {
    Config defaults;
    PathCollector collector;
    config_schema::visit_fields(collector, defaults);
    return collector.paths;
  }();
  return paths;
}

std::string unknown_key_hint(const std::string& level_path, const std::string& key,
                             const std::vector<std::string>& known) {
  size_t best_distance = std::string::npos;
  std::string best;
  for (const std::string& candidate : known) {
    size_t d = edit_distance(key, candidate);
    if (d < best_distance) best_distance = d, best = candidate;
  }
  // A one-letter slip at this level is the likeliest story; next, a right name at the wrong
  // level (`model.top_k` for `model.moe.top_k`); next, a bigger slip at this level.
  if (best_distance <= 1) return " (did you mean `" + join_path(level_path, best) + "`?)";
  std::vector<std::string> elsewhere;
  for (const std::string& path : all_key_paths()) {
    if (last_component(path) == key) elsewhere.push_back(path);
  }
  if (!elsewhere.empty()) return " (did you mean " + quoted_list(elsewhere, " or ") + "?)";
  size_t threshold = std::max<size_t>(2, key.size() / 3);
  if (best_distance <= threshold) return " (did you mean `" + join_path(level_path, best) + "`?)";
  return " (valid keys " + (level_path.empty() ? std::string("at the top level") : "in `" + level_path + "`") +
         ": " + quoted_list(known, ", ") + ")";
}

namespace {

// How a node reads in a message: "a map", "a list", "null", "the quoted string \"8\"", "`abc`".
std::string describe_node(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Map: return "a map";
    case YAML::NodeType::Sequence: return "a list";
    case YAML::NodeType::Null: return "null";
    case YAML::NodeType::Scalar:
      if (node.Tag() == "!") return "the quoted string \"" + node.Scalar() + "\"";
      return "`" + node.Scalar() + "`";
    default: return "nothing";
  }
}

bool is_plain_scalar(const YAML::Node& node) { return node.IsScalar() && node.Tag() != "!"; }

// YAML 1.2 core-schema integers in decimal only: 010 is ten, not eight (yaml-cpp's own
// conversion would read it as octal).
bool parse_integer(const std::string& text, int64_t* value, bool* overflow) {
  size_t start = (!text.empty() && (text[0] == '-' || text[0] == '+')) ? 1 : 0;
  if (start == text.size()) return false;
  for (size_t i = start; i < text.size(); ++i) {
    if (text[i] < '0' || text[i] > '9') return false;
  }
  errno = 0;
  long long parsed = std::strtoll(text.c_str(), nullptr, 10);
  *overflow = errno == ERANGE;
  *value = parsed;
  return true;
}

// Decimal numbers with optional fraction and exponent ("2e-4", "0.5", "3", ".5"); no hex,
// inf or nan (strtod alone would take those).
bool parse_number(const std::string& text, double* value) {
  size_t i = 0, n = text.size();
  if (i < n && (text[i] == '-' || text[i] == '+')) ++i;
  size_t digits = 0;
  while (i < n && text[i] >= '0' && text[i] <= '9') ++i, ++digits;
  if (i < n && text[i] == '.') {
    ++i;
    while (i < n && text[i] >= '0' && text[i] <= '9') ++i, ++digits;
  }
  if (digits == 0) return false;
  if (i < n && (text[i] == 'e' || text[i] == 'E')) {
    ++i;
    if (i < n && (text[i] == '-' || text[i] == '+')) ++i;
    size_t exponent_digits = 0;
    while (i < n && text[i] >= '0' && text[i] <= '9') ++i, ++exponent_digits;
    if (exponent_digits == 0) return false;
  }
  if (i != n) return false;
  *value = std::strtod(text.c_str(), nullptr);
  return true;
}

// Applies a YAML map onto a Config, one level of nesting per `Level`.
class YamlApplier {
 public:
  YamlApplier(ReadState& state, const KeyOrigin& source) : state_(state), source_(source) {}

  void apply(Config& config, const YAML::Node& root) {
    if (root.IsNull()) return;  // an empty file or `--set x=` at the top: nothing to apply
    if (!root.IsMap()) {
      add_problem(origin_of(root), "the config must be a map of sections (model:, lora:, ...), got " +
                                       describe_node(root));
      return;
    }
    levels_.push_back({"", root, {}});
    config_schema::visit_fields(*this, config);
    check_keys(levels_.back());
    levels_.pop_back();
  }

  template <class T>
  void field(const char* key, T& value) {
    SetKey set;
    if (visit_key(key, &set) && read_value(set.path, set.node, set.where, value)) state_.origins[set.path] = set.where;
  }

  template <class S>
  void section(const char* key, S& value) {
    SetKey set;
    if (!visit_key(key, &set)) return;
    if (set.node.IsNull()) return;  // `mla:` with nothing under it keeps every default
    if (!set.node.IsMap()) {
      add_problem(set.where, "`" + set.path + "` is a section: expected a map of keys, got " + describe_node(set.node));
      return;
    }
    levels_.push_back({set.path, set.node, {}});
    config_schema::visit_fields(*this, value);
    check_keys(levels_.back());
    levels_.pop_back();
  }

 private:
  struct Level {
    std::string path;
    YAML::Node map;
    std::vector<std::string> known;
  };

  // A key the current level sets: its node, where it was set, and its dotted path.
  struct SetKey {
    YAML::Node node;
    KeyOrigin where;
    std::string path;
  };

  // Marks key as known at the current level; when the level sets it, fills *set and returns true.
  bool visit_key(const char* key, SetKey* set) {
    levels_.back().known.push_back(key);
    if (!find(key, &set->node, &set->where)) return false;
    set->path = join_path(levels_.back().path, key);
    return true;
  }

  KeyOrigin origin_of(const YAML::Node& node) const {
    KeyOrigin where = source_;
    if (!source_.from_set) {
      where.line = node.Mark().line + 1;
      where.column = node.Mark().column + 1;
    }
    return where;
  }

  void add_problem(const KeyOrigin& where, const std::string& message) {
    state_.problems.push_back({where, message});
  }

  // The value of `key` in the current map and where its key stands; the last one if repeated
  // (check_keys reports the repetition).
  bool find(const char* key, YAML::Node* value, KeyOrigin* where) const {
    bool found = false;
    for (const auto& entry : levels_.back().map) {
      if (entry.first.IsScalar() && entry.first.Scalar() == key) {
        *value = entry.second;
        *where = origin_of(entry.first);
        found = true;
      }
    }
    return found;
  }

  void check_keys(const Level& level) {
    std::set<std::string> seen;
    for (const auto& entry : level.map) {
      KeyOrigin where = origin_of(entry.first);
      if (!entry.first.IsScalar()) {
        add_problem(where, "a key must be a name, got " + describe_node(entry.first) +
                               (level.path.empty() ? "" : " in `" + level.path + "`"));
        continue;
      }
      const std::string& key = entry.first.Scalar();
      std::string path = join_path(level.path, key);
      if (std::find(level.known.begin(), level.known.end(), key) == level.known.end()) {
        add_problem(where, "unknown key `" + path + "`" + unknown_key_hint(level.path, key, level.known));
      } else if (!seen.insert(key).second) {
        add_problem(where, "`" + path + "` is set more than once in the same map: keep one");
      }
    }
  }

  bool type_problem(const std::string& path, const YAML::Node& node, const KeyOrigin& where,
                    const std::string& expected, bool nullable = false) {
    std::string got = describe_node(node);
    std::string message = "`" + path + "` expects " + expected + (nullable ? " or null" : "") + ", got " + got;
    if (node.IsNull()) message += " (only optional keys may be null)";
    else if (node.IsScalar() && node.Tag() == "!") message += " (remove the quotes)";
    add_problem(where, message);
    return false;
  }

  bool read_value(const std::string& path, const YAML::Node& node, const KeyOrigin& where, int64_t& value,
                  bool nullable = false) {
    int64_t parsed = 0;
    bool overflow = false;
    if (!is_plain_scalar(node) || !parse_integer(node.Scalar(), &parsed, &overflow)) {
      return type_problem(path, node, where, "an integer", nullable);
    }
    if (overflow) {
      add_problem(where, "`" + path + "` = " + node.Scalar() + " is out of the 64-bit integer range");
      return false;
    }
    value = parsed;
    return true;
  }

  bool read_value(const std::string& path, const YAML::Node& node, const KeyOrigin& where, double& value,
                  bool nullable = false) {
    if (!is_plain_scalar(node) || !parse_number(node.Scalar(), &value)) {
      return type_problem(path, node, where, "a number", nullable);
    }
    if (!std::isfinite(value)) {
      add_problem(where, "`" + path + "` = " + node.Scalar() + " is out of the double-precision range");
      return false;
    }
    return true;
  }

  bool read_value(const std::string& path, const YAML::Node& node, const KeyOrigin& where, bool& value,
                  bool nullable = false) {
    const BooleanWord word = node.IsScalar() ? boolean_word(node.Scalar()) : BooleanWord::kNotBoolean;
    if (is_plain_scalar(node) && word == BooleanWord::kTrue) return value = true, true;
    if (is_plain_scalar(node) && word == BooleanWord::kFalse) return value = false, true;
    if (is_plain_scalar(node) && word == BooleanWord::kAmbiguous) {
      add_problem(where, "`" + path + "` expects a boolean (true or false), got `" + node.Scalar() +
                             "`, which YAML 1.1 reads as a boolean and YAML 1.2 as a " +
                             (node.Scalar() == "0" || node.Scalar() == "1" ? "number" : "string") +
                             ": write true or false");
      return false;
    }
    return type_problem(path, node, where, "a boolean (true or false)", nullable);
  }

  bool read_value(const std::string& path, const YAML::Node& node, const KeyOrigin& where, std::string& value,
                  bool nullable = false) {
    if (!node.IsScalar()) return type_problem(path, node, where, "a string", nullable);
    value = node.Scalar();
    return true;
  }

  template <class T>
  bool read_value(const std::string& path, const YAML::Node& node, const KeyOrigin& where,
                  std::optional<T>& value) {
    if (node.IsNull()) {
      value.reset();
      return true;
    }
    T parsed{};
    if (!read_value(path, node, where, parsed, /*nullable=*/true)) return false;
    value = parsed;
    return true;
  }

  bool read_value(const std::string& path, const YAML::Node& node, const KeyOrigin& where,
                  std::vector<std::string>& value) {
    if (!node.IsSequence()) return type_problem(path, node, where, "a list of strings, like [a, b]");
    std::vector<std::string> items;
    bool ok = true;
    for (size_t i = 0; i < node.size(); ++i) {
      const YAML::Node item = node[i];
      if (!item.IsScalar()) {
        KeyOrigin item_where = item.IsNull() ? where : origin_of(item);
        type_problem(path + "[" + std::to_string(i) + "]", item, item_where, "a string");
        ok = false;
        continue;
      }
      items.push_back(item.Scalar());
    }
    if (ok) value = items;
    return ok;
  }

  // A pattern map (lora.rank_pattern / alpha_pattern): {key: value, ...} in the file's order.
  template <class T>
  bool read_value(const std::string& path, const YAML::Node& node, const KeyOrigin& where, PatternMap<T>& value) {
    if (!node.IsMap()) return type_problem(path, node, where, "a map from module-name patterns to values, like {q_proj: 16}");
    PatternMap<T> entries;
    bool ok = true;
    std::set<std::string> seen;
    for (const auto& entry : node) {
      const KeyOrigin key_where = origin_of(entry.first);
      if (!entry.first.IsScalar()) {
        add_problem(key_where, "a key of `" + path + "` must be a module name or pattern, got " +
                                   describe_node(entry.first));
        ok = false;
        continue;
      }
      const std::string& key = entry.first.Scalar();
      if (!seen.insert(key).second) {
        add_problem(key_where, "`" + path + "[\"" + key + "\"]` is set more than once in the same map: keep one");
        ok = false;
        continue;
      }
      T parsed{};
      ok = read_value(path + "[\"" + key + "\"]", entry.second, key_where, parsed) && ok;
      entries.emplace_back(key, parsed);
    }
    if (ok) value = entries;
    return ok;
  }

  // data.source: `synthetic` or a path prefix, or a list of {path: prefix, weight: number}.
  bool read_value(const std::string& path, const YAML::Node& node, const KeyOrigin& where,
                  config_schema::DataSourceField& value) {
    const char* expected = "a string (synthetic or a dataset path prefix) or a list of {path, weight}";
    if (node.IsScalar()) {
      value.selector = node.Scalar();
      value.mixture.clear();
      return true;
    }
    if (!node.IsSequence() || node.size() == 0) return type_problem(path, node, where, expected);
    std::vector<DataSourceSpec> entries;
    bool ok = true;
    for (size_t i = 0; i < node.size(); ++i) {
      const YAML::Node item = node[i];
      const std::string item_path = path + "[" + std::to_string(i) + "]";
      const KeyOrigin item_where = item.IsNull() ? where : origin_of(item);
      if (!item.IsMap()) {
        ok = type_problem(item_path, item, item_where, "a map {path: prefix, weight: number}");
        continue;
      }
      DataSourceSpec entry;
      bool has_path = false;
      std::set<std::string> seen;
      for (const auto& key_value : item) {
        const KeyOrigin key_where = origin_of(key_value.first);
        const std::string key = key_value.first.IsScalar() ? key_value.first.Scalar() : "";
        if (key != "path" && key != "weight") {
          add_problem(key_where, "unknown key `" + key + "` in `" + item_path + "`" +
                                     unknown_key_hint(item_path, key, {"path", "weight"}));
          ok = false;
        } else if (!seen.insert(key).second) {
          add_problem(key_where, "`" + item_path + "." + key + "` is set more than once in the same map: keep one");
          ok = false;
        } else if (key == "path") {
          const YAML::Node& text = key_value.second;
          if (!text.IsScalar()) ok = type_problem(item_path + ".path", text, key_where, "a string");
          else entry.path = text.Scalar(), has_path = true;
        } else {
          ok = read_value(item_path + ".weight", key_value.second, key_where, entry.weight) && ok;
        }
      }
      if (!has_path && item.IsMap() && !seen.count("path")) {
        add_problem(item_where, "`" + item_path + "` needs a `path` (the dataset's prefix, dir/name for "
                                "dir/name.bin + dir/name.idx)");
        ok = false;
      }
      entries.push_back(entry);
    }
    if (!ok) return false;
    value.selector = kDataSourceMixture;
    value.mixture = entries;
    return true;
  }

  ReadState& state_;
  KeyOrigin source_;
  std::vector<Level> levels_;
};

}  // namespace

void apply_yaml(Config& config, ReadState& state, const YAML::Node& root, const KeyOrigin& source) {
  YamlApplier applier(state, source);
  applier.apply(config, root);
}

}  // namespace moetrain::config_detail
