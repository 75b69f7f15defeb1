#include "core/model/peft_adapter.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/base/host_convert.h"
#include "core/io/safetensors.h"
#include "core/model/hf_names.h"

namespace moetrain {
namespace {

using Json = nlohmann::json;

constexpr const char* kPeftPrefix = "base_model.model.";

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Reads adapter keys as F64, remembering which were used.
class AdapterFile {
 public:
  explicit AdapterFile(const std::string& path) : file_(path), path_(path) {}

  bool has(const std::string& key) const { return file_.has(key); }

  Tensor read(const std::string& key, const Shape& expected) {
    MOETRAIN_CHECK(file_.has(key), ExitCode::kBadCheckpoint,
                   fmt::format("{}: adapter tensor \"{}\" is missing (the model has a LoRA adapter there: "
                               "lora.targets or the adapter does not match)",
                               path_, key));
    const Shape& shape = file_.info(key).shape;
    MOETRAIN_CHECK(shape == expected, ExitCode::kBadCheckpoint,
                   fmt::format("{}: adapter tensor \"{}\" has shape {} but the model expects {} (check lora.rank "
                               "and the model dimensions)",
                               path_, key, shape.str(), expected.str()));
    used_.insert(key);
    return file_.read_as(key, DType::kF64);
  }

  void check_all_used() const {
    for (const std::string& key : file_.names()) {
      MOETRAIN_CHECK(used_.count(key), ExitCode::kBadCheckpoint,
                     fmt::format("{}: adapter tensor \"{}\" matches no LoRA adapter of the model; add its module "
                                 "to lora.targets",
                                 path_, key));
    }
  }

 private:
  SafetensorsFile file_;
  std::string path_;
  std::set<std::string> used_;
};

void store(kernels::Backend& backend, Tensor& dst, const TensorView& host_f64) {
  Tensor staged(dst.shape(), dst.dtype());
  convert_host(staged, host_f64);
  backend.copy(dst, staged);
}

// "model.layers.1.mlp.experts.gate_proj.lora_A.weight" -> {module "model.layers.1.mlp.experts",
// projection "gate_proj", factor "A"}.
struct StackedName {
  std::string module, projection;
  bool is_a = true;
};
StackedName split_stacked(const std::string& name) {
  StackedName s;
  s.is_a = name.find(".lora_A.") != std::string::npos;
  std::string head = name.substr(0, name.rfind(".lora_"));
  s.projection = head.substr(head.rfind('.') + 1);
  s.module = head.substr(0, head.rfind('.'));
  return s;
}

// Where one adapter sits in a fused 3-D PEFT factor of rank `fused_rank` (r, or 2r when gate and
// up share a block-diagonal gate_up adapter): ranks [rank_offset, rank_offset + rank) of expert
// e; for B, rows [row_begin, row_begin + rows).
struct FusedSlice {
  int64_t experts, fused_rank, rank, rank_offset, row_begin, rows;
};

// Expert e's factor: A rows e r' + offset + k; B columns (offset + k) E + e.
void fused_factor(double* dst, const Tensor& fused, bool is_a, int64_t expert, const FusedSlice& s) {
  const double* src = fused.ptr<double>();
  if (is_a) {
    int64_t in = fused.size(1);
    std::memcpy(dst, src + (expert * s.fused_rank + s.rank_offset) * in, static_cast<size_t>(s.rank * in) * sizeof(double));
    return;
  }
  int64_t cols = fused.size(1);  // fused_rank * experts
  for (int64_t o = 0; o < s.rows; ++o)
    for (int64_t k = 0; k < s.rank; ++k)
      dst[o * s.rank + k] = src[(s.row_begin + o) * cols + (s.rank_offset + k) * s.experts + expert];
}

// A doubled-rank gate_up B must be block diagonal: the gate rows carry nothing in the up ranks and
// the other way round, or the adapter is not two separate ones.
bool off_diagonal_zero(const Tensor& fused_b, int64_t experts, int64_t rank, int64_t width) {
  const int64_t cols = fused_b.size(1);
  for (int64_t o = 0; o < 2 * width; ++o) {
    const int64_t other = o < width ? rank : 0;  // gate rows must be zero in the up ranks, and vice versa
    for (int64_t k = 0; k < rank; ++k)
      for (int64_t e = 0; e < experts; ++e)
        if (fused_b.ptr<double>()[o * cols + (other + k) * experts + e] != 0.0) return false;
  }
  return true;
}

}  // namespace

std::string peft_key(const std::string& parameter_name) { return kPeftPrefix + parameter_name; }

PeftAdapterConfig read_peft_adapter_config(const std::string& dir) {
  std::string path = dir + "/adapter_config.json";
  std::ifstream in(path);
  MOETRAIN_CHECK(in.good(), ExitCode::kBadCheckpoint, "cannot read " + path + " (is " + dir + " a PEFT adapter?)");
  std::stringstream text;
  text << in.rdbuf();
  Json json;
  try {
    json = Json::parse(text.str());
  } catch (const Json::exception& e) {
    throw Error(ExitCode::kBadCheckpoint, fmt::format("{}: not valid JSON ({})", path, e.what()));
  }
  PeftAdapterConfig config;
  try {
    MOETRAIN_CHECK(json.value("peft_type", "LORA") == "LORA", ExitCode::kBadCheckpoint,
                   path + ": peft_type is not LORA");
    config.rank = json.at("r").get<int64_t>();
    config.alpha = json.at("lora_alpha").get<double>();
    config.rslora = json.value("use_rslora", false);
    // The one supported pattern: gate_up's adapter at twice the rank and alpha (same scale).
    const Json doubled_rank = {{".*\\.gate_up_proj", 2 * config.rank}};
    const Json doubled_alpha = {{".*\\.gate_up_proj", 2 * config.alpha}};
    auto pattern = [&](const char* key) { return json.contains(key) && !json[key].is_null() ? json[key] : Json::object(); };
    Json ranks = pattern("rank_pattern"), alphas = pattern("alpha_pattern");
    config.gate_up_rank_doubled = !ranks.empty();
    MOETRAIN_CHECK((ranks.empty() && alphas.empty()) || (ranks == doubled_rank && alphas == doubled_alpha),
                   ExitCode::kBadCheckpoint,
                   fmt::format("{}: rank_pattern {} / alpha_pattern {} set per-module ranks; moetrain reads only "
                               "{} / {} (a gate_up adapter holding separate gate and up adapters)",
                               path, ranks.dump(), alphas.dump(), doubled_rank.dump(), doubled_alpha.dump()));
    if (json.contains("target_parameters") && json["target_parameters"].is_array()) {
      config.target_parameters = json["target_parameters"].get<std::vector<std::string>>();
    }
  } catch (const Json::exception& e) {
    throw Error(ExitCode::kBadCheckpoint, fmt::format("{}: {}", path, e.what()));
  }
  return config;
}

void load_peft_adapter(Model& model, const std::string& dir) {
  PeftAdapterConfig config = read_peft_adapter_config(dir);
  const LoraSettings& lora = model.options().lora;
  MOETRAIN_CHECK(config.rank == lora.rank && config.alpha == lora.alpha && config.rslora == lora.rslora,
                 ExitCode::kBadConfig,
                 fmt::format("{}: the adapter has r {}, lora_alpha {}, use_rslora {} but the config says lora.rank "
                             "{}, lora.alpha {}, lora.rslora {}: set the config to the adapter's values",
                             dir, config.rank, config.alpha, config.rslora, lora.rank, lora.alpha, lora.rslora));
  AdapterFile file(dir + "/adapter_model.safetensors");
  kernels::Backend& backend = model.backend();
  bool fused_gate_up = false, fused_down = false;
  for (const std::string& target : config.target_parameters) {
    fused_gate_up |= ends_with(target, "gate_up_proj");
    fused_down |= ends_with(target, "down_proj") && target.find("experts") != std::string::npos;
  }

  for (Parameter* p : model.parameters()) {
    const Shape& shape = p->value.shape();
    if (shape.ndim() == 2) {
      // Kimi-Linear adapters made on transformers 5 name some KDA modules its way (hf_names.h).
      std::string key = peft_key(p->name);
      const std::string transformers_key = peft_key(transformers_module_name(p->name));
      if (!file.has(key) && file.has(transformers_key)) key = transformers_key;
      store(backend, p->value, file.read(key, shape));
      continue;
    }
    // A stacked routed-expert adapter [E, r, in] or [E, out, r].
    StackedName name = split_stacked(p->name);
    const int64_t experts = shape[0];
    const Shape per_expert{shape[1], shape[2]};
    const int64_t rank = name.is_a ? shape[1] : shape[2];
    MOETRAIN_CHECK(rank == config.rank, ExitCode::kBadCheckpoint,
                   fmt::format("{}: adapter rank {} differs from lora.rank {}", dir, config.rank, rank));
    Tensor host(shape, DType::kF64);
    const int64_t block = per_expert.numel();
    std::string factor = name.is_a ? "lora_A.weight" : "lora_B.weight";
    std::string first_key = peft_key(name.module + ".0." + name.projection + "." + factor);
    if (file.has(first_key)) {
      for (int64_t e = 0; e < experts; ++e) {
        Tensor one = file.read(peft_key(name.module + "." + std::to_string(e) + "." + name.projection + "." + factor),
                               per_expert);
        std::memcpy(host.ptr<double>() + e * block, one.data(), one.nbytes());
      }
    } else {
      bool down = name.projection == "down_proj";
      MOETRAIN_CHECK(down ? fused_down : fused_gate_up, ExitCode::kBadCheckpoint,
                     fmt::format("{}: no adapter for {}.{} (neither per-expert keys like \"{}\" nor a fused "
                                 "target_parameters entry)",
                                 dir, name.module, name.projection, first_key));
      // gate_up_proj is the inner wrapper (base_layer) when down_proj is targeted too.
      std::string key = peft_key(name.module + (!down && fused_down ? ".base_layer." : ".") + factor);
      const bool doubled = !down && config.gate_up_rank_doubled;
      const bool up = name.projection == "up_proj";
      FusedSlice slice{experts, doubled ? 2 * rank : rank, rank, doubled && up ? rank : 0,
                       up ? shape[1] : 0, name.is_a ? 0 : shape[1]};
      int64_t in_or_out = name.is_a ? shape[2] : (down ? shape[1] : 2 * shape[1]);
      Shape fused_shape = name.is_a ? Shape{experts * slice.fused_rank, in_or_out}
                                    : Shape{in_or_out, slice.fused_rank * experts};
      Tensor fused = file.read(key, fused_shape);
      MOETRAIN_CHECK(!doubled || name.is_a || off_diagonal_zero(fused, experts, rank, shape[1]),
                     ExitCode::kBadCheckpoint,
                     fmt::format("{}: \"{}\" is a rank-{} gate_up adapter whose B is not block diagonal, so it "
                                 "is not a gate adapter and an up adapter side by side; moetrain cannot split it",
                                 dir, key, slice.fused_rank));
      // Gate is rows [0, F) of gate_up, up rows [F, 2F); without the doubled rank A is shared.
      for (int64_t e = 0; e < experts; ++e) fused_factor(host.ptr<double>() + e * block, fused, name.is_a, e, slice);
    }
    store(backend, p->value, host);
  }
  file.check_all_used();
}

}  // namespace moetrain
