// Fuzzes SafetensorsFile (core/io/safetensors.h): the input is a whole .safetensors file. Every
// tensor the header accepts is then read whole and by rows, converted to F32 where its dtype
// allows, so that "validated when opened" is checked by actually touching the bytes.
#include "core/io/safetensors.h"

#include "fuzz_support.h"

using namespace moetrain;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::filesystem::path path = fuzz::scratch_dir() / "input.safetensors";
  fuzz::write_file(path, data, size);
  fuzz::expect_only({ExitCode::kBadCheckpoint}, [&] {
    SafetensorsFile file(path.string());
    for (const std::string& name : file.names()) {
      const SafetensorsTensorInfo& info = file.info(name);
      (void)file.view(name);
      // Float tensors convert to F32; a refusal for other dtypes is a documented Error.
      fuzz::expect_only({ExitCode::kBadCheckpoint}, [&] { (void)file.read_as(name, DType::kF32); });
      (void)file.read_as(name, info.dtype);
      if (info.shape.ndim() > 0 && info.shape[0] > 0) {
        (void)file.read_rows_as(name, 0, 1, info.dtype);
        (void)file.read_rows_as(name, info.shape[0] - 1, info.shape[0], info.dtype);
      }
    }
  });
  return 0;
}
