// Aux-loss-free balancing (DeepSeek-V3, model.moe.bias_update_rate): after each optimizer step
// every MoE layer's selection bias moves toward the experts that got fewer rows than the mean.
#include <fmt/format.h>

#include "core/base/error.h"
#include "core/model/model.h"
#include "core/model/moe.h"
#include "core/model/parameter_group.h"

namespace moetrain {

void Model::update_expert_bias(const std::vector<std::vector<int64_t>>& step_rows) {
  const double rate = spec_.config.moe.bias_update_rate;
  if (rate <= 0.0) return;
  const std::vector<MoeFfn*> layers = moe_layers();
  MOETRAIN_ASSERT(step_rows.size() == layers.size(),
                  fmt::format("expert rows for {} MoE layers, the model has {}", step_rows.size(), layers.size()));
  // Every layer's rows in one all-reduce: the counts are integers, exact in F64 (below 2^53), so
  // every rank gets the same sums whatever the order.
  std::vector<double> rows;
  for (const std::vector<int64_t>& layer : step_rows) rows.insert(rows.end(), layer.begin(), layer.end());
  sum_over(options_.parallel ? options_.parallel->data : nullptr, backend_, rows);
  size_t first = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    const size_t n = step_rows[i].size();
    layers[i]->update_score_bias(backend_, std::vector<double>(rows.begin() + first, rows.begin() + first + n), rate);
    first += n;
  }
}

std::vector<TrainedBuffer> Model::trained_buffers() {
  std::vector<TrainedBuffer> out;
  if (spec_.config.moe.bias_update_rate <= 0.0) return out;
  for (MoeFfn* moe : moe_layers()) out.push_back({moe->score_bias_name(), &moe->score_bias});
  return out;
}

}  // namespace moetrain
