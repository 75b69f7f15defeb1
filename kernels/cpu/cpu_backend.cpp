// The CPU reference backend: being written (see kernels/ops.h).
