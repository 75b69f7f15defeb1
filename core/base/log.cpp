#include "core/base/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <memory>
#include <string>

namespace moetrain::log {
namespace {

struct State {
  int rank = 0;
  int world = 1;
  Level level = Level::kInfo;
  std::shared_ptr<spdlog::logger> logger;
};

State& state() {
  static State s;
  return s;
}

spdlog::level::level_enum to_spdlog(Level level) {
  switch (level) {
    case Level::kDebug: return spdlog::level::debug;
    case Level::kInfo: return spdlog::level::info;
    case Level::kWarn: return spdlog::level::warn;
    case Level::kError: return spdlog::level::err;
    case Level::kOff: return spdlog::level::off;
  }
  return spdlog::level::info;
}

void configure() {
  State& s = state();
  if (!s.logger) s.logger = spdlog::stderr_color_mt("moetrain");
  std::string pattern = "[%H:%M:%S.%e] [%^%l%$] ";
  if (s.world > 1) pattern += "[rank " + std::to_string(s.rank) + "/" + std::to_string(s.world) + "] ";
  s.logger->set_pattern(pattern + "%v");
  // Non-zero ranks only speak up for warnings and errors.
  Level effective = s.rank == 0 ? s.level : (s.level > Level::kWarn ? s.level : Level::kWarn);
  s.logger->set_level(to_spdlog(effective));
  s.logger->flush_on(spdlog::level::warn);
}

spdlog::logger& logger() {
  State& s = state();
  if (!s.logger) configure();
  return *s.logger;
}

}  // namespace

void set_rank(int rank, int world) {
  state().rank = rank;
  state().world = world;
  configure();
}

void set_level(Level level) {
  state().level = level;
  configure();
}

bool parse_level(std::string_view text, Level* level) {
  if (text == "debug") *level = Level::kDebug;
  else if (text == "info") *level = Level::kInfo;
  else if (text == "warn") *level = Level::kWarn;
  else if (text == "error") *level = Level::kError;
  else if (text == "off") *level = Level::kOff;
  else return false;
  return true;
}

void debug(std::string_view message) { logger().debug("{}", message); }
void info(std::string_view message) { logger().info("{}", message); }
void warn(std::string_view message) { logger().warn("{}", message); }
void error(std::string_view message) { logger().error("{}", message); }

}  // namespace moetrain::log
