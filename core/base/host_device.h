// Marks a small inline function as callable from both host and device code when nvcc compiles it,
// so one definition serves the CPU reference and a CUDA kernel (and they cannot drift apart).
#pragma once

#if defined(__CUDACC__)
#define MOETRAIN_HOST_DEVICE __host__ __device__
#else
#define MOETRAIN_HOST_DEVICE
#endif
