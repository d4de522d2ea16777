// Batched W4A16 products on tensor cores: y[M, N] = x[M, K] · Wᵀ for 5 <= M <= kGemmQ4MaxRows, with the
// int4 weights of ORT MatMulNBits' layout (gemv.h) dequantized in registers and fed to mma.m16n8k16:
// the weights are read once, as int4, instead of dequantized into an fp16 slice that cuBLAS then reads
// (2.25x the fp16 bytes).
//
// Work split: a block of 4 warps owns 64 output columns (16 a warp: two n8 tiles) and every row of x (up
// to 4 m16 tiles), over one range of K (split-K across blockIdx.y). x's rows for a 64-wide K chunk go
// through shared memory; each lane reads 8 bytes of int4 weights (16 values of one output column) per
// chunk. The K order inside a chunk is permuted alike for x and W (a dot product does not depend on it):
// lane t of a quad holds W's values k0 + 16t .. 16t + 15, and in k16 step s feeds values 16t + 4s .. + 3 as
// the MMA's rows 2t, 2t + 1, 2t + 8, 2t + 9, so that both x and W are read in contiguous pieces.
//
// Each split writes fp32 partials [splits, M, N] (two sets with `swiglu`), and a second kernel sums them
// in split order (deterministic) and writes y as fp16 (silu(gate) * up with `swiglu`). Rows and columns
// past M and N are computed on zeros and never written.
//
// Opt-in (ES_Q4_MMA=1, read per call) until the GPU tests have run it: it was written without a GPU.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>

namespace enginesmith {

struct GemvProblem;

constexpr int kGemmQ4MaxRows = 64;

// Whether the tensor-core path takes this problem: int4, 5..kGemmQ4MaxRows rows, K a multiple of 64,
// and ES_Q4_MMA=1 in the environment.
bool gemm_q4_applies(const GemvProblem& p);

// The split-K count the launch uses, and the fp32 workspace it needs (bytes).
int gemm_q4_splits(int N, int K);
size_t gemm_q4_workspace_bytes(const GemvProblem& p);

// y = x · Wᵀ (or silu(x · Wgᵀ) * (x · Wuᵀ)) of p, reading x from `x` (the normalized rows when the caller
// folded a norm), with `workspace` of gemm_q4_workspace_bytes(p) bytes.
cudaError_t gemm_q4_launch(const GemvProblem& p, const __half* x, float* workspace, cudaStream_t stream);

}  // namespace enginesmith
