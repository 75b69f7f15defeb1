// main() of the CUDA op tests (Catch2 2 and 3): without a GPU it prints "SKIPPED: no CUDA
// device" and exits 77, which CTest reports as skipped (SKIP_RETURN_CODE), never as passed.
#include <cstdio>

#if MOETRAIN_CATCH2_V3
#include <catch2/catch_session.hpp>
#else
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#endif

#include "kernels/cuda/common/device.h"

int main(int argc, char** argv) {
  if (moetrain::cuda::device_count() == 0) {
    std::printf("SKIPPED: no CUDA device\n");
    return 77;
  }
  moetrain::cuda::set_device(0);
  return Catch::Session().run(argc, argv);
}
