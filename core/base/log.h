// Rank-aware logging. spdlog/fmt stay inside log.cpp (they do not compile reliably under nvcc);
// callers pass finished strings (fmt::format in .cpp files is fine).
//
// Rank 0 logs at the configured level; other ranks log warnings and errors only, every line
// prefixed with "[rank R/W]" so interleaved output from many ranks stays readable.
#pragma once

#include <string>
#include <string_view>

namespace moetrain::log {

enum class Level { kDebug, kInfo, kWarn, kError, kOff };

// Call once the rank is known (parallel/runtime does). Before that, logs as rank 0 of 1.
void set_rank(int rank, int world);
void set_level(Level level);
// Parses "debug" | "info" | "warn" | "error" | "off"; returns false on anything else.
bool parse_level(std::string_view text, Level* level);

void debug(std::string_view message);
void info(std::string_view message);
void warn(std::string_view message);
void error(std::string_view message);

}  // namespace moetrain::log
