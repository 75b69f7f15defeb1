// Hugging Face weights directories: a sharded round trip through write_hf_checkpoint, the
// single-file form, lazy shard opening, and every broken-directory case (each an Error with exit
// code 4 naming the directory, the file and the tensor).
#include <cstring>
#include <algorithm>
#include <filesystem>
#include <functional>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <vector>

#include "catch.h"
#include "core/io/hf_index.h"
#include "expected_error.h"
#include "scratch_dir.h"

using namespace moetrain;
namespace fs = std::filesystem;

namespace {

using testing::ScratchDir;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// Tensor k holds k * 1000 + i at element i, so every value says where it came from.
Tensor numbered(int k, Shape shape) {
  Tensor t(shape, DType::kF32);
  for (int64_t i = 0; i < t.numel(); ++i) t.ptr<float>()[i] = static_cast<float>(k * 1000 + i);
  return t;
}

struct Model {
  std::vector<std::string> names = {"lm_head.weight", "model.embed.weight", "model.layers.0.attn.q.weight",
                                    "model.layers.0.attn.o.weight", "model.layers.0.norm.weight",
                                    "model.layers.1.mlp.weight", "model.norm.weight"};
  std::vector<Tensor> tensors;
  Model() {
    for (size_t k = 0; k < names.size(); ++k) tensors.push_back(numbered(static_cast<int>(k), {static_cast<int64_t>(k + 1), 3}));
  }
  std::vector<NamedTensor> named() const {
    std::vector<NamedTensor> out;
    for (size_t k = 0; k < names.size(); ++k) out.push_back({names[k], tensors[k].view()});
    return out;
  }
};

std::string error_of(const std::function<void()>& action) { return testing::expected_error(ExitCode::kBadCheckpoint, action); }

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace

TEST_CASE("a sharded directory round-trips through the index", "[hf_index]") {
  ScratchDir dir("hf_roundtrip");
  Model model;
  write_hf_checkpoint(dir.path.string(), model.named(), {3, {{"format", "pt"}}});
  for (const char* shard : {"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                            "model-00003-of-00003.safetensors", "model.safetensors.index.json"}) {
    CHECK(fs::exists(dir.path / shard));
  }
  CHECK_FALSE(fs::exists(dir.path / "model.safetensors"));

  HfCheckpoint checkpoint(dir.path.string());
  CHECK(checkpoint.sharded());
  std::vector<std::string> sorted = model.names;
  std::sort(sorted.begin(), sorted.end());
  CHECK(checkpoint.names() == sorted);
  uint64_t total = 0;
  for (const Tensor& t : model.tensors) total += t.nbytes();
  CHECK(checkpoint.index_metadata().at("total_size") == std::to_string(total));

  std::set<std::string> files;
  for (size_t k = 0; k < model.names.size(); ++k) {
    const std::string& name = model.names[k];
    INFO(name);
    files.insert(checkpoint.file_of(name));
    CHECK(checkpoint.info(name).shape == model.tensors[k].shape());
    Tensor back = checkpoint.read_as(name, DType::kF64);
    for (int64_t i = 0; i < back.numel(); ++i) CHECK(back.ptr<double>()[i] == static_cast<double>(k * 1000 + i));
    CHECK(checkpoint.file_for(name).metadata().at("format") == "pt");
  }
  CHECK(files.size() == 3);

  // Rows 2..4 of the 5-row tensor, straight from its shard.
  const std::string& five_rows = model.names[4];
  std::vector<float> rows(2 * 3);
  checkpoint.read_rows(rows.data(), five_rows, 2, 4);
  for (int i = 0; i < 6; ++i) CHECK(rows[static_cast<size_t>(i)] == static_cast<float>(4000 + 6 + i));
  Tensor last = checkpoint.read_rows_as(five_rows, 4, 5, DType::kF32);
  CHECK(last.ptr<float>()[2] == 4000.0f + 14);

  std::string message = error_of([&] { checkpoint.read_as("model.layers.9.mlp.weight", DType::kF32); });
  CHECK(contains(message, "model.layers.9.mlp.weight"));
  CHECK(contains(message, dir.path.string()));
  CHECK_FALSE(checkpoint.has("model.layers.9.mlp.weight"));
}

TEST_CASE("a directory with only model.safetensors", "[hf_index]") {
  ScratchDir dir("hf_single");
  Model model;
  write_hf_checkpoint(dir.path.string(), model.named(), {1, {}});
  CHECK(fs::exists(dir.path / "model.safetensors"));
  CHECK_FALSE(fs::exists(dir.path / "model.safetensors.index.json"));
  HfCheckpoint checkpoint(dir.path.string());
  CHECK_FALSE(checkpoint.sharded());
  CHECK(checkpoint.names().size() == model.names.size());
  CHECK(checkpoint.read_as(model.names[2], DType::kF32).ptr<float>()[4] == 2004.0f);
  CHECK(checkpoint.file_of(model.names[0]) == dir.file("model.safetensors"));
}

TEST_CASE("shards open lazily: a corrupt shard only fails the tensors it holds", "[hf_index]") {
  ScratchDir dir("hf_lazy");
  Model model;
  write_hf_checkpoint(dir.path.string(), model.named(), {3, {}});
  std::string third = dir.file("model-00003-of-00003.safetensors");
  fs::resize_file(third, 5);
  HfCheckpoint checkpoint(dir.path.string());
  std::vector<std::string> sorted = checkpoint.names();
  // Sorted names are split in order: the first name lives in shard 1, the last in shard 3.
  CHECK(checkpoint.read_as(sorted.front(), DType::kF32).numel() > 0);
  std::string message = error_of([&] { checkpoint.info(sorted.back()); });
  CHECK(contains(message, third));
}

TEST_CASE("broken directories are Errors naming what is missing", "[hf_index]") {
  ScratchDir dir("hf_broken");
  Model model;
  std::string root = dir.path.string();

  SECTION("neither index nor model.safetensors") {
    std::string message = error_of([&] { HfCheckpoint checkpoint(root); });
    CHECK(contains(message, root));
    CHECK(contains(message, "model.safetensors.index.json"));
    CHECK(contains(message, "model.safetensors"));
  }
  SECTION("not a directory") {
    std::string message = error_of([&] { HfCheckpoint checkpoint(dir.file("nowhere")); });
    CHECK(contains(message, dir.file("nowhere")));
  }
  SECTION("a shard the index names is missing") {
    write_hf_checkpoint(root, model.named(), {3, {}});
    fs::remove(dir.path / "model-00002-of-00003.safetensors");
    std::string message = error_of([&] { HfCheckpoint checkpoint(root); });
    CHECK(contains(message, "model-00002-of-00003.safetensors"));
    CHECK(contains(message, "model.safetensors.index.json"));
    CHECK(contains(message, "tensor '"));
  }
  SECTION("the index maps a tensor to a shard that lacks it") {
    write_hf_checkpoint(root, model.named(), {2, {}});
    std::string index_path = dir.file("model.safetensors.index.json");
    std::string text = read_text(index_path);
    size_t at = text.find("\"weight_map\": {");
    REQUIRE(at != std::string::npos);
    text.insert(at + std::strlen("\"weight_map\": {"), "\"ghost.weight\": \"model-00001-of-00002.safetensors\",");
    write_text(index_path, text);
    HfCheckpoint checkpoint(root);
    CHECK(checkpoint.has("ghost.weight"));
    std::string message = error_of([&] { checkpoint.read_as("ghost.weight", DType::kF32); });
    CHECK(contains(message, "ghost.weight"));
    CHECK(contains(message, dir.file("model-00001-of-00002.safetensors")));
    // Any tensor of that shard reports it: the shard cannot be trusted.
    std::string other = error_of([&] { checkpoint.info(checkpoint.names().front()); });
    CHECK(contains(other, "ghost.weight"));
  }
  SECTION("bad index files") {
    write_hf_checkpoint(root, model.named(), {2, {}});
    std::string index_path = dir.file("model.safetensors.index.json");
    write_text(index_path, "{\"weight_map\": ");
    CHECK(contains(error_of([&] { HfCheckpoint checkpoint(root); }), "not valid JSON"));
    write_text(index_path, "{\"metadata\": {}}");
    CHECK(contains(error_of([&] { HfCheckpoint checkpoint(root); }), "weight_map"));
    write_text(index_path, "{\"weight_map\": {\"a\": 3}}");
    CHECK(contains(error_of([&] { HfCheckpoint checkpoint(root); }), "weight_map[\"a\"]"));
    write_text(index_path, "{\"weight_map\": {\"a\": \"../model-00001-of-00002.safetensors\"}}");
    CHECK(contains(error_of([&] { HfCheckpoint checkpoint(root); }), "inside"));
    write_text(index_path, "[]");
    CHECK(contains(error_of([&] { HfCheckpoint checkpoint(root); }), index_path));
  }
}
