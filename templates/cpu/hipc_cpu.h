// hipc_cpu.h -- header-only CPU building blocks for hipc-generated kernels.
//
// Matrix products against weights kept in their GGUF block layouts (Q4_0, Q4_1, Q8_0,
// Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) or dense (f32, f16, bf16), plus f16/bf16 conversions,
// activation quantization and embedding-row gathers. Kernels call, e.g.
//
//     hipc::matmul_q4_1(x, T, K, W, N, y, N);      // y[T,N] = x[T,K] @ W[N,K]^T
//
// This file only orders the pieces, one header per kernel kind (linear*.h, embedding.h,
// row_ops.h) after the helpers they share (isa.h, convert.h, blocks.h, quantize_act.h).
// The CPU renderer (compiler/codegen/cpu.py) pastes each quoted #include below in place,
// in this order, so the generated source stays self-contained; tests include this file.
//
// Everything lives in namespace hipc. Public API (all functions are inline):
//
//     float    fp16_to_fp32(uint16_t h);           uint16_t fp32_to_fp16(float f);
//     float    bf16_to_fp32(uint16_t h);           uint16_t fp32_to_bf16(float f);
//     void     quantize_row_q8a(const float* x, int K, block_q8a* y);
//     void     matmul_{q4_0,q4_1,q8_0,f32,f16,bf16}(const float* x, int T, int K,
//                                                  const void* W, int N, float* y, int ldy);
//     void     embed_row_{q4_0,q4_1,q8_0,f32,f16,bf16}(const void* W, int K, int64_t row,
//                                                     float* out);
//     void     matmul_a16_<type>(...);   // the same, int16 activations (linear_a16.h)
//     void     matmul[_a16]_lanes_{q4_0,q4_1,q5_0,q5_1,q8_0,q3_k..q6_k}(...),
//              embed_row_lanes_<type>(...); // weights in 16-row lanes (linear_lanes.h,
//                                        // linear_lanes_k.h: AVX512; the 32-blocks'
//                                        // on AVX2 too: linear_lanes_avx2.h)
//     const char* cpu_isa();
//
// Instruction sets are chosen at compile time only (no runtime dispatch); compile the
// including translation unit with -march=native (plus -fopenmp for threads):
//
//   HIPC_ISA_AVX512 : AVX512F+BW+VL+VNNI.  Integer dots with vpdpbusd: decode GEMVs
//                     work on 16 blocks of a row at once ("transposed groups"; VBMI
//                     byte permutes for Q4_0 when present, gathers otherwise), prefill
//                     GEMMs put 16 output rows in the lanes ("row lanes").
//   HIPC_ISA_AVX2   : AVX2+FMA+F16C.  One block per 256-bit register; dots with
//                     vpmaddubsw+vpmaddwd, or vpdpbusd (AVX-VNNI, __AVXVNNI__); the
//                     32-block types in row lanes as 8-row halves of the 16-row groups.
//   HIPC_ISA_SCALAR : portable C++ (correct everywhere, slow).
//
// Quantized matmuls quantize the activations x to 8 bits per 32-element block first
// (block scale d = max|x|/127, q = round(x/d), plus the block sum), exactly once per
// token row, then do int8 x {int4,int8} integer dot products per block and scale the
// block results in f32. Expect ~1e-3..1e-2 relative error versus an f32 reference; the
// dense paths (f32/f16/bf16) keep x in f32 and are exact up to f32 rounding.
//
// Threading: every matmul opens one OpenMP parallel region and splits the N output
// rows statically over the team (`omp for schedule(static)` over row tiles); call it
// from a single thread. Small problems run serially. Without -fopenmp the pragmas are
// ignored and everything runs on the calling thread.
#pragma once

// GCC's AVX-512 intrinsics start from _mm512_undefined_*(), which trips
// -W(maybe-)uninitialized once inlined; silence that for the matmul pieces (and the
// intrinsic headers isa.h pulls in) only.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

// Every hipc:: symbol is hidden: the header is compiled into many shared objects
// (each artifact's program, the tests' shims), possibly from different hipc versions,
// and one process may load several. With default visibility GCC makes inline
// variables and the static locals of inline functions (kPrep, the scratch buffers)
// STB_GNU_UNIQUE, which the dynamic linker binds process-wide to the first definition
// loaded, whatever RTLD_LOCAL says: a program then reads another version's tables.
// The system headers come first, so that libgomp's and libm's functions stay
// default-visibility references.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif
#pragma GCC visibility push(hidden)

#include "isa.h"
#include "convert.h"
#include "blocks.h"
#include "quantize_act.h"
#include "linear_vnni.h"
#include "linear_avx2.h"
#include "linear_dense.h"
#include "linear.h"
#include "embedding.h"
#include "row_ops.h"
#include "linear_a16.h"
#include "linear_vnni_k.h"
#include "linear_kquant.h"
#include "linear_lanes.h"
#include "linear_lanes_k.h"
#include "linear_lanes_avx2.h"

#pragma GCC visibility pop

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
