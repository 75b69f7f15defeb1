// The checkpoint: keys added for preemption and adapters (save_on_signal, export_adapter,
// init_adapter; docs/CHECKPOINTS.md): their defaults, good values from a file and from --set,
// and every way they can be wrong giving exit code 2 with a message naming the key.
#include <string>
#include <vector>

#include "catch.h"
#include "core/base/error.h"
#include "core/config/config.h"

using namespace moetrain;

namespace {

// The smallest valid config, plus `checkpoint_line` (a whole `checkpoint:` line, or empty).
std::string tiny_yaml(const std::string& checkpoint_line) {
  return "model:\n"
         "  vocab_size: 64\n"
         "  hidden_size: 32\n"
         "  num_layers: 2\n"
         "  mla: {num_heads: 2}\n"
         "  moe: {num_experts: 4, top_k: 2}\n"
         "data: {seq_len: 16}\n" +
         checkpoint_line + "\n";
}

Config parse(const std::string& checkpoint_line, const std::vector<std::string>& overrides = {}) {
  return parse_config(tiny_yaml(checkpoint_line), "ckpt.yaml", overrides);
}

// The message of the bad-config Error that parsing must throw (exit code 2).
std::string bad_config_message(const std::string& checkpoint_line, const std::vector<std::string>& overrides = {}) {
  try {
    parse(checkpoint_line, overrides);
  } catch (const Error& e) {
    CHECK(e.code() == ExitCode::kBadConfig);
    CHECK(static_cast<int>(e.code()) == 2);
    return e.what();
  }
  FAIL("expected moetrain::Error(kBadConfig) for `" << checkpoint_line << "` with " << overrides.size()
                                                     << " override(s); nothing was thrown");
  return "";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("checkpoint config: defaults save on a signal, export the adapter, start from no adapter") {
  Config c = parse("");
  CHECK(c.checkpoint.save_on_signal);
  CHECK(c.checkpoint.export_adapter == "true");
  CHECK(!c.checkpoint.init_adapter.has_value());
}

TEST_CASE("checkpoint config: good values parse from the file") {
  Config c = parse("checkpoint: {save_on_signal: false, export_adapter: false, init_adapter: adapters/start}");
  CHECK(!c.checkpoint.save_on_signal);
  CHECK(c.checkpoint.export_adapter == "false");
  REQUIRE(c.checkpoint.init_adapter.has_value());
  CHECK(*c.checkpoint.init_adapter == "adapters/start");

  c = parse("checkpoint: {save_on_signal: True, export_adapter: out/my_adapter, init_adapter: null}");
  CHECK(c.checkpoint.save_on_signal);
  CHECK(c.checkpoint.export_adapter == "out/my_adapter");
  CHECK(!c.checkpoint.init_adapter.has_value());
}

TEST_CASE("checkpoint config: good values parse from --set and override the file") {
  Config c = parse("checkpoint: {save_on_signal: true, export_adapter: true}",
                   {"checkpoint.save_on_signal=false", "checkpoint.export_adapter=/tmp/adapter",
                    "checkpoint.init_adapter=/data/peft"});
  CHECK(!c.checkpoint.save_on_signal);
  CHECK(c.checkpoint.export_adapter == "/tmp/adapter");
  REQUIRE(c.checkpoint.init_adapter.has_value());
  CHECK(*c.checkpoint.init_adapter == "/data/peft");

  // null from the command line switches a set init_adapter off again.
  c = parse("checkpoint: {init_adapter: adapters/start}", {"checkpoint.init_adapter=null"});
  CHECK(!c.checkpoint.init_adapter.has_value());
}

TEST_CASE("checkpoint config: the keys survive the resolved YAML a checkpoint stores") {
  Config c = parse("checkpoint: {save_on_signal: false, export_adapter: exported, init_adapter: seed_adapter}");
  Config back = parse_config(config_to_yaml(c), "resolved.yaml");
  CHECK(!back.checkpoint.save_on_signal);
  CHECK(back.checkpoint.export_adapter == "exported");
  REQUIRE(back.checkpoint.init_adapter.has_value());
  CHECK(*back.checkpoint.init_adapter == "seed_adapter");
  CHECK(same_settings(c, back));
}

TEST_CASE("checkpoint config: save_on_signal must be a boolean") {
  struct Case {
    std::string line;
    std::string got;
  };
  for (const Case& bad : std::vector<Case>{{"checkpoint: {save_on_signal: maybe}", "maybe"},
                                           {"checkpoint: {save_on_signal: 1}", "1"},
                                           {"checkpoint: {save_on_signal: yes}", "yes"},
                                           {"checkpoint: {save_on_signal: [true]}", "a list"},
                                           {"checkpoint: {save_on_signal: null}", "null"}}) {
    std::string message = bad_config_message(bad.line);
    INFO(bad.line << " -> " << message);
    CHECK(contains(message, "`checkpoint.save_on_signal` expects a boolean"));
    CHECK(contains(message, bad.got));
  }
  std::string message = bad_config_message("", {"checkpoint.save_on_signal=sometimes"});
  CHECK(contains(message, "`checkpoint.save_on_signal`"));
  CHECK(contains(message, "--set"));
}

TEST_CASE("checkpoint config: export_adapter must be true, false or a directory") {
  for (const char* yaml : {"checkpoint: {export_adapter: [a, b]}", "checkpoint: {export_adapter: {dir: out}}"}) {
    CHECK(contains(bad_config_message(yaml), "`checkpoint.export_adapter` expects a string"));
  }
  // Not optional: false (not null) switches the export off.
  CHECK(contains(bad_config_message("checkpoint: {export_adapter: null}"), "`checkpoint.export_adapter`"));
  CHECK(contains(bad_config_message("checkpoint: {export_adapter: \"\"}"), "`checkpoint.export_adapter`"));
  CHECK(contains(bad_config_message("", {"checkpoint.export_adapter="}), "`checkpoint.export_adapter`"));
}

// export_adapter takes the booleans' rule; a word that reads as a boolean (or
// none, or a number) is never taken for a directory's name.
TEST_CASE("checkpoint config: export_adapter is true, false or a path, never a boolean-ish directory name") {
  for (const char* word : {"true", "True", "TRUE"}) {
    CHECK(parse(std::string("checkpoint: {export_adapter: ") + word + "}").checkpoint.export_adapter == "true");
  }
  for (const char* word : {"false", "False", "FALSE"}) {
    CHECK(parse("", {std::string("checkpoint.export_adapter=") + word}).checkpoint.export_adapter == "false");
  }
  for (const char* word : {"off", "no", "Yes", "ON", "y", "0", "1", "none", "None", "NONE", "3", "1e3"}) {
    const std::string message = bad_config_message("", {std::string("checkpoint.export_adapter=") + word});
    INFO(message);
    CHECK(contains(message, std::string("`checkpoint.export_adapter` = `") + word + "` is ambiguous"));
    CHECK(contains(message, std::string("./") + word));
  }
  // Quoted, a boolean-ish word is still refused: quotes are easy to lose on a command line.
  CHECK(contains(bad_config_message("checkpoint: {export_adapter: \"off\"}"), "is ambiguous"));
  CHECK(parse("checkpoint: {export_adapter: ./off}").checkpoint.export_adapter == "./off");
  CHECK(parse("checkpoint: {export_adapter: out/2024-06-01}").checkpoint.export_adapter == "out/2024-06-01");
  CHECK(parse("checkpoint: {export_adapter: adapters_v2}").checkpoint.export_adapter == "adapters_v2");
}

TEST_CASE("checkpoint config: init_adapter must be a directory or null") {
  for (const char* yaml : {"checkpoint: {init_adapter: [a]}", "checkpoint: {init_adapter: {path: a}}"}) {
    CHECK(contains(bad_config_message(yaml), "`checkpoint.init_adapter` expects a string or null"));
  }
  CHECK(contains(bad_config_message("checkpoint: {init_adapter: \"\"}"), "`checkpoint.init_adapter`"));
}

TEST_CASE("checkpoint config: a misspelt key is unknown and the message suggests the real one") {
  std::string message = bad_config_message("checkpoint: {save_on_signals: true}");
  CHECK(contains(message, "unknown key `checkpoint.save_on_signals`"));
  CHECK(contains(message, "checkpoint.save_on_signal`"));
  message = bad_config_message("", {"checkpoint.export_adaptor=false"});
  CHECK(contains(message, "unknown key `checkpoint.export_adaptor`"));
  CHECK(contains(message, "checkpoint.export_adapter`"));
  message = bad_config_message("checkpoint: {init_adapters: x}");
  CHECK(contains(message, "unknown key `checkpoint.init_adapters`"));
}

TEST_CASE("checkpoint config: export_layout is transformers5 by default, or per_expert") {
  CHECK(parse("checkpoint: {every: 0}").checkpoint.export_layout == "transformers5");
  CHECK(parse("checkpoint: {export_layout: per_expert}").checkpoint.export_layout == "per_expert");
  std::string message = bad_config_message("checkpoint: {export_layout: fused}");
  CHECK(contains(message, "`checkpoint.export_layout` = `fused` is not allowed: use one of transformers5 | per_expert"));
}
