#include "core/config/lora_patterns.h"

#include <cctype>
#include <cstring>

#include "core/base/error.h"

namespace moetrain {
namespace {

template <typename V>
std::vector<std::string> keys_of(const PatternMap<V>& map) {
  std::vector<std::string> keys;
  for (const auto& entry : map) keys.push_back(entry.first);
  return keys;
}

// PEFT's wrapping of a key (get_pattern_key): group 1 is the optional dotted head, group 2 the
// key, so the key's own groups (and back-references) are numbered as in Python.
std::regex compile(const std::string& key) { return std::regex("(.*\\.)?(" + key + ")$", std::regex::ECMAScript); }

// A fused gate_up module's value: the fused name's when a pattern matches it, else twice the gate
// name's (the fused adapter holds the gate's and the up's side by side). *key is the matched key.
template <typename V, typename At>
V fused_value(const PatternKeys& keys, const std::string& fused, const std::string& gate, At&& at, int* key) {
  *key = keys.match(fused);
  if (*key >= 0) return at(*key);
  *key = keys.match(gate);
  return V(2) * at(*key);
}

}  // namespace

std::string lora_pattern_problem(const std::string& key) {
  if (key.empty()) return "an empty key selects nothing";
  bool in_class = false;
  for (size_t i = 0; i < key.size(); ++i) {
    const char c = key[i];
    const char next = i + 1 < key.size() ? key[i + 1] : '\0';
    if (c == '\\') {
      // Escaped punctuation, the shared classes and control escapes, and back-references \1-\9
      // mean the same in both; every other letter or digit escape does not (\A \Z \a \N \U, octal).
      const bool shared = (next != '\0' && !std::isalnum(static_cast<unsigned char>(next))) ||
                          (next != '\0' && std::strchr("bBdDsSwWfnrtvxu", next) != nullptr) ||
                          (next >= '1' && next <= '9' &&
                           !(i + 2 < key.size() && std::isdigit(static_cast<unsigned char>(key[i + 2]))));
      if (!shared) {
        return "the escape \\" + std::string(1, next) +
               " is not read the same by Python's re (PEFT) and moetrain's ECMAScript regex";
      }
      ++i;
      continue;
    }
    if (in_class) {
      if (c == ']') in_class = false;
      if (c == '[' && (next == ':' || next == '.' || next == '=')) {
        return std::string("\"[") + next + "\" inside a character class is a POSIX class for moetrain's regex but "
               "literal characters for Python's re";
      }
      continue;
    }
    if (c == '[') {
      in_class = true;
      size_t first = i + 1;
      if (first < key.size() && key[first] == '^') ++first;
      if (first < key.size() && key[first] == ']') {
        return "a ']' first in a character class is a literal for Python's re but ends the class for moetrain's "
               "regex: escape it as \\]";
      }
      continue;
    }
    if (c == '(' && next == '?') {
      const char kind = i + 2 < key.size() ? key[i + 2] : '\0';
      if (kind != ':' && kind != '=' && kind != '!') {
        return "\"(?" + std::string(1, kind) +
               "\" (a named group, inline flag, lookbehind or comment) is Python-only syntax; use (?:...), (?=...) "
               "or (?!...)";
      }
    }
  }
  try {
    compile(key);
  } catch (const std::regex_error& e) {
    return std::string("not a valid regular expression (") + e.what() + ")";
  }
  return "";
}

PatternKeys::PatternKeys(const std::vector<std::string>& keys, const std::string& what) : keys_(keys) {
  for (const std::string& key : keys_) {
    const std::string problem = lora_pattern_problem(key);
    MOETRAIN_CHECK(problem.empty(), ExitCode::kBadConfig, what + "[\"" + key + "\"]: " + problem);
    compiled_.push_back(compile(key));
  }
}

int PatternKeys::match(const std::string& name) const {
  // re.match: anchored at the start only; the `$` of the wrapping anchors the end.
  for (size_t i = 0; i < compiled_.size(); ++i) {
    if (std::regex_search(name, compiled_[i], std::regex_constants::match_continuous)) return static_cast<int>(i);
  }
  return -1;
}

LoraRanks::LoraRanks(int64_t rank, double alpha, const PatternMap<int64_t>& rank_pattern,
                     const PatternMap<double>& alpha_pattern, const std::string& what)
    : rank_(rank),
      alpha_(alpha),
      what_(what),
      rank_pattern_(rank_pattern),
      alpha_pattern_(alpha_pattern),
      rank_keys_(keys_of(rank_pattern), what + ".rank_pattern"),
      alpha_keys_(keys_of(alpha_pattern), what + ".alpha_pattern"),
      rank_used_(rank_pattern.size(), false),
      alpha_used_(alpha_pattern.size(), false) {}

LoraRanks::LoraRanks(const LoraConfig& lora)
    : LoraRanks(lora.rank, lora.alpha, lora.rank_pattern, lora.alpha_pattern) {}

int64_t LoraRanks::rank_at(int key) {
  if (key < 0) return rank_;
  rank_used_[static_cast<size_t>(key)] = true;
  return rank_pattern_[static_cast<size_t>(key)].second;
}

double LoraRanks::alpha_at(int key) {
  if (key < 0) return alpha_;
  alpha_used_[static_cast<size_t>(key)] = true;
  return alpha_pattern_[static_cast<size_t>(key)].second;
}

ModuleLora LoraRanks::module(const std::string& name) {
  ModuleLora m;
  m.rank_key = rank_keys_.match(name);
  m.alpha_key = alpha_keys_.match(name);
  m.rank = rank_at(m.rank_key);
  m.alpha = alpha_at(m.alpha_key);
  return m;
}

ModuleLora LoraRanks::fused_gate_up(const std::string& experts) {
  const std::string fused = experts + ".gate_up_proj", gate = experts + ".gate_proj";
  ModuleLora m;
  m.rank = fused_value<int64_t>(rank_keys_, fused, gate, [&](int key) { return rank_at(key); }, &m.rank_key);
  m.alpha = fused_value<double>(alpha_keys_, fused, gate, [&](int key) { return alpha_at(key); }, &m.alpha_key);
  return m;
}

std::vector<std::string> LoraRanks::unused_keys() const {
  std::vector<std::string> unused;
  for (size_t i = 0; i < rank_used_.size(); ++i)
    if (!rank_used_[i]) unused.push_back(what_ + ".rank_pattern[\"" + rank_pattern_[i].first + "\"]");
  for (size_t i = 0; i < alpha_used_.size(); ++i)
    if (!alpha_used_[i]) unused.push_back(what_ + ".alpha_pattern[\"" + alpha_pattern_[i].first + "\"]");
  return unused;
}

}  // namespace moetrain
