// The rules a Config must satisfy before any rank does anything with it (internal to
// core/config; the public entry points are in config.h).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/config/config_reader.h"

namespace moetrain::config_detail {

struct RuleContext {
  // Where each leaf key was set; a key absent here holds its default (messages then name the
  // config's source).
  const std::map<std::string, KeyOrigin>* origins = nullptr;
  std::string source;
  // True while model.hf_dir is set but config.json has not been merged yet: model keys the
  // file left out are still unknown, so the required-key rule and the cross-field rules over
  // such keys wait for validate_config after the import.
  bool model_from_hf_pending = false;
  // Whether to name required keys missing from `origins` (only meaningful while parsing).
  bool check_required_keys = true;
};

// Appends a Problem for every single-field, cross-field and required-key rule that fails.
void check_rules(const Config& config, const RuleContext& context, std::vector<Problem>* problems);

}  // namespace moetrain::config_detail
