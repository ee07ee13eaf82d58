// Minimal stand-in for CUDA's crt/host_defines.h (shipped with nvcc, not with the runtime wheel) so that the
// runtime wheel's real cuda_fp16.h / cuda_bf16.h / vector_types.h compile as plain host C++ under g++ for
// the CPU emulation in tests/cuda_emu. Only what those headers use; execution-space keywords vanish.
#pragma once
#define __host__
#define __device__
#define __global__
#define __constant__
#define __managed__
#define __forceinline__ inline __attribute__((always_inline))
#define __inline_hint__
#define __align__(n) __attribute__((aligned(n)))
#define __builtin_align__(a) __align__(a)
#define __device_builtin__
#define __device_builtin_texture_type__
#define __device_builtin_surface_type__
#define __cudart_builtin__
#define __nv_pure__
#define __specialization_static
#define CUDARTAPI
#define CUDARTAPI_CDECL
#ifndef __cdecl
#define __cdecl
#endif
