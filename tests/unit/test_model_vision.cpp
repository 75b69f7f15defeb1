// The model with Kimi K3's vision tower on the CPU in double: the projector's gradients (full and
// LoRA) and the language model's adapters' against central differences of the loss, through the
// image tokens merged at the placeholders (two images, one of two frames, and a document without
// images); and the batch checks that name a mismatch between placeholders and images.
#include <cmath>
#include <memory>
#include <vector>

#include "catch.h"
#include "core/model/model.h"
#include "core/plan/param_count.h"
#include "gradcheck.h"
#include "model_gradcheck.h"
#include "tiny_model.h"

using namespace moetrain;
using namespace moetrain::testing;

namespace {

constexpr int32_t kPlaceholder = 36;

Config vision_config(const std::string& projector_train) {
  Config config = tiny_model_config(/*q_lora=*/false);
  VisionConfig& v = config.model.vision;
  v.enabled = true;
  v.patch_size = 2;
  v.pos_emb_height = 3;  // neither grid below has the table's size: both are resized
  v.pos_emb_width = 5;
  v.pos_emb_time = 3;
  v.num_layers = 2;
  v.hidden_size = 8;
  v.num_heads = 2;
  v.qkv_hidden_size = 8;
  v.intermediate_size = 12;
  v.merge_size = 2;
  v.placeholder_token_id = kPlaceholder;
  v.projector_train = projector_train;
  return config;
}

// One window of 14 tokens: a document with two images (grids (1, 2, 4) and (2, 4, 2), two tokens
// each) between text, then a text-only document. Labels are next-token targets, -1 before an image
// token and at each document's end.
Batch vision_batch() {
  const int32_t P = kPlaceholder;
  const std::vector<int32_t> ids = {3, P, P, 4, 5, P, P, 6, 7, 8, 9, 10, 11, 12};
  Batch batch = Batch::of_windows(1, static_cast<int64_t>(ids.size()));
  batch.input_ids = ids;
  batch.set_segments({10, 4});
  for (size_t t = 0; t < ids.size(); ++t) {
    const bool last = t == 9 || t == 13;
    batch.labels[t] = last || ids[t + 1] == P ? -1 : ids[t + 1];
    batch.positions[t] = static_cast<int32_t>(t < 10 ? t : t - 10);
  }
  batch.image_grids = {1, 2, 4, 2, 4, 2};
  const int64_t values = (8 + 16) * 12;
  Tensor patches = random_tensor({values}, DType::kF64, 77, -1.0, 1.0);
  for (int64_t i = 0; i < values; ++i) batch.image_patches.push_back(static_cast<float>(get_element(patches, i)));
  return batch;
}

struct VisionFixture {
  std::unique_ptr<kernels::Backend> backend = kernels::make_cpu_backend();
  std::unique_ptr<Model> model;
  Batch batch = vision_batch();
  double grad_scale = 0.0;

  explicit VisionFixture(const std::string& projector_train) {
    ModelOptions options;
    options.dtype = DType::kF64;
    options.lora = LoraSettings{2, 4.0, false};
    options.lora_targets = {"o_proj"};
    model = std::make_unique<Model>(resolve_model_spec(vision_config(projector_train)), *backend, options);
    model->init_random_weights();
    uint64_t seed = 300;
    for (Parameter* p : model->parameters()) fill_random(p->value, seed++, 0.05, 0.3);
    grad_scale = 1.0 / static_cast<double>(batch.num_targets());
  }
  double objective() { return model->forward_backward(batch, grad_scale).loss_sum * grad_scale; }
};

bool is_projector(const std::string& name) { return name.rfind("mm_projector.", 0) == 0; }

}  // namespace

TEST_CASE("vision model: projector and adapter gradients match finite differences", "[model][vision][gradcheck]") {
  for (const char* mode : {"full", "lora"}) {
    INFO("projector_train " << mode);
    VisionFixture f(mode);
    int projector = 0;
    for (Parameter* p : f.model->parameters()) projector += is_projector(p->name);
    CHECK(projector == (std::string(mode) == "full" ? 3 : 4));  // two Linears and the norm, or two adapters
    const std::vector<Tensor> analytic = lora_gradients(*f.model, *f.backend, f.batch, f.grad_scale);
    check_lora_gradients(*f.model, *f.backend, analytic, [&] { return f.objective(); },
                         whole_model_gradcheck_options());
  }
}

TEST_CASE("vision model: a frozen projector trains only the language model", "[model][vision]") {
  VisionFixture f("frozen");
  for (Parameter* p : f.model->parameters()) CHECK_FALSE(is_projector(p->name));
  const StepResult r = f.model->forward_backward(f.batch, f.grad_scale);
  CHECK(std::isfinite(r.loss_sum));
}

TEST_CASE("vision model: the images move the logits of the text after them only", "[model][vision]") {
  VisionFixture f("full");
  Tensor with_images = f.model->logits(f.batch);
  Batch other = f.batch;
  for (float& v : other.image_patches) v = -v;
  Tensor flipped = f.model->logits(other);
  const int64_t vocab = with_images.size(1);
  auto row_differs = [&](int64_t t) {
    for (int64_t j = 0; j < vocab; ++j)
      if (get_element(with_images, t * vocab + j) != get_element(flipped, t * vocab + j)) return true;
    return false;
  };
  CHECK_FALSE(row_differs(0));  // before the first image
  CHECK(row_differs(1));        // an image token
  CHECK(row_differs(9));        // text after the images, same document
  for (int64_t t = 10; t < 14; ++t) CHECK_FALSE(row_differs(t));  // the next document sees no image
}

TEST_CASE("vision model: placeholders and images must agree", "[model][vision]") {
  VisionFixture f("full");
  Batch missing = f.batch;
  missing.input_ids[1] = 2;  // one placeholder fewer than the images' tokens
  missing.labels[0] = 2;
  CHECK(error_message([&] { f.model->forward_backward(missing, f.grad_scale); }).find("placeholder") !=
        std::string::npos);
  Batch target = f.batch;
  target.labels[0] = kPlaceholder;
  CHECK(error_message([&] { f.model->forward_backward(target, f.grad_scale); }).find("not targets") !=
        std::string::npos);
  Batch odd = f.batch;
  odd.image_grids = {1, 3, 4, 2, 4, 2};
  CHECK(error_message([&] { f.model->forward_backward(odd, f.grad_scale); }).find("multiple of 2") !=
        std::string::npos);
}

TEST_CASE("vision model: the plan counts the tower's weights and the projector's parameters exactly",
          "[model][vision][plan]") {
  for (const char* mode : {"full", "lora", "frozen"}) {
    INFO("projector_train " << mode);
    VisionFixture f(mode);
    const Config config = vision_config(mode);
    const ModelSpec spec = resolve_model_spec(config);
    const ModelParameterCount count = count_model_parameters(spec);
    int64_t vision_weights = 0;
    for (const WeightSlot& slot : f.model->weight_slots()) {
      const bool vision = slot.name.rfind("vision_tower.", 0) == 0 || slot.name.rfind("mm_projector.", 0) == 0;
      if (vision) vision_weights += slot.tensor->numel();
    }
    CHECK(vision_weights == count.vision());
    LoraConfig lora;
    lora.rank = 2;
    lora.targets = {"o_proj"};
    int64_t projector_params = 0;
    for (Parameter* p : f.model->parameters())
      if (is_projector(p->name)) projector_params += p->value.numel();
    CHECK(projector_params == count_lora_parameters(spec, lora).vision_projector);
  }
}

TEST_CASE("vision time table: the sin-cos rows as NeMo's bf16-cast tower holds them", "[model][vision]") {
  // dim 8: omega_i = 10000^(-i / 4); omega_0 = 1, so row f starts with bf16(sin f) and its second
  // half with bf16(cos f) (values rounded by hand: sin 1 = 0.84147 -> 215/256, cos 1 = 0.54030 ->
  // 138/256, sin 2 = 0.90930 -> 233/256, cos 3 = -0.98999 -> -253/256).
  const std::vector<double> table = vision_time_table(4, 8);
  REQUIRE(table.size() == 32);
  for (int i = 0; i < 4; ++i) {
    CHECK(table[i] == 0.0);
    CHECK(table[4 + i] == 1.0);
  }
  CHECK(table[8] == 215.0 / 256);
  CHECK(table[8 + 4] == 138.0 / 256);
  CHECK(table[16] == 233.0 / 256);
  CHECK(table[24 + 4] == -253.0 / 256);
  // Every entry is within half of bf16's step (2^-8 relative: 8 significant bits) of the exact value.
  for (int f = 0; f < 4; ++f) {
    for (int i = 0; i < 4; ++i) {
      const double angle = f * std::pow(10000.0, -i / 4.0);
      CHECK(std::fabs(table[f * 8 + i] - std::sin(angle)) <= std::ldexp(std::fabs(std::sin(angle)), -8) + 1e-12);
      CHECK(std::fabs(table[f * 8 + 4 + i] - std::cos(angle)) <= std::ldexp(std::fabs(std::cos(angle)), -8) + 1e-12);
    }
  }
}
