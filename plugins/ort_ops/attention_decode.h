// The dense attention op's decode kernel: its launch shape (shared by the planner, attention.cu, and
// the kernel, attention_decode.cuh) and the launcher of one instantiation group.
//
// The kernel is compiled in groups, one translation unit per (KV format, head size, variant):
// CMakeLists.txt compiles attention_decode_instance.cu once per group with ES_INSTANCE_KV / ES_INSTANCE_D /
// ES_INSTANCE_OPTIONS (as FlashAttention splits its kernels per head size), so a build uses every core.
#pragma once

#include <cstdint>

#include "attention.h"

namespace enginesmith {
namespace attention_decode {

constexpr int kKeyTile = 32;  // keys a warp scores at once (one per lane)
// Warps per block: as many as shared memory (their outputs, R x D floats each) and registers allow,
// so a few hundred keys take one tile per warp (the kernel is latency-bound at decode sizes).
// Head size 256: R <= 8 (R x D floats per warp) with 8 warps at R = 4, 4 at R = 8.
__host__ __device__ constexpr int warps_for(int D, int R) {
  return D == 64 && R == 4 ? 16 : D == 128 && R == 16 ? 4 : D == 256 && R == 8 ? 4 : 8;
}
// Most query rows a block holds at head size D.
__host__ __device__ constexpr int max_rows(int D) { return D == 256 ? 8 : 16; }
// At least a tile per warp in a split.
__host__ __device__ constexpr int min_keys_per_split(int D, int R) { return warps_for(D, R) * kKeyTile; }
constexpr int kMaxSplits = 64;

// Launches the decode kernel for problems of KV format KV and head size D, the variant that reads the
// options (soft-capping, windows) or the plain one (common/plain_variants.h), at the plan's rows per block.
// Defined in attention_decode.cuh, instantiated per group.
template <KvFormat KV, int D, bool kOptions>
cudaError_t launch(const AttentionProblem& p, const AttentionPlan& plan, float* partials, int32_t* counters,
                   cudaStream_t stream);

}  // namespace attention_decode
}  // namespace enginesmith
