// TimingBackend on the CPU backend: ops forwarded unchanged (results equal bit for bit to the
// same ops run directly, and a whole model's training step through it equal to one without it),
// one row per op name with the right call counts, allocations through its allocator timed,
// nothing recorded while disabled or for a call that throws, and the table.
#include <string>
#include <vector>

#include "catch.h"
#include "core/model/model.h"
#include "kernels/ops.h"
#include "kernels/timing_backend.h"
#include "tests/support/gradcheck.h"
#include "tests/support/tiny_model.h"

using namespace moetrain;
using namespace moetrain::kernels;
using namespace moetrain::testing;

namespace {

bool same_bytes(const TensorView& a, const TensorView& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data, b.data, a.nbytes()) == 0;
}

const OpTime* find_op(const std::vector<OpTime>& times, const std::string& op) {
  for (const OpTime& t : times)
    if (t.op == op) return &t;
  return nullptr;
}

// The ops of the test, run on `backend`; every output is freshly written (no accumulation).
struct Outputs {
  Tensor c{Shape{4, 6}, DType::kF32};
  Tensor c_transposed{Shape{4, 6}, DType::kF32};
  Tensor grouped{Shape{5, 6}, DType::kF32};
  Tensor y{Shape{4, 3}, DType::kF32};
  Tensor rstd{Shape{4}, DType::kF32};
  Tensor copied{Shape{4, 3}, DType::kF32};
  double sum_squares = 0;
};

void run_ops(Backend& backend, Outputs& out) {
  Tensor a = random_tensor({4, 3}, DType::kF32, 1);
  Tensor b = random_tensor({3, 6}, DType::kF32, 2);
  Tensor b_transposed = random_tensor({6, 3}, DType::kF32, 3);
  Tensor rows = random_tensor({5, 3}, DType::kF32, 4);
  Tensor experts = random_tensor({2, 6, 3}, DType::kF32, 5);  // [G, n, k], as HF stores them
  Tensor offsets = make_i32({0, 2, 5});
  Tensor weight = random_tensor({3}, DType::kF32, 6);
  backend.gemm({out.c, a, b});
  backend.gemm({out.c_transposed, a, b_transposed, false, true, 0.5, 0.0});
  GroupedGemmArgs grouped;
  grouped.c = out.grouped;
  grouped.a = rows;
  grouped.b = experts;
  grouped.group_offsets = offsets;
  backend.grouped_gemm(grouped);
  backend.rmsnorm_forward({out.y, out.rstd, a, weight, 1e-6});
  backend.copy(out.copied, out.y);
  out.sum_squares = backend.sum_squares(out.c);
}

}  // namespace

TEST_CASE("TimingBackend forwards every op unchanged and counts the calls per op", "[timing]") {
  auto cpu = make_cpu_backend();
  TimingBackend timing(*cpu);
  CHECK(timing.device() == cpu->device());
  CHECK(std::string(timing.name()) == cpu->name());

  Outputs direct, timed;
  run_ops(*cpu, direct);
  run_ops(timing, timed);
  CHECK(same_bytes(timed.c, direct.c));
  CHECK(same_bytes(timed.c_transposed, direct.c_transposed));
  CHECK(same_bytes(timed.grouped, direct.grouped));
  CHECK(same_bytes(timed.y, direct.y));
  CHECK(same_bytes(timed.rstd, direct.rstd));
  CHECK(same_bytes(timed.copied, direct.copied));
  CHECK(timed.sum_squares == direct.sum_squares);
  CHECK(timed.sum_squares > 0);

  const std::vector<OpTime> times = timing.times();
  REQUIRE(times.size() == 5);
  const std::vector<std::pair<std::string, int64_t>> expected_calls = {
      {"gemm", 2}, {"grouped_gemm (m-grouped)", 1}, {"rmsnorm_forward", 1}, {"copy", 1}, {"sum_squares", 1}};
  for (const auto& [op, calls] : expected_calls) {
    const OpTime* t = find_op(times, op);
    INFO(op);
    REQUIRE(t != nullptr);
    CHECK(t->calls == calls);
    CHECK(t->seconds >= 0);
  }
  for (size_t i = 1; i < times.size(); ++i) CHECK(times[i - 1].seconds >= times[i].seconds);

  const std::string table = format_op_times(times);
  for (const auto& [op, calls] : expected_calls) {
    INFO(table);
    CHECK(table.find(op) != std::string::npos);
  }
  CHECK(table.find("total") != std::string::npos);

  timing.reset();
  CHECK(timing.times().empty());
}

TEST_CASE("TimingBackend times allocations through its allocator", "[timing]") {
  auto cpu = make_cpu_backend();
  TimingBackend timing(*cpu);
  CHECK(timing.allocator().device() == cpu->allocator().device());
  {
    Tensor t({16}, DType::kF32, timing.allocator());
    timing.fill(t, 2.0);
    CHECK(t.ptr<float>()[15] == 2.0f);
  }
  const std::vector<OpTime> times = timing.times();
  REQUIRE(find_op(times, "allocate") != nullptr);
  REQUIRE(find_op(times, "deallocate") != nullptr);
  CHECK(find_op(times, "allocate")->calls == 1);
  CHECK(find_op(times, "deallocate")->calls == 1);
  CHECK(find_op(times, "fill")->calls == 1);
}

TEST_CASE("TimingBackend records nothing while disabled or for a call that throws", "[timing]") {
  auto cpu = make_cpu_backend();
  TimingBackend timing(*cpu);
  Tensor x = random_tensor({8}, DType::kF32, 1);
  Tensor y({8}, DType::kF32);

  timing.disable();
  CHECK_FALSE(timing.enabled());
  timing.copy(y, x);  // still forwarded
  CHECK(same_bytes(y, x));
  CHECK(timing.times().empty());

  timing.enable();
  Tensor wrong({3, 3}, DType::kF32);
  const GemmArgs mismatched{wrong, x.view().reshaped({2, 4}), x.view().reshaped({2, 4})};  // k: 4 vs 2
  CHECK_THROWS(timing.gemm(mismatched));
  CHECK(timing.times().empty());
  timing.axpby(y, x, 1.0, 1.0);
  REQUIRE(timing.times().size() == 1);
  CHECK(timing.times()[0].op == "axpby");
}

TEST_CASE("a model's training step through TimingBackend equals one without it", "[timing]") {
  Config config = tiny_model_config(true);
  ModelSpec spec = resolve_model_spec(config);
  ModelOptions options;
  options.lora = LoraSettings{4, 8.0, false};
  options.lora_targets = all_lora_targets(true);
  const Batch batch = tiny_batch(config.model.vocab_size, 3);
  const double grad_scale = 1.0 / static_cast<double>(batch.num_targets());

  auto cpu = make_cpu_backend();
  TimingBackend timing(*cpu);  // before the model: it allocates through the decorator
  Model direct(spec, *cpu, options);
  Model timed(spec, timing, options);
  direct.init_random_weights();
  timed.init_random_weights();
  timing.reset();
  const StepResult expected = direct.forward_backward(batch, grad_scale);
  const StepResult got = timed.forward_backward(batch, grad_scale);
  CHECK(got.loss_sum == expected.loss_sum);
  CHECK(got.targets == expected.targets);
  CHECK(got.max_expert_load == expected.max_expert_load);
  const std::vector<Parameter*> direct_params = direct.parameters();
  const std::vector<Parameter*> timed_params = timed.parameters();
  REQUIRE(direct_params.size() == timed_params.size());
  for (size_t i = 0; i < direct_params.size(); ++i) CHECK(same_bytes(timed_params[i]->grad, direct_params[i]->grad));

  // The step's ops all show up: attention, the experts' grouped GEMMs both ways, the loss.
  const std::vector<OpTime> times = timing.times();
  for (const char* op : {"gemm", "attention_forward", "attention_backward", "grouped_gemm (m-grouped)",
                         "grouped_gemm (k-grouped)", "router_forward", "cross_entropy", "allocate"}) {
    INFO(op << "\n" << format_op_times(times));
    const OpTime* t = find_op(times, op);
    REQUIRE(t != nullptr);
    CHECK(t->calls > 0);
  }
}

TEST_CASE("format_op_times divides by steps and shows the time outside ops", "[timing]") {
  // 2 steps: gemm 4 calls, 4 ms in all; 10 ms of wall time -> per step 2 ms of gemm, 3 outside.
  const std::string table = format_op_times({{"gemm", 4, 0.004}}, 2, 0.010);
  INFO(table);
  CHECK(table.find("gemm                                  2        2.000       1.0000    40.0%") != std::string::npos);
  CHECK(table.find("(outside ops)                         -        3.000            -    60.0%") != std::string::npos);
  CHECK(table.find("total                                 2        5.000            -   100.0%") != std::string::npos);
  // Without a wall time there is no outside row, and shares are of the ops' sum.
  const std::string ops_only = format_op_times({{"gemm", 3, 0.003}, {"rope", 1, 0.001}});
  CHECK(ops_only.find("(outside ops)") == std::string::npos);
  CHECK(ops_only.find("75.0%") != std::string::npos);
  CHECK(ops_only.find("25.0%") != std::string::npos);
}
