// Fuzzes HfCheckpoint (core/io/hf_index.h): the input is model.safetensors.index.json, in a
// directory that also holds two real shards (written once per process by write_hf_checkpoint),
// so that an index naming them gets its tensors looked up, opened and read.
#include "core/io/hf_index.h"

#include "fuzz_support.h"

using namespace moetrain;

namespace {

const std::filesystem::path& model_dir() {
  static const std::filesystem::path dir = [] {
    std::filesystem::path d = fuzz::scratch_dir() / "model";
    Tensor embed({4, 3}, DType::kF32), norm({3}, DType::kBF16), head({2, 3}, DType::kF32);
    write_hf_checkpoint(d.string(),
                        {{"language_model.model.norm.weight", norm.view()},
                         {"lm_head.weight", head.view()},
                         {"model.embed_tokens.weight", embed.view()}},
                        {2, {{"format", "pt"}}});
    return d;
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::filesystem::path& dir = model_dir();
  fuzz::write_file(dir / HfCheckpoint::kIndexFileName, data, size);
  fuzz::expect_only({ExitCode::kBadCheckpoint}, [&] {
    HfCheckpoint checkpoint(dir.string());
    (void)checkpoint.index_metadata();
    for (const std::string& name : checkpoint.names()) {
      if (!checkpoint.has(name)) std::abort();  // names() and has() disagree
      (void)checkpoint.file_of(name);
      fuzz::expect_only({ExitCode::kBadCheckpoint}, [&] {
        const SafetensorsTensorInfo& info = checkpoint.info(name);
        (void)checkpoint.read_as(name, info.dtype);
        if (info.shape.ndim() > 0 && info.shape[0] > 0) (void)checkpoint.read_rows_as(name, 0, 1, info.dtype);
      });
    }
    // The unprefixed name of a language_model. tensor, and one that is not there.
    (void)checkpoint.has("model.norm.weight");
    (void)checkpoint.has("no.such.tensor");
  });
  return 0;
}
