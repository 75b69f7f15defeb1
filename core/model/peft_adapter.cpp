#include "core/model/peft_adapter.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <utility>

#include "core/base/host_convert.h"
#include "core/config/lora_patterns.h"
#include "core/io/safetensors.h"
#include "core/model/hf_names.h"
#include "core/model/swiglu_experts.h"

namespace moetrain {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Reads adapter keys as F64, remembering which were used. A key stored under a released
// checkpoint's names answers to ours too (our_adapter_key).
class AdapterFile {
 public:
  explicit AdapterFile(const std::string& path) : file_(path), path_(path) {
    for (const std::string& stored : file_.names()) {
      const std::string ours = our_adapter_key(stored);
      if (ours != stored && !file_.has(ours)) stored_name_.emplace(ours, stored);
    }
  }

  bool has(const std::string& key) const { return file_.has(key) || stored_name_.count(key) != 0; }
  const std::string& path() const { return path_; }

  // The stored shape of `name`.
  const Shape& shape(const std::string& name) const { return file_.info(stored(name)).shape; }

  Tensor read(const std::string& name, const Shape& expected) {
    const std::string& key = stored(name);
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
  // The file's key for `name` (which must be there).
  const std::string& stored(const std::string& name) const {
    auto alias = stored_name_.find(name);
    const std::string& key = alias == stored_name_.end() ? name : alias->second;
    MOETRAIN_CHECK(file_.has(key), ExitCode::kBadCheckpoint,
                   fmt::format("{}: adapter tensor \"{}\" is missing (the model has a LoRA adapter there: "
                               "lora.targets or the adapter does not match)",
                               path_, key));
    return key;
  }

  SafetensorsFile file_;
  std::string path_;
  std::set<std::string> used_;
  std::map<std::string, std::string> stored_name_;  // our key -> the file's, where they differ
};

void store(kernels::Backend& backend, Tensor& dst, const TensorView& host_f64) {
  Tensor staged(dst.shape(), dst.dtype());
  convert_host(staged, host_f64);
  backend.copy(dst, staged);
}

// The routed experts' place: every stack read from the file covers all `total` experts (so every
// key is used and checked on every rank); this rank's parameters hold [first, first + count).
struct ExpertRows {
  int64_t total = 0, first = 0;
};

// Host F64 stacks [E, d0, d1] of every expert.
Tensor read_per_expert(AdapterFile& file, const std::string& module, const std::string& what, const Shape& per_expert,
                       int64_t experts) {
  Tensor out({experts, per_expert[0], per_expert[1]}, DType::kF64);
  for (int64_t e = 0; e < experts; ++e) {
    Tensor one = file.read(peft_key(module + "." + std::to_string(e) + "." + what), per_expert);
    std::memcpy(out.ptr<double>() + e * per_expert.numel(), one.data(), one.nbytes());
  }
  return out;
}

// One factor of PEFT's 3-D adapter, A [E R, in] or B [out, R E] (peft_format.h), as the stack
// A [E, R, in] or B [E, out, R].
Tensor read_fused(AdapterFile& file, const std::string& key, bool is_a, int64_t rank, int64_t in_or_out,
                  int64_t experts) {
  if (is_a) return stack_from_peft_a(file.read(key, Shape{experts * rank, in_or_out}).view(), experts);
  return stack_from_peft_b(file.read(key, Shape{in_or_out, rank * experts}).view(), experts);
}

// A gate_up adapter as one adapter on [gate | up] per expert: A [E, R, D], B [E, 2F, R], its
// scale, the rank of its gate block when it was read from separate gate and up adapters (0 for
// PEFT's fused adapter), and the file key of its B (for messages).
struct GateUp {
  Tensor a, b;
  double scale = 1.0;
  int64_t gate_rank = 0;
  std::string key;
  int64_t rank() const { return a.size(1); }
};

// Separate gate and up adapters (ranks rg, ru) side by side: A [A_gate; A_up], B block diagonal,
// at the gate's scale (the up block times up_scale / scale, 1 when they agree).
GateUp side_by_side(const Tensor& gate_a, const Tensor& gate_b, const Tensor& up_a, const Tensor& up_b, double scale,
                    double up_scale, std::string key) {
  ExpertStacks stacks =
      gate_up_side_by_side(gate_a.view(), gate_b.view(), up_a.view(), up_b.view(), 1.0, up_scale / scale);
  return GateUp{std::move(stacks.a), std::move(stacks.b), scale, gate_a.size(1), std::move(key)};
}

// Whether B [E, 2F, R] is block diagonal at `split`: gate rows zero in the up ranks [split, R) and
// up rows zero in the gate ranks [0, split).
bool block_diagonal(const Tensor& b, int64_t split) {
  const int64_t experts = b.size(0), rows = b.size(1), f = rows / 2, big_r = b.size(2);
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t o = 0; o < rows; ++o) {
      const int64_t begin = o < f ? split : 0, end = o < f ? big_r : split;
      for (int64_t k = begin; k < end; ++k)
        if (b.ptr<double>()[(e * rows + o) * big_r + k] != 0.0) return false;
    }
  return true;
}

// Expert e's A rows [k0, k0 + r) and B rows [o0, o0 + f) x columns [k0, k0 + r), B times
// `factor`: one separate adapter's stacks out of a gate_up one.
std::pair<Tensor, Tensor> take_part(const GateUp& g, int64_t k0, int64_t o0, int64_t r, int64_t f, double factor) {
  const int64_t experts = g.a.size(0), in = g.a.size(2), big_r = g.rank(), rows = g.b.size(1);
  Tensor a({experts, r, in}, DType::kF64), b({experts, f, r}, DType::kF64);
  for (int64_t e = 0; e < experts; ++e) {
    std::memcpy(a.ptr<double>() + e * r * in, g.a.ptr<double>() + (e * big_r + k0) * in,
                static_cast<size_t>(r * in) * sizeof(double));
    for (int64_t o = 0; o < f; ++o)
      for (int64_t k = 0; k < r; ++k)
        b.ptr<double>()[(e * f + o) * r + k] = factor * g.b.ptr<double>()[(e * rows + o0 + o) * big_r + k0 + k];
  }
  return {std::move(a), std::move(b)};
}

// Each module's rank and alpha on both sides: the file's (adapter_config.json's r and lora_alpha
// with its patterns, looked up as PEFT does against the names PEFT matched when it made the file)
// and the model's (lora.rank / alpha with lora.rank_pattern / alpha_pattern, as attach_lora does).
class Ranks {
 public:
  Ranks(const PeftAdapterConfig& config, const Model& model, const std::string& dir)
      : file_(config.rank, config.alpha, config.rank_pattern, config.alpha_pattern, "adapter_config.json"),
        model_(model.options().lora.rank, model.options().lora.alpha, model.options().lora_rank_pattern,
               model.options().lora_alpha_pattern),
        rslora_(model.options().lora.rslora),
        targets_(config.target_parameters),
        dir_(dir) {}

  // PEFT's name for a 2-D module: `<module>.weight` when target_parameters reached its weight (an
  // entry equal to it or ending it after a dot, as PEFT matches them), else the module.
  std::string current_key(const std::string& module) const {
    const std::string weight = module + ".weight";
    for (const std::string& target : targets_)
      if (weight == target || ends_with(weight, "." + target)) return weight;
    return module;
  }

  ModuleLora file(const std::string& current_key) { return file_.module(current_key); }
  ModuleLora model(const std::string& module) { return model_.module(module); }
  ModuleLora model_fused(const std::string& experts) { return model_.fused_gate_up(experts); }
  double scale(const ModuleLora& m) const { return LoraSettings{m.rank, m.alpha, rslora_}.scale(); }

  // The file's own rank for `current_key` must be its tensor's (`key` holds `stored`).
  void check_stored(const std::string& key, int64_t stored, const std::string& current_key, const ModuleLora& f) const {
    MOETRAIN_CHECK(stored == f.rank, ExitCode::kBadCheckpoint,
                   fmt::format("{}: adapter tensor \"{}\" has rank {}, but adapter_config.json gives {} rank {} ({}): "
                               "the adapter's files disagree",
                               dir_, key, stored, current_key, f.rank, file_source(f, true)));
  }

  // A module read as it is: the file's rank and alpha must be the model's.
  void check_equal(const std::string& current_key, const ModuleLora& f, const std::string& module,
                   const ModuleLora& m) const {
    MOETRAIN_CHECK(f.rank == m.rank, ExitCode::kBadConfig,
                   fmt::format("{}: the adapter gives {} rank {} ({}) but the config gives {} rank {} ({}): set "
                               "lora.rank_pattern to the adapter's ranks",
                               dir_, current_key, f.rank, file_source(f, true), module, m.rank, model_source(m, true)));
    MOETRAIN_CHECK(f.alpha == m.alpha, ExitCode::kBadConfig,
                   fmt::format("{}: the adapter gives {} lora_alpha {} ({}) but the config gives {} alpha {} ({}): set "
                               "lora.alpha_pattern to the adapter's alphas",
                               dir_, current_key, f.alpha, file_source(f, false), module, m.alpha,
                               model_source(m, false)));
  }

  std::string model_source(const ModuleLora& m, bool rank) const {
    const int key = rank ? m.rank_key : m.alpha_key;
    if (key < 0) return rank ? "lora.rank" : "lora.alpha";
    return fmt::format("lora.{}[\"{}\"]", rank ? "rank_pattern" : "alpha_pattern",
                       rank ? model_.rank_key(key) : model_.alpha_key(key));
  }

 private:
  std::string file_source(const ModuleLora& f, bool rank) const {
    const int key = rank ? f.rank_key : f.alpha_key;
    if (key < 0) return rank ? "r" : "lora_alpha";
    return fmt::format("{} \"{}\"", rank ? "rank_pattern" : "alpha_pattern",
                       rank ? file_.rank_key(key) : file_.alpha_key(key));
  }

  LoraRanks file_, model_;
  bool rslora_;
  std::vector<std::string> targets_;
  std::string dir_;
};

// One routed-experts module's adapters (3-D, or a shared 2-D A), by "projection.factor", e.g.
// "gate_up_proj.lora_B.weight".
using ExpertParams = std::map<std::string, Parameter*>;

class ExpertLoader {
 public:
  ExpertLoader(AdapterFile& file, const PeftAdapterConfig& config, const std::string& dir, Ranks& ranks,
               kernels::Backend& backend, ExpertRows rows)
      : file_(file), dir_(dir), ranks_(ranks), backend_(backend), rows_(rows) {
    for (const std::string& target : config.target_parameters) {
      fused_gate_up_ |= ends_with(target, "gate_up_proj");
      fused_down_ |= ends_with(target, "down_proj") && target.find("experts") != std::string::npos;
    }
  }

  void load(const std::string& module, const ExpertParams& params) {
    if (params.count("gate_up_proj.lora_A.weight") || params.count("gate_proj.lora_A.weight")) {
      GateUp source = read_gate_up(module, params);
      if (params.count("gate_up_proj.lora_A.weight")) store_fused(module, params, source);
      else store_separate(module, params, source);
    }
    if (params.count("down_proj.lora_A.weight")) load_down(module, params);
  }

 private:
  Parameter& param(const ExpertParams& params, const std::string& what) const { return *params.at(what); }

  // A B stack [E, out, r]: this rank's experts' rows.
  void store_b(Parameter& p, const Tensor& all) {
    store(backend_, p.value, all.view().slice_rows(rows_.first, rows_.first + p.value.size(0)));
  }

  // An A stack [E, r, in]: this rank's rows, or into a shared A (lora.expert_a: shared) the one A
  // that every expert of the file must hold alike (`key` names them in the refusal).
  void store_a(Parameter& p, const Tensor& all, const std::string& key) {
    if (p.value.shape().ndim() == 3) return store_b(p, all);
    const int64_t block = all.numel() / all.size(0);
    const double* values = all.ptr<double>();
    for (int64_t e = 1; e < all.size(0); ++e) {
      bool same = true;
      for (int64_t i = 0; i < block && same; ++i) same = values[e * block + i] == values[i];
      MOETRAIN_CHECK(same, ExitCode::kBadConfig,
                     fmt::format("{}: \"{}\": expert {}'s A differs from expert 0's, so one A shared by every expert "
                                 "(lora.expert_a: shared) cannot hold this adapter; set lora.expert_a: per_expert",
                                 dir_, key, e));
    }
    store(backend_, p.value, all.view().slice_rows(0, 1).reshaped(p.value.shape()));
  }

  std::string fused_key(const std::string& module, bool down, const char* factor) const {
    return down ? peft_fused_down_key(module, factor) : peft_fused_gate_up_key(module, fused_down_, factor);
  }

  // The file's rank and alpha of `projection` for every expert (per-expert keys): each expert's A
  // must have its rank, and all experts the same (the model's experts share one per projection).
  ModuleLora per_expert(const std::string& module, const std::string& projection) {
    ModuleLora first;
    for (int64_t e = 0; e < rows_.total; ++e) {
      const std::string name = module + "." + std::to_string(e) + "." + projection;
      const ModuleLora f = ranks_.file(name);
      const std::string key = peft_key(name + ".lora_A.weight");
      ranks_.check_stored(key, file_.shape(key)[0], name, f);
      if (e == 0) first = f;
      MOETRAIN_CHECK(f.rank == first.rank && f.alpha == first.alpha, ExitCode::kBadCheckpoint,
                     fmt::format("{}: the adapter gives {} rank {} and lora_alpha {} but expert 0 rank {} and "
                                 "lora_alpha {}; moetrain's routed experts have one rank and alpha per projection",
                                 dir_, name, f.rank, f.alpha, first.rank, first.alpha));
    }
    return first;
  }

  // PEFT's 3-D adapter on `current_key` (`<module>.gate_up_proj` or `.down_proj`): its rank and
  // alpha, checked against its A [E R, in].
  ModuleLora fused(const std::string& current_key, const std::string& a_key) {
    const ModuleLora f = ranks_.file(current_key);
    ranks_.check_stored(a_key, file_.shape(a_key)[0] / rows_.total, current_key, f);
    return f;
  }

  // The file's gate_up adapter, whatever its form: per-expert gate and up keys (side by side),
  // or PEFT's fused one.
  GateUp read_gate_up(const std::string& module, const ExpertParams& params) {
    const bool model_fused = params.count("gate_up_proj.lora_A.weight") != 0;
    const Parameter& b = param(params, model_fused ? "gate_up_proj.lora_B.weight" : "gate_proj.lora_B.weight");
    const Parameter& a = param(params, model_fused ? "gate_up_proj.lora_A.weight" : "gate_proj.lora_A.weight");
    const int64_t in = a.value.size(-1), f = model_fused ? b.value.size(1) / 2 : b.value.size(1);
    const std::string first_key = peft_key(module + ".0.gate_proj.lora_A.weight");
    if (file_.has(first_key)) {
      const ModuleLora gate = per_expert(module, "gate_proj"), up = per_expert(module, "up_proj");
      auto part = [&](const char* what, const Shape& shape) {
        return read_per_expert(file_, module, what, shape, rows_.total);
      };
      return side_by_side(part("gate_proj.lora_A.weight", {gate.rank, in}), part("gate_proj.lora_B.weight", {f, gate.rank}),
                          part("up_proj.lora_A.weight", {up.rank, in}), part("up_proj.lora_B.weight", {f, up.rank}),
                          ranks_.scale(gate), ranks_.scale(up), module + ".<e>.{gate,up}_proj (per expert)");
    }
    MOETRAIN_CHECK(fused_gate_up_, ExitCode::kBadCheckpoint,
                   fmt::format("{}: no adapter for the gate and up projections of {} (neither per-expert keys like "
                               "\"{}\" nor a gate_up_proj entry in target_parameters)",
                               dir_, module, first_key));
    GateUp g;
    g.key = fused_key(module, false, "lora_B.weight");
    const std::string a_key = fused_key(module, false, "lora_A.weight");
    const ModuleLora file_lora = fused(module + ".gate_up_proj", a_key);
    g.a = read_fused(file_, a_key, true, file_lora.rank, in, rows_.total);
    g.b = read_fused(file_, g.key, false, file_lora.rank, 2 * f, rows_.total);
    g.scale = ranks_.scale(file_lora);
    return g;
  }

  // lora.expert_gate_up: fused: a gate_up adapter of the model's fused rank, B rescaled to its scale.
  void store_fused(const std::string& module, const ExpertParams& params, GateUp& g) {
    const ModuleLora fused = ranks_.model_fused(module);
    const ModuleLora gate = ranks_.model(module + ".gate_proj"), up = ranks_.model(module + ".up_proj");
    MOETRAIN_CHECK(g.rank() == fused.rank || g.rank() != gate.rank || g.rank() != up.rank, ExitCode::kBadConfig,
                   fmt::format("{}: \"{}\" is a rank-{} gate_up adapter (one A shared by gate and up), but "
                               "lora.expert_gate_up: fused holds PEFT's gate_up adapter of rank {}. Set "
                               "lora.expert_gate_up: separate, which holds this adapter exactly (its A copied into "
                               "the gate and the up adapter)",
                               dir_, g.key, g.rank(), fused.rank));
    MOETRAIN_CHECK(g.rank() == fused.rank, ExitCode::kBadConfig,
                   fmt::format("{}: \"{}\" is a gate_up adapter of rank {}, but lora.expert_gate_up: fused holds one "
                               "of rank {} here ({}, twice the gate_proj rank unless a key selects gate_up_proj): set "
                               "lora.rank_pattern to the adapter's ranks",
                               dir_, g.key, g.rank(), fused.rank, ranks_.model_source(fused, true)));
    const double factor = g.scale / ranks_.scale(fused);
    if (factor != 1.0)
      for (int64_t i = 0; i < g.b.numel(); ++i) g.b.ptr<double>()[i] *= factor;
    store_a(param(params, "gate_up_proj.lora_A.weight"), g.a, g.key);
    store_b(param(params, "gate_up_proj.lora_B.weight"), g.b);
  }

  // lora.expert_gate_up: separate: a gate_up adapter of the gate's and up's ranks added up with a
  // block-diagonal B (split in two), or of their common rank (A shared by gate and up); each part's
  // B rescaled to its adapter's scale.
  void store_separate(const std::string& module, const ExpertParams& params, const GateUp& g) {
    const ModuleLora gate = ranks_.model(module + ".gate_proj"), up = ranks_.model(module + ".up_proj");
    const int64_t f = g.b.size(1) / 2;
    const bool shared_a = g.gate_rank == 0 && g.rank() == gate.rank && g.rank() == up.rank;
    MOETRAIN_CHECK(shared_a || (g.rank() == gate.rank + up.rank && (g.gate_rank == 0 || g.gate_rank == gate.rank)),
                   ExitCode::kBadConfig,
                   fmt::format("{}: \"{}\" is a gate_up adapter of rank {}{}, but this model's gate and up adapters "
                               "have ranks {} ({}) and {} ({}): lora.expert_gate_up: separate holds a gate_up adapter "
                               "of their sum (B block diagonal) or, when they agree, of their rank (A shared by gate "
                               "and up). Set lora.rank_pattern to the adapter's ranks, or lora.expert_gate_up: fused",
                               dir_, g.key, g.rank(),
                               g.gate_rank > 0 ? fmt::format(" (gate {}, up {})", g.gate_rank, g.rank() - g.gate_rank)
                                               : std::string(),
                               gate.rank, ranks_.model_source(gate, true), up.rank, ranks_.model_source(up, true)));
    MOETRAIN_CHECK(shared_a || block_diagonal(g.b, gate.rank), ExitCode::kBadConfig,
                   fmt::format("{}: \"{}\" is PEFT's fused gate_up adapter of rank {}: its B mixes gate and up (gate "
                               "rows use the up ranks or the other way round; after any PEFT training it does), so "
                               "separate gate and up adapters of ranks {} and {} cannot hold it. Set "
                               "lora.expert_gate_up: fused (one rank-{} adapter on gate_up_proj, as PEFT trains it)",
                               dir_, g.key, g.rank(), gate.rank, up.rank, g.rank()));
    auto [gate_a, gate_b] = take_part(g, 0, 0, gate.rank, f, g.scale / ranks_.scale(gate));
    auto [up_a, up_b] = take_part(g, shared_a ? 0 : gate.rank, f, up.rank, f, g.scale / ranks_.scale(up));
    store_a(param(params, "gate_proj.lora_A.weight"), gate_a, g.key);
    store_b(param(params, "gate_proj.lora_B.weight"), gate_b);
    store_a(param(params, "up_proj.lora_A.weight"), up_a, g.key);
    store_b(param(params, "up_proj.lora_B.weight"), up_b);
  }

  void load_down(const std::string& module, const ExpertParams& params) {
    Parameter& a = param(params, "down_proj.lora_A.weight");
    Parameter& b = param(params, "down_proj.lora_B.weight");
    const int64_t f = a.value.size(-1), d = b.value.size(1);
    const ModuleLora model = ranks_.model(module + ".down_proj");
    const std::string first_key = peft_key(module + ".0.down_proj.lora_A.weight");
    if (file_.has(first_key)) {
      const ModuleLora f_lora = per_expert(module, "down_proj");
      ranks_.check_equal(module + ".<e>.down_proj", f_lora, module + ".down_proj", model);
      store_a(a, read_per_expert(file_, module, "down_proj.lora_A.weight", {model.rank, f}, rows_.total),
              module + ".<e>.down_proj.lora_A.weight");
      store_b(b, read_per_expert(file_, module, "down_proj.lora_B.weight", {d, model.rank}, rows_.total));
      return;
    }
    MOETRAIN_CHECK(fused_down_, ExitCode::kBadCheckpoint,
                   fmt::format("{}: no adapter for {}.down_proj (neither per-expert keys like \"{}\" nor a down_proj "
                               "entry in target_parameters)",
                               dir_, module, first_key));
    const std::string a_key = fused_key(module, true, "lora_A.weight");
    ranks_.check_equal(module + ".down_proj", fused(module + ".down_proj", a_key), module + ".down_proj", model);
    store_a(a, read_fused(file_, a_key, true, model.rank, f, rows_.total), a_key);
    store_b(b, read_fused(file_, fused_key(module, true, "lora_B.weight"), false, model.rank, d, rows_.total));
  }

  AdapterFile& file_;
  const std::string& dir_;
  Ranks& ranks_;
  kernels::Backend& backend_;
  ExpertRows rows_;
  bool fused_gate_up_ = false, fused_down_ = false;
};

}  // namespace

void load_peft_adapter(Model& model, const std::string& dir) {
  PeftAdapterConfig config = read_peft_adapter_config(dir);
  const LoraSettings& lora = model.options().lora;
  MOETRAIN_CHECK(config.rank == lora.rank && config.alpha == lora.alpha && config.rslora == lora.rslora,
                 ExitCode::kBadConfig,
                 fmt::format("{}: the adapter has r {}, lora_alpha {}, use_rslora {} but the config says lora.rank "
                             "{}, lora.alpha {}, lora.rslora {}: set the config to the adapter's values",
                             dir, config.rank, config.alpha, config.rslora, lora.rank, lora.alpha, lora.rslora));
  AdapterFile file(dir + "/" + kPeftWeightsFile);
  kernels::Backend& backend = model.backend();
  Ranks ranks(config, model, dir);
  std::map<std::string, ExpertParams> experts;  // routed-experts module -> its adapters

  for (Parameter* p : model.parameters()) {
    const size_t factor = p->name.rfind(".lora_");
    // A module trained whole (model.vision.projector_train: full) is no adapter: its values are
    // the checkpoint's (load_weights).
    if (factor == std::string::npos) continue;
    if (p->value.shape().ndim() == 3 || p->name.find(".mlp.experts.") != std::string::npos) {
      // "model.layers.1.mlp.experts.gate_proj.lora_A.weight" -> module, "gate_proj.lora_A.weight"
      const size_t projection = p->name.rfind('.', factor - 1);
      experts[p->name.substr(0, projection)][p->name.substr(projection + 1)] = p;
      continue;
    }
    // Kimi-Linear adapters made on transformers 5 name some KDA modules its way (hf_names.h).
    std::string key = peft_key(p->name);
    const std::string transformers_key = peft_key(transformers_module_name(p->name));
    if (!file.has(key) && file.has(transformers_key)) key = transformers_key;
    // The module as PEFT named it, for the file's patterns; the model's rank and alpha for it.
    const std::string file_module = peft_module(key);
    const std::string current_key = ranks.current_key(file_module);
    const ModuleLora f = ranks.file(current_key);
    const bool is_a = p->name.compare(factor, std::string::npos, ".lora_A.weight") == 0;
    ranks.check_stored(key, file.shape(key)[is_a ? 0 : 1], current_key, f);
    if (is_a) ranks.check_equal(current_key, f, p->name.substr(0, factor), ranks.model(p->name.substr(0, factor)));
    store(backend, p->value, file.read(key, p->value.shape()));
  }
  const ParallelGroups* parallel = model.options().parallel;
  ExpertRows rows{model.spec().config.moe.num_experts, parallel ? parallel->first_expert() : 0};
  ExpertLoader loader(file, config, dir, ranks, backend, rows);
  for (const auto& [module, params] : experts) loader.load(module, params);
  file.check_all_used();
}

}  // namespace moetrain
