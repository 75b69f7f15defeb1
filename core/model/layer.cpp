#include "core/model/layer.h"

#include "core/model/lora_linear.h"

namespace moetrain {

void LayerBlock::collect_parameters(std::vector<Parameter*>& out) {
  for (LoraLinear* p : projections()) p->collect_parameters(out);
}

}  // namespace moetrain
