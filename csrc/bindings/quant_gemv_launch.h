// Launch of the packed-weight GEMV kernels (quant_gemv_launch.cu), called by the torch binding
// (quant_gemv.cpp). No torch headers here: errors come back as cudaError_t, so the binding raises them.
#pragma once

#include <cuda_runtime.h>

#include "quant_gemv/params.h"

namespace onecat_qgemv {

// Weight rows per warp R and chunks per lane and step U for the kernel template of m_tmpl activation rows.
inline int rows_per_warp(int m_tmpl) { return m_tmpl <= 2 ? 2 : 4; }

// The tensor-core GEMV (mma_gemv.cuh), SM80 and newer: W4A16 with fp16 activations and scale pairs and groups of
// 128, NVFP4, FP8 and dense weights (kDense) with fp16 or bf16 activations, MXFP4 with bf16; K a multiple of 128.
// Else cudaErrorInvalidValue.
cudaError_t launch_mma(int fmt, bool is_bf16, const Params& p, cudaStream_t stream, bool pdl);

// Launches the kernel for format fmt, activation rows m_tmpl (1, 2, 4 or 8), half (is_bf16 false) or bfloat16.
cudaError_t launch_gemv(int fmt, int m_tmpl, bool is_bf16, const Params& p, int smem, cudaStream_t stream);

}  // namespace onecat_qgemv
