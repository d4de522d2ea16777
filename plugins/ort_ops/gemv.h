// Weight-streaming GEMV for decode: y[M, N] = x[M, K] · Wᵀ with W stored one output row after another
// ([N, K], K contiguous), for small M (decode, speculative verify). Weights are fp16, or int4 in
// ORT MatMulNBits' layout (blocks of `block_size` along K, two values a byte, low nibble first,
// symmetric: value = (q - 8) * scale, one fp16 scale per row and block).
//
// With `swiglu`, two weight matrices (gate, up) share x and the result is silu(x·Wgᵀ) * (x·Wuᵀ):
// the MLP's first half in one pass over both matrices, no intermediate in memory.
//
// With `gamma`, the RMSNorm before the product is folded in (the decoder's norms: one kernel less per
// norm): each row of x is first replaced by
//     s = x (+ skip);  xn = fp16(fp16(s) * rsqrt(mean(s²) + eps) * gamma)      (s and the mean in fp32)
// and with `skip` the residual sum fp16(s) is also written to `sum_out` (the next residual).
//
// The kernels are programmatic dependent launches (sm_90+): they issue their first weight loads,
// which depend on no earlier kernel, before waiting for the kernel that produces x.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace enginesmith {

struct GemvProblem {
  const __half* x = nullptr;       // [M, K]
  __half* y = nullptr;             // [M, N]
  int M = 0, N = 0, K = 0;
  bool q4 = false;                 // W is int4 (MatMulNBits layout) instead of fp16
  bool swiglu = false;             // two weights: gate (index 0), up (index 1)
  const void* w[2] = {nullptr, nullptr};          // fp16 [N, K], or uint8 [N, K / block_size, block_size / 2]
  const __half* scales[2] = {nullptr, nullptr};   // int4 only: [N, K / block_size]
  int block_size = 0;              // int4 only: 32, 64, 128 or 256
  const __half* gamma = nullptr;   // [K]: fold an RMSNorm of x into the product (see above)
  const __half* skip = nullptr;    // [M, K]: with gamma, normalize x + skip
  __half* sum_out = nullptr;       // [M, K]: with skip, where x + skip goes
  float eps = 1e-5f;
};

// Largest M one launch reads the weights once for; larger M runs in chunks of this many rows.
constexpr int kGemvMaxRows = 4;

// Empty string when the problem is valid for the kernels, else what is wrong.
const char* gemv_check(const GemvProblem& p);

// At a kernel's creation (outside any CUDA-graph capture): reads whether the device takes
// programmatic dependent launches (sm_90+; ES_ORT_OPS_PDL=0 at session creation turns them off for the
// launches from then on).
void gemv_prepare();

// Runs the problem on `stream` (any M: rows beyond kGemvMaxRows go in chunks). Returns the launch error.
cudaError_t gemv_launch(const GemvProblem& p, cudaStream_t stream);

// Writes the normalized rows of p.x (and p.sum_out, see above) to xn [M, K]: the norm of a fused op
// whose product runs elsewhere (cuBLAS).
cudaError_t rmsnorm_launch(const GemvProblem& p, __half* xn, cudaStream_t stream);

// w[N, K] fp16 = int4 weights of MatMulNBits' layout, dequantized (for calls that run a GEMM).
cudaError_t dequant_q4(const void* packed, const __half* scales, __half* w, int N, int K, int block_size,
                       cudaStream_t stream);

// gate_out[i] = silu(gate_out[i]) * up[i]: the SwiGLU epilogue for calls that ran two GEMMs.
cudaError_t swiglu_combine(__half* gate_out, const __half* up, size_t count, cudaStream_t stream);

// CPU reference with the same semantics (fp32 accumulation), for the CPU EP and for tests.
void gemv_reference(const GemvProblem& p);

}  // namespace enginesmith
