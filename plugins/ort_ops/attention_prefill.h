// The prompt path of GroupQueryAttention (attention.h) on tensor cores, FlashAttention-2 style: calls
// with S >= kPrefillMinTokens new tokens per row. Decode and short calls keep attention.cu's kernel.
//
// Dimension legend (attention.h's): B rows, S new tokens per row, H query heads, Hkv KV heads,
// G = H / Hkv, D head size (64, 128, 256), C cache capacity, BM query rows per block, BN keys per tile.
//
// Two launches on the stream (the second a programmatic dependent of the first on sm_90+):
//
//   qkv ──append_kv──▶ k_cache, v_cache at positions past .. past + S - 1 (new k rotated, fp16)
//   qkv ──prefill_kernel: one block per (KV head g, block of BM query rows, row b)
//          Q rows of the block (row r = token t x head i of the group: r = t G + i, so the G heads that
//          share a KV head share every K/V tile the block loads), rotated into shared memory
//          for each BN-key tile of [first key its first token sees, last key its last token sees]:
//            cache ──cp.async──▶ smem K/V tile (double-buffered: tile j + 1 loads while j computes)
//            S[16 rows x BN] = Q·Kᵀ      (mma.sync m16n8k16 fp16, fp32 accumulators; K by ldmatrix)
//            causal / window mask (only tiles that cross a row's limits), softcap
//            online softmax per row (running max m and sum l, exp2 domain)
//            O[16 rows x D] += P·V       (P from the S registers as fp16, V by ldmatrix.trans)
//          each of the 4 warps owns 16 x kMT rows over all keys: O / l ──smem──▶ out (16-byte stores)
//
// Quantized caches (int8 / fp8 codes, attention.h) are not taken here: their prompts run on attention.cu's
// kernel, which reads codes in its loads for any S. Its cp.async tiles copy fp16 bytes as they are; codes
// would need a register-staged widen-and-store per tile (K's scales into Q, V's into the output), which
// is left until this opt-in path has run on a GPU at all.
//
// Numerics: q and k are rotated and rounded to fp16 as the decode kernel and the CPU reference do; scores,
// softmax and the output sums are fp32; P is rounded to fp16 for the P·V product (FlashAttention's
// rounding point); the output is rounded once.
// Rows whose seqlens are out of range (attention.h) get NaN outputs and an untouched cache. Keys outside
// a block's range (before its window, at or after its last token) are never read: their tile rows are
// zero-filled.
#pragma once

#include <cuda_runtime.h>

#include "attention.h"

namespace enginesmith {

// Calls with fewer new tokens per row take attention.cu's kernel (a prompt of a few tokens, a
// speculative verification, decode): a 16-row tensor-core tile would be mostly padding.
constexpr int kPrefillMinTokens = 64;

// Whether the tensor-core prompt path takes `p`: S >= kPrefillMinTokens, a head size it is built for,
// fp16 caches, and $ES_GQA_PREFILL is not "0" (read per call, so a test or benchmark can compare both paths in one
// process).
bool prefill_applies(const AttentionProblem& p);

// Runs the prompt path on `stream` (the problem checked by attention_check and prefill_applies).
// `dependent`: programmatic dependent launches (launch.cuh).
cudaError_t attention_prefill_launch(const AttentionProblem& p, bool dependent, cudaStream_t stream);

}  // namespace enginesmith
