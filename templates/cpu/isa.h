// isa.h -- which instruction set this translation unit is compiled for.
// Chosen at compile time only (no runtime dispatch): every kernel header branches on
// the HIPC_ISA_* macros defined here, so they are decided once, in one place.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(_OPENMP)
#include <omp.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define HIPC_ISA_AVX512 1
#define HIPC_ISA_NAME "avx512-vnni"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HIPC_ISA_AVX2 1
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define HIPC_ISA_NAME "avx2-vnni"
#else
#define HIPC_ISA_NAME "avx2"
#endif
#else
#define HIPC_ISA_SCALAR 1
#define HIPC_ISA_NAME "scalar"
#endif

namespace hipc {

// Which code path this translation unit was compiled for ("avx512-vnni", "avx2-vnni",
// "avx2" or "scalar"; "+vbmi" marks the byte-permute Q4_0 path).
inline const char* cpu_isa() {
#if defined(HIPC_ISA_AVX512) && defined(__AVX512VBMI__)
  return HIPC_ISA_NAME "+vbmi";
#else
  return HIPC_ISA_NAME;
#endif
}

}  // namespace hipc
