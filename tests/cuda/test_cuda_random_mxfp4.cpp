// Random MXFP4 weights made on the GPU (Backend::random_mxfp4, the random initialisation of Kimi
// K3's frozen experts) are byte for byte those of the CPU reference, including a slice that starts
// past element 2^32 (a rank's experts far into a layer), and a large tensor made in one launch.
#include <algorithm>
#include <string>

#include "cuda_test_support.h"

namespace moetrain::cuda_test {
namespace {

// The device tensor's bytes equal the host's (counts the mismatches, names the first).
void expect_same_bytes(const TensorView& device, const TensorView& host, const std::string& name) {
  Tensor got(device.shape, device.dtype);
  gpu().copy(got, device);
  const auto* a = static_cast<const unsigned char*>(got.data());
  const auto* b = static_cast<const unsigned char*>(host.data);
  int64_t mismatches = 0, first = -1;
  for (size_t i = 0; i < host.nbytes(); ++i) {
    if (a[i] != b[i]) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++mismatches;
    }
  }
  INFO(name + ": " + std::to_string(mismatches) + " of " + std::to_string(host.nbytes()) + " bytes differ, first at " +
       std::to_string(first));
  CHECK(mismatches == 0);
}

TEST_CASE("cuda random_mxfp4 makes the CPU reference's bytes") {
  struct Case {
    Shape codes;  // [..., cols / 2]
    uint64_t first_element;
    double half_width;
  };
  const Case cases[] = {
      {{3, 5, 16}, 0, 0.05},                       // one group per row
      {{2, 7, 48}, (uint64_t{1} << 32) + 12345, 1.0},  // 3 groups per row, past 2^32
      {{64, 1024}, 977, 1.0 / 45.0},                // a K3-like row (2048 values), many rows
      {{4, 32}, 0, 0.0},                            // all zero: scale exponent -127
  };
  for (const Case& c : cases) {
    const int64_t cols = 2 * c.codes[c.codes.ndim() - 1];
    Shape scale_shape = c.codes;
    scale_shape[scale_shape.ndim() - 1] = cols / 32;
    kernels::RandomMxfp4Args args;
    args.seed = 0x5eed;
    args.first_element = c.first_element;
    args.half_width = c.half_width;
    Tensor host_codes(c.codes, DType::kU8), host_scales(scale_shape, DType::kU8);
    args.codes = host_codes.view();
    args.scales = host_scales.view();
    cpu().random_mxfp4(args);
    Tensor dev_codes = poisoned(c.codes, DType::kU8), dev_scales = poisoned(scale_shape, DType::kU8);
    args.codes = dev_codes.view();
    args.scales = dev_scales.view();
    gpu().random_mxfp4(args);
    const std::string tag = "codes " + c.codes.str() + " from element " + std::to_string(c.first_element);
    expect_same_bytes(dev_codes.view(), host_codes.view(), tag + " codes");
    expect_same_bytes(dev_scales.view(), host_scales.view(), tag + " scales");
  }
}

TEST_CASE("cuda random_mxfp4 fills a large tensor whose every group is the reference's") {
  // 112 experts of 3072 x 3584 (a K3 EP8 rank's down projection): 1.2e9 values in one launch;
  // the CPU makes a sample of rows (the first, the last, and a stride through the middle).
  const Shape codes_shape{112 * 3072, 3584 / 2}, scales_shape{112 * 3072, 3584 / 32};
  Tensor codes(codes_shape, DType::kU8, cuda::device_allocator());
  Tensor scales(scales_shape, DType::kU8, cuda::device_allocator());
  kernels::RandomMxfp4Args args{codes.view(), scales.view(), 7, 3 * uint64_t{3072} * 3584, 1.0 / 60.0};
  gpu().random_mxfp4(args);
  const int64_t rows = codes_shape[0];
  for (int64_t row : {int64_t{0}, rows / 3, rows / 2 + 1, rows - 1}) {
    Tensor host_codes({1, codes_shape[1]}, DType::kU8), host_scales({1, scales_shape[1]}, DType::kU8);
    kernels::RandomMxfp4Args one = args;
    one.codes = host_codes.view();
    one.scales = host_scales.view();
    one.first_element = args.first_element + static_cast<uint64_t>(row * 3584);
    cpu().random_mxfp4(one);
    expect_same_bytes(codes.view().slice_rows(row, row + 1), host_codes.view(),
                      "row " + std::to_string(row) + " codes");
    expect_same_bytes(scales.view().slice_rows(row, row + 1), host_scales.view(),
                      "row " + std::to_string(row) + " scales");
  }
}

}  // namespace
}  // namespace moetrain::cuda_test
