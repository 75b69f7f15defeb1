// Per-module LoRA ranks and alphas, as PEFT's LoraConfig gives them (`rank_pattern`,
// `alpha_pattern`): a map from a key (a module name, a short name such as `q_proj`, or a regular
// expression) to the rank or alpha of the modules it selects; every other module keeps the
// default (lora.rank, lora.alpha). PEFT 0.21 (peft.utils.other.get_pattern_key) gives a module
// named n the value of the FIRST key k, in the map's order, for which Python's
//     re.match(rf"(.*\.)?({k})$", n)
// matches: a key must match a whole dot-separated tail of the name (`q_proj` selects
// `model.layers.0.self_attn.q_proj`; `experts\..*` every projection of `...mlp.experts`; `proj`
// nothing). rank_pattern and alpha_pattern are looked up independently: a module that only
// rank_pattern selects keeps the default alpha.
//
// Keys are evaluated with std::regex (ECMAScript), whose syntax shares most of Python's with the
// same meaning; lora_pattern_problem refuses what the two read differently or what only Python
// has (named groups, inline flags, lookbehind, comments, \A \Z and other letter escapes, POSIX
// classes, a `]` first in a class), so a key that is accepted selects what PEFT selects.
#pragma once

#include <cstdint>
#include <regex>
#include <string>
#include <vector>

#include "core/config/config.h"

namespace moetrain {

// Empty when `key` is a pattern moetrain evaluates exactly as Python's re; else what is wrong.
std::string lora_pattern_problem(const std::string& key);

// The keys of one pattern map, compiled.
class PatternKeys {
 public:
  PatternKeys() = default;
  // Error(kBadConfig) naming the key when lora_pattern_problem refuses one (`what` names the map,
  // e.g. "lora.rank_pattern").
  PatternKeys(const std::vector<std::string>& keys, const std::string& what);

  // The index of the key get_pattern_key picks for `name`, or -1 when none matches.
  int match(const std::string& name) const;
  const std::string& key(int index) const { return keys_[static_cast<size_t>(index)]; }
  size_t size() const { return keys_.size(); }

 private:
  std::vector<std::string> keys_;
  std::vector<std::regex> compiled_;
};

// A module's rank and alpha, and the keys that gave them (-1: the default).
struct ModuleLora {
  int64_t rank = 0;
  double alpha = 0.0;
  int rank_key = -1;
  int alpha_key = -1;
};

// The default rank and alpha with their pattern maps, resolved per module name as PEFT does.
// Remembers which keys selected a module, so that a key selecting nothing can be reported.
class LoraRanks {
 public:
  LoraRanks(int64_t rank, double alpha, const PatternMap<int64_t>& rank_pattern, const PatternMap<double>& alpha_pattern,
            const std::string& what = "lora");
  explicit LoraRanks(const LoraConfig& lora);

  ModuleLora module(const std::string& name);

  // The routed experts' fused gate_up adapter of `experts` (e.g. model.layers.1.mlp.experts), as
  // lora.expert_gate_up: fused holds it: a key that selects `<experts>.gate_up_proj` sets its rank
  // (alpha) directly, as in PEFT; otherwise it is twice what `<experts>.gate_proj` gets, as PEFT
  // writes its conversion of gate and up adapters (rank 2r, alpha 2 alpha).
  ModuleLora fused_gate_up(const std::string& experts);

  // "lora.rank_pattern[\"key\"]" for every key that has selected no module so far.
  std::vector<std::string> unused_keys() const;

  const std::string& rank_key(int index) const { return rank_keys_.key(index); }
  const std::string& alpha_key(int index) const { return alpha_keys_.key(index); }

 private:
  int64_t rank_at(int key);  // the key's value (the default for -1), marking the key used
  double alpha_at(int key);

  int64_t rank_;
  double alpha_;
  std::string what_;
  PatternMap<int64_t> rank_pattern_;
  PatternMap<double> alpha_pattern_;
  PatternKeys rank_keys_, alpha_keys_;
  std::vector<bool> rank_used_, alpha_used_;
};

}  // namespace moetrain
