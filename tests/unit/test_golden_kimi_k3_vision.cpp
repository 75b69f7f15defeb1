// Kimi K3's vision side against NVIDIA NeMo AutoModel's KimiK3ForConditionalGeneration
// (tests/fixtures/golden/kimi_k3_vision, made by scripts/make_fixtures_kimi_k3_vision.py): the
// kimi_k3 fixture's text model with a tiny MoonViT3d tower (grids 1 x 4 x 6 and 2 x 6 x 8 against a
// 5 x 7 position table), the projector trained in full and LoRA on the language model. Our importer
// reads the released-style directory (vision_tower.*, mm_projector.*), our batch carries the patches
// and grids and the pre-expanded placeholders; the tower's merged output, the image tokens, the
// merged embeddings, logits and loss must match to 1e-5 and every adapter and projector gradient to
// 1e-4, each against its own scale (the reference runs in fp32: these are the text fixtures' bounds).
// Image B's two frames make the tower's output depend on the time table's bf16 rounding. Without
// the fixture directory the test says so and passes (the fixture needs torch).
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "catch.h"
#include "core/base/host_convert.h"
#include "core/config/config.h"
#include "core/io/safetensors.h"
#include "core/model/model.h"
#include "golden_checks.h"
#include "golden_k3.h"
#include "kernels/ops.h"

using namespace moetrain;

namespace {

const char* kFixture = "kimi_k3_vision";

std::string our_parameter_name(const std::string& adapter_key) {
  const std::string prefix = "base_model.model.";
  REQUIRE(adapter_key.rfind(prefix, 0) == 0);
  return testing::k3_parameter_name(adapter_key.substr(prefix.size()));
}

// The golden batch with the fixture's images: pixel_values [patches, 3, 14, 14] are already each
// patch channel-major, the layout Batch::image_patches has.
Batch vision_batch(const SafetensorsFile& golden) {
  Batch batch = testing::golden_batch(golden);
  const Tensor pixels = golden.read_as("pixel_values", DType::kF32);
  batch.image_patches.assign(pixels.ptr<float>(), pixels.ptr<float>() + pixels.numel());
  const Tensor grids = golden.read_as("grid_thws", DType::kI32);
  batch.image_grids.assign(grids.ptr<int32_t>(), grids.ptr<int32_t>() + grids.numel());
  return batch;
}

void check_fixture(DType dtype) {
  const std::string dir = testing::golden_dir(kFixture);
  SafetensorsFile golden(dir + "/golden.safetensors");
  const Batch batch = vision_batch(golden);
  const Config config = parse_config("model: {hf_dir: " + dir + ", vision: {enabled: true, projector_train: full}}\n"
                                     "data: {seq_len: " + std::to_string(batch.seq_len) + "}\n",
                                     "golden_kimi_k3_vision.yaml");
  const ModelSpec spec = resolve_model_spec(config);
  const VisionConfig& v = spec.config.vision;
  REQUIRE(v.enabled);
  REQUIRE(v.num_layers == 2);
  REQUIRE(v.hidden_size == 32);
  REQUIRE(v.pos_emb_height == 5);
  REQUIRE(v.pos_emb_width == 7);
  REQUIRE(v.placeholder_token_id == spec.config.vocab_size - 1);

  auto backend = kernels::make_cpu_backend();
  const ModelOptions options =
      testing::adapter_model_options(dir, dtype, testing::k3_adapter_targets(dir + "/adapter"));
  std::unique_ptr<Model> model = testing::load_golden_model(spec, *backend, options, dir);

  // Stage by stage, each against its own scale: the tower's merged output (the projector's input),
  // the image tokens (the projector's output), then the embeddings with the tokens merged in.
  {
    std::vector<ImageGrid> grids = image_grids_of(batch.image_grids, v);
    Tensor patches({static_cast<int64_t>(batch.image_patches.size()) / (3 * v.patch_size * v.patch_size),
                    3 * v.patch_size * v.patch_size},
                   DType::kF64);
    for (size_t i = 0; i < batch.image_patches.size(); ++i) patches.ptr<double>()[i] = batch.image_patches[i];
    Tensor staged(patches.shape(), dtype);
    convert_host(staged, patches);
    BatchTensors none;
    LayerContext ctx{*backend, dtype, none};
    const double tower_error = testing::scaled_error(
        testing::host_f64(*backend, model->vision()->tower(ctx, staged, grids)),
        golden.read_as("vision.tower_output", DType::kF64));
    INFO("tower output scaled error " << tower_error);
    CHECK(tower_error <= 1e-5);
    Tensor tokens = model->vision()->forward(ctx, staged, grids, false);
    const double error = testing::scaled_error(testing::host_f64(*backend, tokens),
                                               golden.read_as("vision.projector_output", DType::kF64));
    INFO("image tokens scaled error " << error);
    CHECK(error <= 1e-5);
  }
  const double merged_error =
      testing::scaled_error(model->embedded(batch), golden.read_as("vision.merged_embeddings", DType::kF64));
  INFO("merged embeddings scaled error " << merged_error);
  CHECK(merged_error <= 1e-5);

  testing::GoldenStepChecks checks;
  checks.our_key = our_parameter_name;
  const std::vector<std::string> compared = testing::check_golden_step(kFixture, *model, *backend, golden, batch, dir,
                                                                       checks);
  // The projector's gradients, stored beside the adapter's.
  std::map<std::string, Tensor> grads = testing::host_gradients(*model, *backend);
  int projector = 0;
  for (const std::string& key : golden.names()) {
    const std::string prefix = "projector_grad.";
    if (key.rfind(prefix, 0) != 0) continue;
    const std::string param = key.substr(prefix.size());
    const double error = testing::scaled_error(testing::gradient_for(grads, param), golden.read_as(key, DType::kF64));
    INFO(key << " scaled error " << error);
    CHECK(error <= 1e-4);
    ++projector;
  }
  CHECK(projector == 3);
  CHECK(compared.size() + 3 == model->parameters().size());
}

bool fixture_present() {
  const std::string dir = testing::golden_dir(kFixture);
  if (std::filesystem::exists(dir + "/golden.safetensors")) return true;
  WARN("SKIPPED: no golden fixture " << dir << "; make it on a machine with torch, transformers 5.x, peft and "
       "NeMo AutoModel's source with\n  python3 scripts/make_fixtures_kimi_k3_vision.py --out tests/fixtures/golden"
       "\nand commit tests/fixtures/golden/kimi_k3_vision/ (docs/FIXTURES.md)");
  return false;
}

}  // namespace

TEST_CASE("golden: Kimi K3 with its vision tower and projector (NeMo's KimiK3ForConditionalGeneration)",
          "[golden][k3][vision]") {
  if (!fixture_present()) return;
  check_fixture(DType::kF32);
}

TEST_CASE("golden: Kimi K3's vision side in double precision", "[golden][k3][vision]") {
  if (!fixture_present()) return;
  check_fixture(DType::kF64);
}
