// moetrain: the trainer's command line (DESIGN.md §6).
//
//   moetrain validate --config FILE [--set key.path=value]... [--world N]
//   moetrain train    --config FILE [--set key.path=value]... [--resume auto|none|PATH]
//                     [--init-adapter PEFT_DIR]
//   moetrain export   --checkpoint DIR --out ADAPTER_DIR
//   moetrain plan     --config FILE --world N [--set ...] [--json] [--gpu-gb G]  (core/plan)
//
// Both load the config strictly, apply the overrides, check it against the job's world size
// and print the resolved config on stdout. Exit codes: 0 done, 1 internal error, 2 bad config
// or command line (the message on stderr), 3/4/75 from training (see core/base/error.h).
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

// --set values may hold commas (`--set model.layers=[mla,kda]`); cxxopts would split
// vector-valued options at them, so give it a delimiter no argument contains.
#define CXXOPTS_VECTOR_DELIMITER '\0'
#include <cxxopts.hpp>

#include "core/base/error.h"
#include "core/base/log.h"
#include "core/checkpoint/adapter_export.h"
#include "core/config/config.h"
#include "core/data/data_stats.h"
#include "core/plan/memory_plan.h"
#include "core/train/run_training.h"
#include "parallel/runtime.h"

namespace moetrain {
namespace {

const char* const kUsage =
    "usage:\n"
    "  moetrain validate --config FILE [--set key.path=value]... [--world N]\n"
    "      check the config (for a job of N ranks; default: this job's size) and print it resolved\n"
    "  moetrain train --config FILE [--set key.path=value]... [--resume auto|none|PATH] [--init-adapter DIR]\n"
    "      train as the config says (--init-adapter: start the LoRA weights from a PEFT adapter)\n"
    "  moetrain export --checkpoint DIR --out ADAPTER_DIR\n"
    "      write a checkpoint's LoRA weights as a PEFT adapter (DIR: a step_<N> or a checkpoint root)\n"
    "  moetrain plan --config FILE --world N [--set key.path=value]... [--json] [--gpu-gb G]\n"
    "      per-rank memory and communication of the config on N ranks, without a GPU\n"
    "  moetrain data-stats FILE_PREFIX\n"
    "      documents, tokens, loss-mask ratio and length histogram of a dataset (FILE_PREFIX.bin/.idx)\n"
    "  moetrain help\n"
    "--set takes a YAML value and may repeat: --set train.lr=1e-4 --set model.layers=[mla,kda]\n";

struct CommandLine {
  std::string command;                  // validate | train | help
  std::string config_path;
  std::vector<std::string> overrides;   // "key.path=value", in order
  std::optional<std::string> resume;    // train only
  std::optional<int> world;             // validate only
  std::optional<std::string> init_adapter;  // train only
  std::string checkpoint, out;          // export only
  bool json = false;                    // plan only: JSON instead of the table
  double gpu_gb = 141.0;                // plan only: memory of one GPU
};

// Prints the usage (first rank only, so a launch of many ranks prints it once) and throws the
// command-line error with exit code 2.
[[noreturn]] void usage_error(const Runtime& runtime, const std::string& message) {
  if (runtime.is_root()) std::cerr << kUsage << std::flush;
  throw Error(ExitCode::kBadConfig, "command line: " + message + " (see the usage above)");
}

CommandLine parse_command_line(const Runtime& runtime, int argc, char** argv) {
  CommandLine cli;
  if (argc < 2) usage_error(runtime, "no command given");
  cli.command = argv[1];
  if (cli.command == "help" || cli.command == "--help" || cli.command == "-h") {
    cli.command = "help";
    return cli;
  }
  if (cli.command != "validate" && cli.command != "train" && cli.command != "export" && cli.command != "plan") {
    usage_error(runtime, "unknown command `" + cli.command + "` (commands: validate, train, export, plan, help)");
  }

  // The command stands in for the program name, so cxxopts sees only its flags.
  cxxopts::Options options("moetrain " + cli.command);
  options.add_options()
      ("config", "the YAML config file", cxxopts::value<std::string>())
      ("set", "override one key: key.path=value (repeatable)", cxxopts::value<std::vector<std::string>>())
      ("h,help", "print the usage");
  if (cli.command == "train") {
    options.add_options()("resume", "auto | none | a checkpoint path", cxxopts::value<std::string>())(
        "init-adapter", "a PEFT adapter directory to start from", cxxopts::value<std::string>());
  } else if (cli.command == "export") {
    options.add_options()("checkpoint", "a checkpoint directory", cxxopts::value<std::string>())(
        "out", "the adapter directory to write", cxxopts::value<std::string>());
  } else if (cli.command == "plan") {
    options.add_options()("world", "plan for a job of this many ranks", cxxopts::value<int>())(
        "json", "print JSON instead of the table")("gpu-gb", "memory of one GPU in GB", cxxopts::value<double>());
  } else {
    options.add_options()("world", "check for a job of this many ranks", cxxopts::value<int>());
  }
  try {
    cxxopts::ParseResult result = options.parse(argc - 1, argv + 1);
    if (result.count("help")) {
      cli.command = "help";
      return cli;
    }
    if (!result.unmatched().empty()) usage_error(runtime, "unexpected argument `" + result.unmatched().front() + "`");
    if (cli.command == "export") {
      if (!result.count("checkpoint") || !result.count("out")) {
        usage_error(runtime, "`moetrain export` needs --checkpoint DIR and --out ADAPTER_DIR");
      }
      cli.checkpoint = result["checkpoint"].as<std::string>();
      cli.out = result["out"].as<std::string>();
      return cli;
    }
    if (!result.count("config")) usage_error(runtime, "`moetrain " + cli.command + "` needs --config FILE");
    cli.config_path = result["config"].as<std::string>();
    if (result.count("set")) cli.overrides = result["set"].as<std::vector<std::string>>();
    if (result.count("resume")) cli.resume = result["resume"].as<std::string>();
    if (result.count("world")) cli.world = result["world"].as<int>();
    if (result.count("init-adapter")) cli.init_adapter = result["init-adapter"].as<std::string>();
    if (cli.command == "plan") {
      if (!result.count("world")) usage_error(runtime, "`moetrain plan` needs --world N");
      cli.json = result.count("json") > 0;
      if (result.count("gpu-gb")) cli.gpu_gb = result["gpu-gb"].as<double>();
      if (!(cli.gpu_gb > 0)) usage_error(runtime, "--gpu-gb must be positive");
    }
  } catch (const cxxopts::exceptions::exception& e) {
    usage_error(runtime, e.what());
  }
  if (cli.resume && cli.resume->empty()) usage_error(runtime, "--resume needs auto, none or a checkpoint path");
  if (cli.world && *cli.world < 1) usage_error(runtime, "--world must be at least 1");
  return cli;
}

// Loads, overrides and checks the config; sets the log level it asks for.
Config load_checked_config(const CommandLine& cli, int world) {
  Config config = load_config(cli.config_path, cli.overrides);
  if (cli.resume) config.checkpoint.resume = *cli.resume;
  if (cli.init_adapter) config.checkpoint.init_adapter = *cli.init_adapter;
  validate_for_world(config, world);
  log::Level level = log::Level::kInfo;
  if (log::parse_level(config.logging.level, &level)) log::set_level(level);
  return config;
}

void print_resolved(const Runtime& runtime, const Config& config) {
  if (!runtime.is_root()) return;
  std::cout << config_to_yaml(config) << std::flush;
}

int run_command(Runtime& runtime, int argc, char** argv) {
  // data-stats takes a dataset, not a config: core/data/data_stats.h parses its arguments.
  if (argc >= 2 && std::string(argv[1]) == "data-stats") return data_stats_command(argc - 1, argv + 1);
  CommandLine cli = parse_command_line(runtime, argc, argv);
  if (cli.command == "help") {
    if (runtime.is_root()) std::cout << kUsage;
    return 0;
  }
  if (cli.command == "export") {
    if (runtime.is_root()) export_checkpoint_adapter(cli.checkpoint, cli.out);
    return 0;
  }
  const int world = cli.world.value_or(runtime.world());
  Config config = load_checked_config(cli, world);
  if (cli.command == "plan") {
    PlanOptions options;
    options.world = world;
    options.gpu_bytes = cli.gpu_gb * 1e9;
    MemoryPlan plan = make_memory_plan(config, options);
    if (runtime.is_root()) std::cout << (cli.json ? plan_to_json(plan) + "\n" : format_plan(plan)) << std::flush;
    return 0;
  }
  print_resolved(runtime, config);
  if (cli.command == "validate") {
    log::info("config " + cli.config_path + " is valid for a job of " + std::to_string(world) +
              (world == 1 ? " rank" : " ranks"));
    return 0;
  }
  return run_training(runtime, config);
}

}  // namespace
}  // namespace moetrain

int main(int argc, char** argv) { return moetrain::run_main(argc, argv, moetrain::run_command); }
