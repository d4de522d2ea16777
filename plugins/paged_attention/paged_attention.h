// Paged attention: attention of a few new query tokens over a KV cache kept in fixed-size pages.
//
// Dimension legend
//   B    sequences in the batch            Sq   query tokens per sequence (1 = decode, <= kMaxQueryLen)
//   H    query heads                       Hkv  key/value heads (GQA: G = H / Hkv query heads share one)
//   D    head size (kSupportedHeadSizes)   BS   tokens per page (kSupportedBlockSizes)
//   NB   pages in the pool                 MB   page slots per sequence in the block table
//   T    new tokens written by the slot mapping (usually B * Sq)
//
// Layout (all row-major, contiguous)
//   query        [B, Sq, H, D]   fp16 | bf16
//   k_cache      [NB, BS, Hkv, D] same dtype, or (fp16 only) int8 / fp8 e4m3 codes (kv_format,
//                                 kv_quant.h) with static scales k_scale / v_scale [Hkv, D]; v_cache likewise
//   block_tables [B, MB] int32   page of the sequence's i-th block of BS tokens
//   context_lens [B] int32       tokens in the cache for the sequence, the Sq new ones included
//   out          [B, Sq, H, D]
// Query token s of sequence b sits at position p = context_lens[b] - Sq + s and attends causally to the
// cache positions 0 .. p. Options (fp16 compute; a template flag of the kernel, so without them the
// kernels compile to what they were):
//   softcap > 0   score = softcap * tanh(scale q.k / softcap), before the mask and softmax (Gemma 2)
//   window W > 0  token s attends to positions p - W + 1 .. p only (W keys, itself included:
//                 transformers' sliding_window, com.microsoft.GroupQueryAttention's local_window_size).
//                 Each sequence's key range then starts at the page holding its first token's window
//                 start: pages wholly before it are not read (nor their table entries checked), and
//                 the flash-decoding splits divide that range (choose_num_splits sizes them by it).
//
// Long contexts are split across thread blocks (flash-decoding): each of num_splits blocks of a
// (sequence, KV head) reads its own range of the cache once and writes a partial output and its
// log-sum-exp to the workspace. One block serves all G query heads of its KV head and all Sq query
// tokens (rows = G*Sq, 16 per block), so each KV byte is read once. The partials are merged either
//   * by the last block to finish (ReduceMode::kLastBlock, one kernel): every block of a (sequence,
//     KV head, row block) bumps an int32 counter after writing its partial (threadfence + atomicAdd);
//     the one that sees num_splits - 1 merges all splits in split order (so the result does not
//     depend on which block came last) and resets the counter to 0. The counters are persistent:
//     the caller zeroes them once (before the first call) and every call leaves them zero, so CUDA
//     graph replays need no memset. They must not be shared by two launches in flight at once.
//   * or by a second reduce kernel (ReduceMode::kSeparateKernel, the earlier path; no counters).
//
// Bad data on the device (a page index outside [0, NB), a context length outside [Sq, MB*BS], a slot
// outside the pool) cannot be reported synchronously: the kernels write NaN to the affected outputs
// (never a plausible wrong number) and set *error_flag (if given) to a nonzero kError* bit.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "../common/status.h"
#include "kv_quant.h"

namespace enginesmith {
namespace paged_attention {

// Limits, defined once in plugins/limits.json: CMakeLists.txt compiles them in as ES_PA_* (Python
// reads the same file, plugins/limits.py; the C API reports them, es_paged_attention_limits).
#if !defined(ES_PA_HEAD_SIZES) || !defined(ES_PA_BLOCK_SIZES) || !defined(ES_PA_MAX_QUERY_LEN)
#error "ES_PA_HEAD_SIZES, ES_PA_BLOCK_SIZES, ES_PA_MAX_QUERY_LEN come from plugins/limits.json: build with plugins/CMakeLists.txt"
#endif
constexpr int kSupportedHeadSizes[] = {ES_PA_HEAD_SIZES};
constexpr int kSupportedBlockSizes[] = {ES_PA_BLOCK_SIZES};
constexpr int kMaxQueryLen = ES_PA_MAX_QUERY_LEN;  // multi-token queries: speculative verification, chunked prefill
constexpr int kMaxSplits = 256;   // flash-decoding splits per (sequence, KV head, row block)
constexpr int kRowsPerCta = 16;   // one m16 MMA tile of (query token, head in group) rows
constexpr int kMultiTiles = 4;    // m16 row tiles per block when G * Sq > kRowsPerCta (one per warp)

// (query token, head in group) rows per thread block for G * Sq rows: all G * Sq rows of a KV head
// share a block's K/V reads, up to kRowsPerCta * kMultiTiles.
constexpr int block_rows(int rows) { return rows > kRowsPerCta ? kRowsPerCta * kMultiTiles : kRowsPerCta; }
constexpr int kTileTokens = 64;   // KV tokens staged in shared memory per pipeline step
constexpr int kMinTokensPerSplit = 128;

// Error bits written to *error_flag by the kernels.
constexpr int32_t kErrorBlockTable = 1;     // a page index outside [0, NB)
constexpr int32_t kErrorContextLen = 2;     // context_lens[b] outside [Sq, MB * BS]
constexpr int32_t kErrorSlotMapping = 4;    // a slot outside [0, NB * BS) (and not -1)

// How split partials are merged (see above). kAuto: $ES_PAGED_ATTENTION_REDUCE ("single" | "two",
// read once per process; default "two": measured faster on an H200) when counters are given, else
// the reduce kernel.
enum class ReduceMode : int { kAuto = 0, kLastBlock = 1, kSeparateKernel = 2 };

struct Params {
    void const* query = nullptr;            // [B, Sq, H, D]
    void const* k_cache = nullptr;          // [NB, BS, Hkv, D]
    void const* v_cache = nullptr;          // [NB, BS, Hkv, D]
    int32_t const* block_tables = nullptr;  // [B, MB]
    int32_t const* context_lens = nullptr;  // [B]
    void* out = nullptr;                    // [B, Sq, H, D]
    float* partial_out = nullptr;           // workspace [B, Sq, H, num_splits, D]  (num_splits > 1)
    float* partial_lse = nullptr;           // workspace [B, Sq, H, num_splits]     (log2 domain)
    int32_t* error_flag = nullptr;          // optional, one int32 on the device, OR-ed with kError*
    int32_t* split_counters = nullptr;      // kLastBlock: persistent, zeroed once by the caller,
                                            // >= split_counters_needed(...) int32 (launcher checks)
    int num_split_counters = 0;             // capacity of split_counters
    ReduceMode reduce = ReduceMode::kAuto;
    int dependent_launch = -1;    // sm_90: launch the attention kernel as a programmatic dependent of the
                                  // previous kernel in the stream (it waits with griddepcontrol.wait
                                  // before reading any input). -1 or 1: on (sm_90), 0: off.
    // Fused KV write (all three set, or none): the Sq new tokens' K/V, as launch_write_kv followed by
    // attention would have it, in one kernel. new_key / new_value [B, Sq, Hkv, D] (dtype as the cache),
    // slot_mapping [B, Sq] int32: cache slot of token s of sequence b, -1 = not written (that position
    // is read from the cache as it is). The kernel reads the new positions from new_key / new_value
    // and writes them to their slots (k_cache and v_cache are then written: their const is cast
    // away). Every written slot must be its position's slot, table[p / BS] * BS + p % BS with
    // p = context - Sq + s (what a runtime that derives the mapping from the table gives); another slot,
    // or one outside the pool, is not written: the sequence's output is NaN and error_flag gets
    // kErrorSlotMapping. With a bad context length nothing of that sequence is written.
    void const* new_key = nullptr;
    void const* new_value = nullptr;
    int32_t const* slot_mapping = nullptr;
    int prefetch_past = 0;        // 1: as a dependent launch, request the past K/V tiles (positions
                                  // < context - Sq), reading the tables and lengths, before that wait.
                                  // Only when no kernel that may still run writes those (true after
                                  // launch_write_kv, a plain launch writing only the new positions;
                                  // not when a preceding kernel writes the tables or lengths).
                                  // H100: +2-3 points of copy bandwidth at batch 1, >= 8k; slower at 1k.

    int batch = 0;                // B
    int query_len = 1;            // Sq
    int num_heads = 0;            // H
    int num_kv_heads = 0;         // Hkv
    int head_size = 0;            // D
    int block_size = 0;           // BS
    int num_blocks = 0;           // NB
    int max_blocks_per_seq = 0;   // MB
    int num_splits = 0;           // 0: choose (choose_num_splits); else forced, <= kMaxSplits
    float scale = 0.f;            // softmax scale; 0 means 1/sqrt(D)
    DType dtype = DType::kFloat16;
    // Quantized pages (kv_quant.h; fp16 only): the caches and new_key / new_value hold codes, the K/V
    // loads widen them to fp16, k_scale is folded into the query and v_scale into the output.
    KvFormat kv_format = KvFormat::kNative;
    float const* k_scale = nullptr;  // [Hkv, D] float32 (quantized formats)
    float const* v_scale = nullptr;  // [Hkv, D] float32
    // Options (see above; last, so the fields before keep their offsets and the plain kernels their code).
    float softcap = 0.f;          // > 0: soft-capped scores; 0: off
    int window = -1;              // > 0: a sliding window of W keys; -1: off
};

struct WriteKVParams {
    void const* key = nullptr;             // [T, Hkv, D]
    void const* value = nullptr;           // [T, Hkv, D]
    int32_t const* slot_mapping = nullptr; // [T] page * BS + offset; -1 skips the token (padding)
    void* k_cache = nullptr;               // [NB, BS, Hkv, D]
    void* v_cache = nullptr;               // [NB, BS, Hkv, D]
    int32_t* error_flag = nullptr;         // optional
    int num_tokens = 0;                    // T
    int num_kv_heads = 0;
    int head_size = 0;
    int block_size = 0;
    int num_blocks = 0;
    DType dtype = DType::kFloat16;
};

// Shape/type checks shared by the launcher, the binding and the TensorRT wrapper. A failure says
// which value is unsupported and what is supported.
Status check_config(DType dtype, int head_size, int block_size, int num_heads, int num_kv_heads, int query_len,
    KvFormat kv_format = KvFormat::kNative);

// Resident thread-block slots for this kernel on the current GPU: SMs x blocks per SM (from the
// occupancy calculator; it depends on dtype/head size through registers and shared memory).
Status resident_slots(DType dtype, int head_size, int block_size, int* slots, KvFormat kv_format = KvFormat::kNative);

// The split count the launcher uses when Params::num_splits == 0: about one full wave of blocks
// (`slots`, from resident_slots), at least kMinTokensPerSplit tokens per split, less any trailing
// splits that whole-tile split ranges would leave empty at the table's full length. It depends only on
// host-known shapes (the block table width bounds the context; with a window W > 0, the key range
// is at most W + Sq + BS - 2 positions), so the TensorRT wrapper can size its workspace from the
// profile's maximum shapes.
int choose_num_splits(int batch, int query_len, int num_heads, int num_kv_heads, int max_blocks_per_seq,
    int block_size, int slots, int window = -1);

// Keys a sequence's blocks read with a window W > 0: from the page holding its first query token's
// window start to the context's end, at most this many (also the table's full length bound).
constexpr int window_span(int window, int query_len, int block_size) { return window + query_len + block_size - 2; }

// Workspace bytes for the partial outputs of num_splits splits (0 when num_splits <= 1). Scratch:
// its contents need not survive between calls.
size_t workspace_size(int batch, int query_len, int num_heads, int head_size, int num_splits);

// int32 split counters kLastBlock needs: one per (sequence, KV head, 16-row block), any split count.
int split_counters_needed(int batch, int query_len, int num_heads, int num_kv_heads);

// The mode kAuto resolves to when counters are given ($ES_PAGED_ATTENTION_REDUCE, read once).
ReduceMode default_reduce_mode();

// Slots assumed when sizing a workspace before the GPU is known (256 SMs x 4 blocks; an H200 has
// 132 x 2 for D = 128). Callers clamp resident_slots() to it.
constexpr int kSlotBudget = 1024;

// A workspace that fits every shape up to these maxima when the splits are chosen by
// choose_num_splits(..., min(slots, kSlotBudget)) and capped at max_splits. Used by the TensorRT
// wrapper, which must size its workspace from the profile's maximum shapes.
size_t workspace_bound(int max_batch, int max_query_len, int num_heads, int num_kv_heads, int head_size,
    int block_size, int max_blocks_per_seq, int max_splits);

// Launch attention (and, when split with kSeparateKernel, the reduce kernel) on `stream`. `workspace`
// must hold workspace_size(...) bytes for the split count in use; p.num_splits == 0 picks it from
// `slots` (<= 0: resident_slots()). With kLastBlock (or kAuto and counters given) p.split_counters
// must hold split_counters_needed(...) zeroed int32s.
Status launch_paged_attention(Params p, void* workspace, size_t workspace_bytes, int slots, cudaStream_t stream);

// Write T new tokens' K and V into the cache pages through the slot mapping.
Status launch_write_kv(WriteKVParams const& p, cudaStream_t stream);

}  // namespace paged_attention
}  // namespace enginesmith
