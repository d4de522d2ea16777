// Paged group-query attention with rotary embedding: GroupQueryAttention (attention.h) over a KV cache
// kept in pages (plugins/paged_attention), for the GPU in-flight-batching engine.
//
// Dimension legend: B rows (sequences), S new tokens (columns) per row, H query heads, Hkv key/value
// heads (G = H / Hkv), D head size (64, 128, 256: plugins/limits.json), NB pages in the pool, BS tokens
// per page, MB page slots per row in the block table, P positions in the rotary tables, W window.
//
// Layouts:
//   qkv          [B, S, (H + 2 Hkv) D]  fp16: q heads, then k heads, then v heads of each token
//   key_pool     [NB, BS, Hkv, D]       fp16 (value_pool likewise), written in place; or int8 / fp8 e4m3
//                                       codes (kv, ../paged_attention/kv_quant.h) with
//   kv_scale     [2, Hkv, D] float32    the static channel scales of K (0) and V (1)
//   block_tables [B, MB] int32          page of row b's i-th block of BS positions (0: the null page)
//   context_lens [B] int32              tokens in row b's cache after this step
//   slot_mapping [B, S] int32           cache slot of column s (table[p / BS] * BS + p % BS), -1: a
//                                       padding column (not written)
//   cos, sin     [P, D / 2] fp16        rotary tables (half-split rotation, rotary.cuh)
//   out          [B, S, H D] fp16
// Column s of row b sits at position p = context_lens[b] - S + s. Its q and k are rotated at p and
// rounded to fp16 (that k goes into the cache, encoded with its scale when quantized: the value the
// column then attends to is the decoded one, as every later column sees it); the new K/V of non-padding columns are written to
// their slots; each column attends causally to positions 0 .. p of its row (through the block
// table). Scores and softmax are fp32; the output is rounded once. Options, as the dense op's
// (attention.h, com.microsoft.GroupQueryAttention's):
//   softcap > 0   score = softcap * tanh(scale q.k / softcap), before the mask and softmax
//   window W > 0  (local_window_size) column s attends to positions p - W + 1 .. p only; the row's
//                 table entries are read (and checked) from the page holding p0 - W + 1 on, p0 the
//                 first column's position: pages wholly before it are never read.
// Padding columns sit right of the
// real ones (the runtime pads on the right): real columns never see them; their own outputs are
// unspecified (the reference writes zeros).
//
// Bad data on the device (paged_attention.h's rule: NaN outputs, never a plausible wrong number):
//   context_lens[b] outside [S, MB * BS], or a real column at a position >= P   row NaN, nothing written
//   a block-table entry of a position < context_lens[b] outside [0, NB)        row NaN
//     (with a window: of a position in the pages read, see above)
//   a slot that is not its position's slot (or outside the pool)               row NaN, that slot not written
// The pool must hold finite values at every position a row's context covers, with a window in the
// pages read (the kernel weighs the masked ones, padding positions included, by an exact 0).
//
// CUDA path, two kernels on one stream, no host sync (capturable in a CUDA graph):
//
//   qkv, cos/sin, context_lens, slot_mapping
//     └─ rotary_split_kernel ─▶ scratch q [B,S,H,D], k [B,S,Hkv,D] (rotated), v [B,S,Hkv,D] (k, v
//                               encoded when the pools are quantized: the fused write copies codes),
//                               lens [B] (context_lens; 0 for a row whose real columns leave the tables)
//          └─ paged_attention::launch_paged_attention (fused KV write through slot_mapping, splits)
//               ─▶ out, key_pool / value_pool at the new slots
//
// The scratch and the split workspace are one buffer of PagedGqaPlan::scratch_bytes; the split
// counters (last-block merge) are zeroed once by the caller and left zero by every call.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "../common/status.h"
#include "../paged_attention/kv_quant.h"

namespace enginesmith {

struct PagedGqaProblem {
  const __half* qkv = nullptr;           // [B, S, (H + 2 Hkv) D]
  void* key_pool = nullptr;              // [NB, BS, Hkv, D] fp16, or codes (kv)
  void* value_pool = nullptr;            // [NB, BS, Hkv, D]
  const int32_t* block_tables = nullptr; // [B, MB]
  const int32_t* context_lens = nullptr; // [B]
  const int32_t* slot_mapping = nullptr; // [B, S]
  const __half* cos = nullptr;           // [P, D / 2]
  const __half* sin = nullptr;           // [P, D / 2]
  __half* out = nullptr;                 // [B, S, H D]
  int B = 0, S = 0, H = 0, Hkv = 0, D = 0, NB = 0, BS = 0, MB = 0, P = 0;
  float scale = 0.f;  // softmax scale, > 0 (the op resolves its attribute's 0 to 1 / sqrt(D))
  float softcap = 0.f;  // > 0: scores soft-capped (see above); 0: off
  int window = -1;      // local_window_size: > 0 keys a column sees, itself included; -1: all (causal)
  KvFormat kv = KvFormat::kNative;       // the pools' format (kv_quant.h)
  const float* kv_scale = nullptr;       // [2, Hkv, D] (quantized pools): K's, then V's channel scales
};

// Empty when the problem is valid (paged_attention's check_config: head size, page size, S), else
// what is wrong.
std::string paged_gqa_check(const PagedGqaProblem& p);

// The CUDA launch's split count and buffer sizes.
struct PagedGqaPlan {
  int splits = 1;               // flash-decoding splits (paged_attention::choose_num_splits)
  size_t scratch_bytes = 0;     // q, k, v, lens and the split workspace
  int counters = 0;             // int32 split counters (zeroed once by the caller)
  bool dependent = false;       // programmatic dependent launches (launch.cuh); the caller sets it
};

// The plan for this device (it asks the occupancy calculator once per head and page size: call it
// first outside a CUDA-graph capture). `batch_invariant`: split the keys as a call of one row and one
// token would, so a row's sums do not depend on B or S.
Status paged_gqa_plan(const PagedGqaProblem& p, PagedGqaPlan* plan, bool batch_invariant = false);

// Runs it on `stream`. `scratch` holds plan.scratch_bytes (16-byte aligned); `counters` plan.counters
// int32s, zero before the first call (each call leaves them zero); one scratch must not serve two
// launches in flight at once.
Status paged_gqa_launch(const PagedGqaProblem& p, const PagedGqaPlan& plan, void* scratch, int32_t* counters,
                        cudaStream_t stream);

// CPU reference with the same semantics, bad-data rule and rounding points (host pointers; the pools
// are updated in place).
void paged_gqa_reference(const PagedGqaProblem& p);

}  // namespace enginesmith
