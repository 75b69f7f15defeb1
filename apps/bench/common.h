// What every moetrain-bench subcommand shares: the H200 ceilings its rows are stated against,
// the op timer, random device inputs, and the table the `ops` rows print as. The subcommands:
// bench.h; the dispatch: main.cpp.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kernels/ops.h"

namespace moetrain::bench {

using kernels::Backend;

// Ceilings measured on one H200 (docs/PERF.md).
constexpr double kMatrixCeilingTflops = 771.0;
constexpr double kMemoryCeilingTbps = 4.2;
constexpr double kDatasheetBf16Tflops = 989.0;  // dense BF16, for MFU

struct Row {
  std::string name;
  double ms = 0;
  double tflops = 0;  // 0: not a matrix op
  double tbps = 0;    // 0: not a memory op
  std::string versus;  // the target or baseline, and our ratio to it
};

// `ops`: how long each timing runs its op untimed first (--heat-up-ms; median_ms explains why).
extern double heat_up_ms;

// Median of `reps` runs after `warmup` runs and, past those, more runs until heat_up_ms have
// passed, each run timed by CUDA events on the backend's stream.
double median_ms(Backend& backend, const std::function<void()>& op, int reps, int warmup = 3);

// A device tensor of uniform values in +-[0.1, 1] x scale (random signs).
Tensor random_device(Backend& backend, Shape shape, DType dtype, uint64_t seed, double scale = 1.0);

Tensor int_device(Backend& backend, const std::vector<int32_t>& values);

// A [rows, d1, d2] bf16 tensor that repeats one random block of block_rows rows.
Tensor tiled_device(Backend& be, int64_t rows, int64_t d1, int64_t d2, int64_t block_rows, uint64_t seed);

// "1.23x what": value / target.
std::string ratio(double value, double target, const char* what);

// The `ops` table.
void print_rows(const std::vector<Row>& rows);

}  // namespace moetrain::bench
