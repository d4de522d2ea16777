// Group-query attention with rotary embedding over a dense KV cache: one kernel for what
// com.microsoft.GroupQueryAttention does in ORT CUDA with five (rotary + cache append, sequence
// lengths, a fill, the attention and its split reduction).
//
// Dimension legend: B rows (sequences), S new tokens per row, H query heads, Hkv key/value heads
// (G = H / Hkv query heads share one), D head size, C cache capacity, P positions in the rotary tables.
//
// Layouts (GroupQueryAttention's, packed QKV, past and present in one buffer):
//   qkv      [B, S, (H + 2 Hkv) D]   fp16: q heads, then k heads, then v heads of each token
//   k_cache  [B, Hkv, C, D]          fp16 (v_cache likewise): read for positions < past, written at
//                                    the S new positions; or int8 / fp8 e4m3 codes (kv,
//                                    ../paged_attention/kv_quant.h) with
//   kv_scale [2, Hkv, D] float32     the static channel scales of K (0) and V (1), the paged op's layout
//   seqlens  [B] int32               tokens in row b after this step, minus 1
//   cos, sin [P, D / 2]              fp16 rotary tables (half-split rotation, not interleaved)
//   out      [B, S, H D]             fp16
// Row b holds past = seqlens[b] + 1 - S cached tokens; new token s sits at position past + s and
// attends causally to positions 0 .. past + s. q and k are rotated at their positions, rounded to fp16
// (what goes into the cache), scores and softmax are fp32, the output is rounded once.
//
// Options of com.microsoft.GroupQueryAttention (ORT >= 1.23 semantics, checked against ORT 1.32 CPU):
//   softcap > 0           score = softcap * tanh(scale q.k / softcap), before the mask and softmax
//                         (Gemma 2's attn_logit_softcapping)
//   local_window_size W   a query at position p attends keys p - W + 1 .. p (W keys, itself included:
//                         transformers' sliding_window, q - k < W); -1: off
// Each option is a template flag of the kernel: without them the kernels compile to what they were.
//
// Quantized caches (kv int8 / fp8 e4m3, a template flag too: fp16 caches compile to what they were): the
// new K (rotated, fp16) and V are written as codes, code = kv_encode(x, scale[h][d]) (round to nearest,
// saturate: kv_quant.h, the paged op's rounding), and every key and value the attention reads is the
// decoded one, value = code * scale, the new tokens' own included (as every later step sees them). The
// decode kernel widens codes to fp32 in its loads; K's channel scales fold into q, V's into the output
// (fp32 either way). Prompts on the tensor-core path are not taken with quantized caches: they run on
// the decode kernel (its query tiles; see attention_prefill.h).
// A window also narrows each block's key range to the window of its query tile, so key tiles wholly
// before it are never read.
//
// Head sizes 64, 128 and 256 (Gemma). At 256 a block holds at most 8 query rows (shared memory: the
// warps' R x D outputs), so at most 8 query heads per KV head, and each warp's K row is read in
// 32-dim chunks (registers).
//
// Rows whose seqlens are out of range (past < 0, or past + S beyond C or P) get NaN outputs and leave
// the cache untouched (never a plausible wrong number).
//
// Work split: a thread block takes (KV head, a tile of query tokens, row) and one of `splits` ranges
// of the keys (flash decoding). The new keys and values are read from qkv (the cache is written by the
// split-0 blocks, which nobody reads in the same launch). `splits` is sized on the host from
// total_sequence_length; each block sees how many splits its row's actual keys need (`used`, at least
// a tile per warp), and blocks beyond that return at once. With one used split, split 0 writes the
// output; with more, each writes its partial (max, sum, unnormalized output) to the workspace and
// bumps a counter, and the last of the (row, tile, head) merges the splits in split order and resets
// the counter: one kernel does it all, and the counters stay zero between calls (CUDA-graph replays
// need no memset).
//
// Prompts (S >= kPrefillMinTokens new tokens per row) take the tensor-core path instead
// (attention_prefill.h: the new K/V appended by one kernel, then FlashAttention-2-style blocks of query
// rows over double-buffered K/V tiles) when $ES_GQA_PREFILL=1 (opt-in until it has run on a GPU).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../paged_attention/kv_quant.h"

namespace enginesmith {

struct AttentionProblem {
  const __half* qkv = nullptr;
  void* k_cache = nullptr;  // [B, Hkv, C, D] fp16, or codes (kv)
  void* v_cache = nullptr;
  const int32_t* seqlens = nullptr;
  const __half* cos = nullptr;
  const __half* sin = nullptr;
  __half* out = nullptr;
  int B = 0, S = 0, H = 0, Hkv = 0, D = 0, C = 0, P = 0;
  float scale = 0.f;
  int max_total = 0;  // host-side bound of seqlens[b] + 1 (total_sequence_length): sizes the splits
  float softcap = 0.f;  // > 0: scores soft-capped (see above); 0: off
  int window = -1;      // local_window_size: > 0 keys a query sees, itself included; -1: all (causal)
  KvFormat kv = KvFormat::kNative;  // the caches' format (kv_quant.h)
  const float* kv_scale = nullptr;  // [2, Hkv, D] (quantized caches): K's, then V's channel scales
};

// What the CUDA launch needs besides the problem: its grid, and workspace sizes for splits > 1.
struct AttentionPlan {
  int rows_max = 0;      // R: query rows (token x head in group) a block holds, 4, 8 or 16
  int tile_tokens = 0;   // query tokens per block
  int tiles = 0;         // ceil(S / tile_tokens)
  int splits = 1;        // key ranges per (row, tile, head)
  size_t partial_floats = 0;  // workspace floats (splits > 1)
  size_t counters = 0;        // workspace int32 counters (splits > 1)
  bool dependent = false;     // a programmatic dependent launch (launch.cuh)
  bool prefill = false;       // the tensor-core prompt path (attention_prefill.h): no splits, no workspace
};

// Empty string when the problem is valid, else what is wrong.
const char* attention_check(const AttentionProblem& p);

// The launch shape on a device with `sms` multiprocessors.
AttentionPlan attention_plan(const AttentionProblem& p, int sms);

// Runs it on `stream`. With plan.splits > 1, `partials` and `counters` must hold plan.partial_floats
// and plan.counters; the counters zero before the first call (each call leaves them zero), and one
// workspace must not serve two launches in flight at once.
cudaError_t attention_launch(const AttentionProblem& p, const AttentionPlan& plan, float* partials,
                             int32_t* counters, cudaStream_t stream);

// CPU reference with the same semantics and rounding points (host pointers).
void attention_reference(const AttentionProblem& p);

}  // namespace enginesmith
