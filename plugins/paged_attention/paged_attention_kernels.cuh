// Paged attention kernels (layer 1 of 4: kernel -> launcher -> dispatch -> TensorRT wrapper).
// Legend and layouts: paged_attention.h.
//
// One thread block = (split, KV head, 16-row block of the G*Sq query rows, sequence).
//
//   cache pages ──cp.async──▶ smem K/V tile [64 tokens][D] (kStages in flight)
//        warp w takes tokens 16w..16w+15 of the tile:
//          S[16 rows x 16 tok] = Q·Kᵀ   (mma m16n8k16, K via ldmatrix)
//          online softmax (running max m, sum l per row, exp2 domain)
//          O[16 x D] += P·V            (P reused from S registers, V via ldmatrix.trans)
//   end: merge the 4 warps' (m, l, O) in smem ─▶ out (1 split) | partial out + lse (n splits)
//   split merge, out = Σ_i 2^(lse_i - M) · o_i / Σ_i 2^(lse_i - M), either
//     kLastBlock: threadfence + atomicAdd on the (sequence, KV head, row block) counter; the block
//       that sees num_splits - 1 resets it and merges all splits (merge_splits: a warp per row,
//       split order), or
//     kSeparateKernel: the reduce kernel (sm_90+: a programmatic dependent of the split kernel).
//   fused KV write (Params::slot_mapping): the Sq new tokens' K/V come from new_key / new_value (rows
//     fetched before the tile copies) and row block 0 of their split stores them at their slots.
//   sm_90+: the split kernel starts with griddepcontrol.wait, so it may itself be launched as a
//   programmatic dependent of whatever kernel precedes it (its launch overlaps that kernel's tail).
//   quantized pages (KV = kInt8 | kFp8E4M3, fp16 only; kv_quant.h): the codes are staged as bytes
//     (8-byte cp.async: a thread copies the same token rows and columns as for fp16; decode blocks
//     keep one more stage in flight), and each thread widens the rows it copied to fp16 in a one-tile K/V buffer right
//     after its wait, before the step's barrier; the MMAs then run as for fp16. The K scales are
//     folded into the query registers, the V scales into the output: no per-element multiply.
//       pages ──cp.async 8 B──▶ smem codes [stages][64][D] ──widen──▶ smem fp16 K/V tile [64][D+8]
//   The native path is the same template with KV = kNative: the quantized steps compile away.
//   options (kExt: Params::softcap, Params::window; off, the kernel compiles to the plain one): the
//     scores are soft-capped before the mask; a window moves the sequence's key range [lo, ctx) to
//     start at the page of its first token's window start (the splits divide that range) and masks
//     each row's keys below its own window as the causal limit masks those above.
//   D = 256 (Gemma): the same kernel, at one block an SM (shared memory) and with register spills
//     (sm_90: 12-104 bytes a thread at kMT = 1, 124-268 at kMT = 4): slower per byte than D = 64 /
//     128, not tuned.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../common/mma.cuh"
#include "paged_attention.h"

namespace enginesmith {
namespace paged_attention {
namespace detail {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
#ifndef ES_PAGED_ATTENTION_STAGES
#define ES_PAGED_ATTENTION_STAGES 3  // 2 ran ~76 % of copy bandwidth at batch 64 on an H200, 3 ran ~90 %
#endif
constexpr int kStages = ES_PAGED_ATTENTION_STAGES;  // K/V tiles in flight per block (cp.async pipeline)
constexpr float kLog2e = 1.4426950408889634f;

// Shared-memory row stride in elements: +8 elements (16 B) puts the 8 rows an ldmatrix reads in
// 8 different bank groups.
template <int D>
__host__ __device__ constexpr int smem_stride() { return D + 8; }

// K/V tiles in flight: quantized tiles are half the bytes, so decode blocks (kMT = 1) get one more
// stage at about the same shared memory (D = 128: 102 KiB against fp16's 106 KiB, two blocks an SM
// either way); kMT > 1 blocks, which also hold 64 Q rows and the fp16 tile, keep kStages (99 KiB; one
// more would leave one block an SM, and resident_slots, the split count, takes the lower variant).
template <KvFormat KV, int kMT>
__host__ __device__ constexpr int stages() { return kv_quantized(KV) && kMT == 1 ? kStages + 1 : kStages; }

// Native: kMT = 1: a separate Q buffer of 16 rows; kMT > 1: Q (16 * kMT <= kTileTokens rows) is staged
// in the last K stage and moved to registers before the pipeline first refills that stage.
// Quantized: Q [16 kMT rows], the fp16 K/V tile [2][kTileTokens] rows, then the code stages (bytes).
template <typename T, int D, int kMT, KvFormat KV = KvFormat::kNative>
__host__ __device__ constexpr size_t smem_bytes() {
    if constexpr (kv_quantized(KV)) {
        return static_cast<size_t>(kRowsPerCta * kMT + 2 * kTileTokens) * smem_stride<D>() * sizeof(T) +
               static_cast<size_t>(2 * stages<KV, kMT>() * kTileTokens) * D;
    } else {
        return static_cast<size_t>((kMT == 1 ? kRowsPerCta : 0) + 2 * kStages * kTileTokens) * smem_stride<D>() * sizeof(T);
    }
}

// 8-byte global->shared copy of codes (cp.async.ca: .cg takes 16 bytes only); !valid zero-fills.
__device__ __forceinline__ void cp_async_8(uint32_t smem, void const* gmem, bool valid = true) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem), "l"(gmem), "r"(valid ? 8 : 0));
}

// Eight codes (one 8-byte chunk) widened to eight fp16 values (one 16-byte chunk), exactly.
template <KvFormat KV>
__device__ __forceinline__ uint4 widen_codes(uint2 codes) {
    uint4 out;
    uint32_t* o = reinterpret_cast<uint32_t*>(&out);
    if constexpr (KV == KvFormat::kInt8) {
        // 0x6400 | u is the fp16 1024 + u: bias the codes by 128 into bytes u, place them, subtract 1152.
        const __half2 bias = __floats2half2_rn(1152.f, 1152.f);
#pragma unroll
        for (int w = 0; w < 2; ++w) {
            const uint32_t u = (w == 0 ? codes.x : codes.y) ^ 0x80808080u;
            uint32_t lo = __byte_perm(u, 0x64646464u, 0x5140), hi = __byte_perm(u, 0x64646464u, 0x7362);
            __half2 l = __hsub2(*reinterpret_cast<__half2*>(&lo), bias), h = __hsub2(*reinterpret_cast<__half2*>(&hi), bias);
            o[2 * w] = *reinterpret_cast<uint32_t*>(&l);
            o[2 * w + 1] = *reinterpret_cast<uint32_t*>(&h);
        }
    } else {
#pragma unroll
        for (int w = 0; w < 2; ++w) {
            const uint32_t u = w == 0 ? codes.x : codes.y;
            const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(u & 0xffffu), __NV_E4M3);
            const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(u >> 16), __NV_E4M3);
            o[2 * w] = uint32_t(lo.x) | (uint32_t(lo.y) << 16);
            o[2 * w + 1] = uint32_t(hi.x) | (uint32_t(hi.y) << 16);
        }
    }
    return out;
}

// Split merge, shared by the reduce kernel and the last-block path. The splits i = first, first +
// stride, ... of one output row, merged online by one warp in split order: m (running max of the
// log-sum-exps, log2 domain), sum = Σ 2^(lse_i - m), acc[v] = Σ 2^(lse_i - m) · o_i[lane * V + v].
// A warp loads the lse and partial outputs of kChunk of its splits together (one L2 round trip per
// chunk; the partials were written by other SMs: read through L2). Empty splits (lse = -inf)
// weigh 0; a NaN lse (bad data) sets *any_nan. Kept small on purpose: the earlier last-block merge,
// fully unrolled over 32 float4 loads a thread, ran ~25 us per call on an H100 (ncu: warps stalled
// fetching instructions, i.e. instruction-cache misses of one block running a long cold code path).
struct alignas(16) Float8 {
    float4 lo, hi;
};

template <int D>
struct MergeVec {
    static constexpr int V = D / 32;  // floats per lane
    static_assert(V == 2 || V == 4 || V == 8, "the split merge handles D = 64, 128 or 256");
    using Type = typename std::conditional<V == 8, Float8, typename std::conditional<V == 4, float4, float2>::type>::type;
};

// A lane's V floats of a partial, through L2.
__device__ __forceinline__ float2 load_cg(float2 const* p) { return __ldcg(p); }
__device__ __forceinline__ float4 load_cg(float4 const* p) { return __ldcg(p); }
__device__ __forceinline__ Float8 load_cg(Float8 const* p) { return Float8{__ldcg(&p->lo), __ldcg(&p->hi)}; }

template <int D, int kChunk>
__device__ __forceinline__ void merge_split_range(Params const& p, size_t row, int num_splits, int first, int stride,
    int lane, float& m, float& sum, float (&acc)[MergeVec<D>::V], int& any_nan) {
    constexpr int V = MergeVec<D>::V;
    using Vec = typename MergeVec<D>::Type;
    float const* lse = p.partial_lse + row * num_splits;
    float const* po = p.partial_out + row * num_splits * D + lane * V;
    m = -INFINITY;
    sum = 0.f;
#pragma unroll
    for (int v = 0; v < V; ++v) acc[v] = 0.f;
    any_nan = 0;
    for (int base = first; base < num_splits; base += stride * kChunk) {
        float x[kChunk];
        Vec o[kChunk];
#pragma unroll
        for (int u = 0; u < kChunk; ++u) {
            const int i = base + u * stride;
            if (i < num_splits) {
                x[u] = __ldcg(lse + i);
                o[u] = load_cg(reinterpret_cast<Vec const*>(po + static_cast<size_t>(i) * D));
            } else {
                x[u] = -INFINITY;  // weight 0
            }
        }
        float cm = m;
#pragma unroll
        for (int u = 0; u < kChunk; ++u) {
            any_nan |= isnan(x[u]);
            cm = fmaxf(cm, x[u]);  // fmaxf ignores a NaN; the flag poisons the row
        }
        if (cm == -INFINITY) continue;  // only empty splits so far
        const float alpha = exp2f(m - cm);  // 0 while m = -inf
        sum *= alpha;
#pragma unroll
        for (int v = 0; v < V; ++v) acc[v] *= alpha;
#pragma unroll
        for (int u = 0; u < kChunk; ++u) {
            if (!(x[u] > -INFINITY)) continue;  // empty split, padding, or NaN (flagged)
            const float w = exp2f(x[u] - cm);
            sum += w;
            if constexpr (V == 8) {
                float4 const h[2] = {o[u].lo, o[u].hi};
#pragma unroll
                for (int q = 0; q < 2; ++q) {
                    acc[4 * q] += w * h[q].x;
                    acc[4 * q + 1] += w * h[q].y;
                    acc[4 * q + 2] += w * h[q].z;
                    acc[4 * q + 3] += w * h[q].w;
                }
            } else {
                acc[0] += w * o[u].x;
                acc[1] += w * o[u].y;
                if constexpr (V == 4) {
                    acc[2] += w * o[u].z;
                    acc[3] += w * o[u].w;
                }
            }
        }
        m = cm;
    }
}

// Last block of a (sequence, KV head, row block): merge the num_splits partials of its nrows rows
// into out, a warp per row, each split merged in split order (the result does not depend on which
// block came last); 16 splits a round trip.
template <typename T, int D>
__device__ __forceinline__ void merge_splits(Params const& p, int const* s_out_row, int num_splits, int nrows) {
    constexpr int V = MergeVec<D>::V;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int r = warp; r < nrows; r += kWarps) {
        const size_t row = static_cast<size_t>(s_out_row[r]);
        float m, sum, acc[V];
        int any_nan;
        merge_split_range<D, 16>(p, row, num_splits, 0, 1, lane, m, sum, acc, any_nan);
        const float inv = sum > 0.f ? 1.f / sum : 0.f;  // all splits empty: zeros
        const bool nan = __any_sync(0xffffffff, any_nan);
        T* dst = static_cast<T*>(p.out) + row * D + lane * V;
#pragma unroll
        for (int v = 0; v < V; v += 2) {
            const float a = nan ? __int_as_float(0x7fc00000) : acc[v] * inv;
            const float c = nan ? __int_as_float(0x7fc00000) : acc[v + 1] * inv;
            *reinterpret_cast<uint32_t*>(dst + v) = ptx::pack2<T>(a, c);
        }
    }
}

// kMT: m16 row tiles per block. 1 (decode, G * Sq <= 16): the four warps split each K/V tile's 64
// tokens (16 each) for the block's 16 rows and are merged at the end. kMultiTiles (G * Sq > 16:
// speculative verification, chunked prefill): warp w owns rows 16w..16w+15 and runs all 64 tokens of
// every tile, so the 64 rows share one read of the K/V (before, each 16-row block re-read them).
// kExt: soft-capping and the sliding window (Params::softcap, Params::window, each on when > 0).
template <typename T, int D, int BS, int kMT, KvFormat KV = KvFormat::kNative, bool kExt = false>
__global__ void __launch_bounds__(kThreads) paged_attention_kernel(Params p, int row_blocks) {
    static_assert(kMT == 1 || kMT == kWarps, "one row tile per block, or one per warp");
    constexpr bool kQuant = kv_quantized(KV);
    static_assert(!kQuant || std::is_same<T, __half>::value, "quantized pages are widened to fp16");
    using C = typename std::conditional<kQuant, uint8_t, T>::type;  // cache element: a value or a code
    using Chunk = typename std::conditional<kQuant, uint2, uint4>::type;  // 8 cache elements
    constexpr int kSt = stages<KV, kMT>();
    static_assert(kRowsPerCta * kMT <= kTileTokens, "kMT > 1 stages Q in one K stage");
    constexpr int kRows = kRowsPerCta * kMT;  // (query token, head in group) rows of this block
    static_assert(D % 16 == 0 && D <= 256, "head size must be a multiple of 16, at most 256");
    static_assert(kTileTokens % BS == 0, "a tile must cover whole pages");
    static_assert(kWarps * 16 == kTileTokens, "each warp takes 16 tokens of a tile");
    // The epilogue reuses the K stages as a float [kWarps][16][kOStride] merge buffer. Its rows are
    // padded by 8 floats: a warp's float2 stores (8 rows x 4 column pairs) then fall into distinct bank
    // groups (unpadded, the 8 rows shared 2 banks: 8-way conflicts, ~0.5 us per block on an H200).
    constexpr int kOStride = D + 8;
    static_assert(kWarps * kRowsPerCta * kOStride * sizeof(float) <=
                      (kQuant ? 2 : kStages) * kTileTokens * smem_stride<D>() * sizeof(T),
        "merge buffer does not fit in the K stages (quantized: the fp16 K/V tile)");
    constexpr int kStride = smem_stride<D>();
    constexpr int kChunks = D / 8;  // 8-element chunks per token row of one head (16 bytes; codes: 8)
    // Staged row stride in bytes (codes: unpadded, the widening reads are conflict-free).
    constexpr int kStageRowBytes = kQuant ? D : kStride * static_cast<int>(sizeof(T));

    extern __shared__ __align__(16) unsigned char smem_raw[];
    // Native: the staged tiles are the MMA's operands. Quantized: Q, the fp16 tile (sK, sV: one stage),
    // then the staged codes (cK, cV: [kSt][kTileTokens][D] bytes).
    T* sK = reinterpret_cast<T*>(smem_raw) + (kMT == 1 || kQuant ? kRowsPerCta * kMT * kStride : 0);
    T* sV = sK + (kQuant ? 1 : kStages) * kTileTokens * kStride;
    T* sQ = kMT == 1 || kQuant ? reinterpret_cast<T*>(smem_raw) : sK + (kStages - 1) * kTileTokens * kStride;
    unsigned char* cK = kQuant ? reinterpret_cast<unsigned char*>(sV + kTileTokens * kStride)
                               : reinterpret_cast<unsigned char*>(sK);
    unsigned char* cV = kQuant ? cK + kSt * kTileTokens * D : reinterpret_cast<unsigned char*>(sV);
    constexpr int kStageBytes = kTileTokens * kStageRowBytes;  // one staged tile of K (or V)
    __shared__ int s_bad;
    __shared__ int s_bad_slot;              // fused write: a slot not at its position (or outside the pool)
    __shared__ int s_slot[kMaxQueryLen];    // fused write: checked slot of each new token, -1 = from the cache
    __shared__ float s_m[kWarps][kRowsPerCta];
    __shared__ float s_l[kWarps][kRowsPerCta];
    __shared__ float s_row_max[kRows];
    __shared__ float s_row_sum[kRows];
    __shared__ int s_out_row[kRows];  // (b, s, h) output row of each of this block's rows
    __shared__ int s_last;

    // prefetch_past: the kernels still running when this one starts (it is a programmatic dependent
    // of the previous kernel) write neither the lengths, the tables nor the cache's past positions
    // (< context - Sq); so those tiles are requested before the wait and stream in while the
    // previous kernel drains. Everything else (the query, the Sq new positions) is read after it.
    const bool prefetch = p.prefetch_past != 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // When launched as a programmatic dependent of the previous kernel (which may have written the
    // query, the caches, the tables or the lengths), wait for it before the first global read (with
    // prefetch_past: before the first read of anything but the above); a no-op otherwise. Then let
    // our own dependent (the reduce kernel, or the next kernel) be scheduled; it waits for this whole
    // grid before reading anything.
    if (!prefetch) asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    const int split = blockIdx.x;
    const int num_splits = gridDim.x;
    const int kvh = blockIdx.y / row_blocks;
    const int row0 = (blockIdx.y % row_blocks) * kRows;
    const int b = blockIdx.z;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int group = p.num_heads / p.num_kv_heads;  // G
    const int rows_total = group * p.query_len;      // G * Sq
    const int Hkv = p.num_kv_heads;

    if (threadIdx.x == 0) s_bad = s_bad_slot = 0;
    if (threadIdx.x < kRows) {
        const int row = row0 + threadIdx.x;
        s_out_row[threadIdx.x] =
            row < rows_total ? (b * p.query_len + row / group) * p.num_heads + kvh * group + row % group : 0;
    }

    T const* query = static_cast<T const*>(p.query);
    C const* k_cache = static_cast<C const*>(p.k_cache);
    C const* v_cache = static_cast<C const*>(p.v_cache);
    C const* new_key = static_cast<C const*>(p.new_key);
    C const* new_value = static_cast<C const*>(p.new_value);
    const bool fused = p.slot_mapping != nullptr;  // fused KV write (paged_attention.h)
    int32_t const* table = p.block_tables + static_cast<size_t>(b) * p.max_blocks_per_seq;

    // Q rows of this block: row r = s * G + g  ->  query[b, s, kvh * G + g, :]; padding rows are zero.
    auto load_query = [&]() {
        for (int i = threadIdx.x; i < kRows * kChunks; i += kThreads) {
            const int r = i / kChunks, c = i % kChunks;
            const int row = row0 + r;
            const bool valid = row < rows_total;
            T const* src = query;
            if (valid) {
                const int s = row / group, g = row % group;
                src = query + ((static_cast<size_t>(b) * p.query_len + s) * p.num_heads + kvh * group + g) * D + c * 8;
            }
            ptx::cp_async_16(sQ + r * kStride + c * 8, src, valid);
        }
    };
    // Without prefetch, Q first (its own cp.async group): its load overlaps the context-length read
    // the K/V addresses depend on. With prefetch, Q follows the prefetched tiles (after the wait).
    if (!prefetch) {
        load_query();
        ptx::cp_async_commit();
    }

    // The block-table entries of tile `tile` of the split range [begin, end): its kPagesPerTile pages
    // (a tile starts on a page: split ranges and the tile size are multiples of BS). Read ahead of the
    // tile's copies (see the pipeline below), so no tile's table read sits between two data requests:
    // before, each tile's copies waited for its own table read, one L2 round trip per tile in series.
    constexpr int kPagesPerTile = kTileTokens / BS;
    constexpr int kTokensPerIter = kThreads / kChunks;  // token rows one pass of the block covers
    static_assert(BS % kTokensPerIter == 0, "a pass of the block must stay within one page");
    auto read_pages = [&](int begin, int end, int tile, int (&pages)[kPagesPerTile]) {
        const int t0 = begin + tile * kTileTokens;
#pragma unroll
        for (int j = 0; j < kPagesPerTile; ++j) pages[j] = t0 + j * BS < end ? __ldg(table + t0 / BS + j) : 0;
    };
    const int ctx = p.context_lens[b];
    const bool bad_ctx = ctx < p.query_len || ctx > p.max_blocks_per_seq * BS;
    const int ctx_eff = bad_ctx ? 0 : ctx;
    // The sequence's key range [lo, ctx_eff): all of it, or (window) from the page holding its first
    // token's window start. This split's range [t_begin, t_end): whole tiles of it except the last.
    const int window = kExt && p.window > 0 ? p.window : 0;
    const int lo = window > 0 ? max(0, ctx_eff - p.query_len - window + 1) / BS * BS : 0;
    int per_split = (ctx_eff - lo + num_splits - 1) / num_splits;
    per_split = (per_split + kTileTokens - 1) / kTileTokens * kTileTokens;
    const int t_begin = lo + split * per_split;
    const int t_end = min(ctx_eff, t_begin + per_split);
    const int num_tiles = t_end > t_begin ? (t_end - t_begin + kTileTokens - 1) / kTileTokens : 0;
    __syncthreads();

    // The table entries of the prologue's tiles and of the first tile the loop issues, read together.
    int pro_pages[kSt - 1][kPagesPerTile];
    int next_pages[kPagesPerTile];
#pragma unroll
    for (int i = 0; i < kSt - 1; ++i) read_pages(t_begin, t_end, i, pro_pages[i]);
    read_pages(t_begin, t_end, kSt - 1, next_pages);

    // The new positions are [new_begin, ctx_eff). With prefetch the prologue copies its tiles' past
    // rows [t_begin, past_end) before the wait and the new ones [past_end, t_end) after it.
    const int new_begin = ctx_eff - p.query_len;
    const int past_end = prefetch ? max(t_begin, min(t_end, new_begin)) : t_end;

    // Fused write. Its global reads (each new token's slot and table entry; the new K/V rows of this
    // split, KV head kvh, for row block 0 to store) are issued by fetch_new into registers before the
    // prologue's tile copies (with prefetch: after the wait, which they must follow), so they do not
    // queue behind 64 KiB of copies; check_new then keeps each slot only if it is its position's slot
    // (else -1 and the sequence is poisoned), and store_new writes the rows to their slots. The
    // attention itself reads the new rows from new_key / new_value, so no block waits for the stores.
    constexpr int kNewIters = (kMaxQueryLen * kChunks + kThreads - 1) / kThreads;
    const int new_first = max(new_begin, t_begin);  // this split's new positions [new_first, t_end)
    const int new_items = row0 == 0 ? max(0, t_end - new_first) * kChunks : 0;  // 16-byte rows to store
    int raw_slot = -1, raw_page = 0;
    Chunk new_k[kNewIters], new_v[kNewIters];
    // Element offset of new token s's 16-byte chunk c (KV head kvh) in new_key / new_value.
    auto new_row = [&](int s, int c) { return ((static_cast<size_t>(b) * p.query_len + s) * Hkv + kvh) * D + c * 8; };
    auto fetch_new = [&]() {
        if (threadIdx.x < p.query_len && !bad_ctx) {
            raw_slot = p.slot_mapping[b * p.query_len + threadIdx.x];
            raw_page = table[(new_begin + threadIdx.x) / BS];
        }
#pragma unroll
        for (int j = 0; j < kNewIters; ++j) {
            const int i = threadIdx.x + j * kThreads;
            if (i < new_items) {
                const int s = new_first + i / kChunks - new_begin, c = i % kChunks;
                new_k[j] = *reinterpret_cast<Chunk const*>(new_key + new_row(s, c));
                new_v[j] = *reinterpret_cast<Chunk const*>(new_value + new_row(s, c));
            }
        }
    };
    auto check_new = [&]() {
        if (threadIdx.x < p.query_len) {
            int slot = bad_ctx ? -1 : raw_slot;
            const int pos = new_begin + threadIdx.x;
            if (slot != -1 && (slot < 0 || slot >= p.num_blocks * BS ||
                                  slot != static_cast<long long>(raw_page) * BS + pos % BS)) {
                s_bad_slot = 1;
                slot = -1;
            }
            s_slot[threadIdx.x] = slot;
        }
    };
    auto store_new = [&]() {
        C* kw = const_cast<C*>(k_cache);
        C* vw = const_cast<C*>(v_cache);
#pragma unroll
        for (int j = 0; j < kNewIters; ++j) {
            const int i = threadIdx.x + j * kThreads;
            if (i >= new_items) continue;
            const int s = new_first + i / kChunks - new_begin, c = i % kChunks;
            const int slot = s_slot[s];
            if (slot < 0) continue;
            const size_t dst = (static_cast<size_t>(slot) * Hkv + kvh) * D + c * 8;
            *reinterpret_cast<Chunk*>(kw + dst) = new_k[j];
            *reinterpret_cast<Chunk*>(vw + dst) = new_v[j];
        }
    };
    // Without prefetch the slots are checked before the prologue only where its tiles hold new rows
    // (the copies need s_slot), else after it, off the path of the first copies.
    const bool check_early = fused && !prefetch && new_first < min(t_end, t_begin + (kSt - 1) * kTileTokens);
    if (fused && !prefetch) fetch_new();
    if (check_early) {
        check_new();
        __syncthreads();
    }

    // Stage a tile: token rows in [lo, hi) are copied; with zero_tail, rows >= t_end are zero-filled
    // (masked anyway, but V must be finite: P = 0 times garbage could be NaN); other rows are left
    // alone (a later copy_tile call of the same stage fills them).
    // A whole tile inside [lo, hi) (all but a split's ragged last tile and the prefetch's split at
    // the new positions) takes a short path: the thread's page-relative offset is fixed, each page's
    // base is computed once, and no row needs a mask (a page holding the fused write's new rows picks
    // each row's source). (The general path below spent ~55 instructions
    // per 16-byte copy on masks and 64-bit offsets: most of the kernel's instructions at batch 1.)
    const int tok0 = threadIdx.x / kChunks;  // this thread copies rows tok0 + i * kTokensPerIter ...
    const int chunk = threadIdx.x % kChunks;  // ... 16-byte chunk `chunk` of each
    const size_t page_elems = static_cast<size_t>(BS) * Hkv * D;
    const int row_elems = Hkv * D;
    const int thread_off = (tok0 * Hkv + kvh) * D + chunk * 8;  // in the page, row tok0
    constexpr int kItersPerPage = BS / kTokensPerIter;
    // Chunk `c` (8 elements) of row `tok` of a staged tile.
    auto staged = [&](unsigned char* base, int stage, int tok, int c) {
        return base + stage * kStageBytes + tok * kStageRowBytes + c * 8 * static_cast<int>(sizeof(C));
    };
    auto shared_addr = [](void* ptr) { return static_cast<uint32_t>(__cvta_generic_to_shared(ptr)); };
    auto copy_tile = [&](int tile, int stage, int const (&pages)[kPagesPerTile], int lo, int hi, bool zero_tail) {
        const int t0 = t_begin + tile * kTileTokens;
        // native: the staged fp16 tile, addressed as before the quantized formats (the same code)
        T* dk = kQuant ? sK : sK + stage * kTileTokens * kStride;
        T* dv = kQuant ? sV : sV + stage * kTileTokens * kStride;
        constexpr int kIters = kTileTokens * kChunks / kThreads;
        if (t0 >= lo && t0 + kTileTokens <= hi) {  // uniform per block
            const uint32_t sk = kQuant ? shared_addr(staged(cK, stage, tok0, chunk))
                                       : static_cast<uint32_t>(__cvta_generic_to_shared(dk + tok0 * kStride + chunk * 8));
            const uint32_t sv = kQuant ? shared_addr(staged(cV, stage, tok0, chunk))
                                       : static_cast<uint32_t>(__cvta_generic_to_shared(dv + tok0 * kStride + chunk * 8));
#pragma unroll
            for (int j = 0; j < kPagesPerTile; ++j) {
                int page = pages[j];
                if (page < 0 || page >= p.num_blocks) {
                    s_bad = 1;  // the output is poisoned: copy page 0 instead (any valid memory)
                    page = 0;
                }
                C const* ks = k_cache + page * page_elems + thread_off;
                C const* vs = v_cache + page * page_elems + thread_off;
                const int page_t0 = t0 + j * BS;
                const bool has_new = fused && page_t0 + BS > new_begin;  // uniform: the fused write's rows
#pragma unroll
                for (int r = 0; r < kItersPerPage; ++r) {
                    const uint32_t row = (j * kItersPerPage + r) * kTokensPerIter * kStageRowBytes;  // bytes
                    C const* kr = ks + r * kTokensPerIter * row_elems;
                    C const* vr = vs + r * kTokensPerIter * row_elems;
                    if (has_new) {
                        const int s = page_t0 + r * kTokensPerIter + tok0 - new_begin;  // < Sq: t < hi <= ctx_eff
                        if (s >= 0 && s_slot[s] >= 0) {
                            kr = new_key + new_row(s, chunk);
                            vr = new_value + new_row(s, chunk);
                        }
                    }
                    if constexpr (kQuant) {
                        cp_async_8(sk + row, kr);
                        cp_async_8(sv + row, vr);
                    } else {
                        ptx::cp_async_16(sk + row, kr);
                        ptx::cp_async_16(sv + row, vr);
                    }
                }
            }
            return;
        }
#pragma unroll
        for (int it = 0; it < kIters; ++it) {
            const int i = threadIdx.x + it * kThreads;
            const int tok = i / kChunks, c = i % kChunks;
            const int t = t0 + tok;
            bool valid = t >= lo && t < hi;
            if (!valid && !(zero_tail && t >= t_end)) continue;
            const int page = pages[it * kTokensPerIter / BS];  // compile-time index: stays in registers
            size_t off = 0;
            C const* ksrc = k_cache;
            C const* vsrc = v_cache;
            if (valid) {
                const int s = t - new_begin;  // < Sq: t < t_end <= ctx_eff
                if (fused && s >= 0 && s_slot[s] >= 0) {  // a new token: from the fused write's input
                    ksrc = new_key;
                    vsrc = new_value;
                    off = new_row(s, c);
                } else if (page < 0 || page >= p.num_blocks) {
                    s_bad = 1;  // every writer stores 1: the race is benign
                    valid = false;
                } else {
                    off = ((static_cast<size_t>(page) * BS + (t % BS)) * Hkv + kvh) * D + c * 8;
                }
            }
            if constexpr (kQuant) {
                cp_async_8(shared_addr(staged(cK, stage, tok, c)), ksrc + off, valid);
                cp_async_8(shared_addr(staged(cV, stage, tok, c)), vsrc + off, valid);
            } else {
                ptx::cp_async_16(dk + tok * kStride + c * 8, ksrc + off, valid);
                ptx::cp_async_16(dv + tok * kStride + c * 8, vsrc + off, valid);
            }
        }
    };
    // Quantized: widen the rows this thread copied into stage `stage` (every row of the tile is
    // copied or zero-filled by its thread, in both copy_tile paths: rows tok0 + i * kTokensPerIter,
    // chunk `chunk`) into the fp16 tile. Its own cp.async writes are visible to it after its wait;
    // the step's barrier then publishes the tile to the other warps.
    auto widen_tile = [&](int stage) {
        if constexpr (kQuant) {
#pragma unroll
            for (int i = 0; i < kTileTokens / kTokensPerIter; ++i) {
                const int tok = tok0 + i * kTokensPerIter;
                const int at = stage * kStageBytes + tok * kStageRowBytes + chunk * 8;
                *reinterpret_cast<uint4*>(sK + tok * kStride + chunk * 8) =
                    widen_codes<KV>(*reinterpret_cast<uint2 const*>(cK + at));
                *reinterpret_cast<uint4*>(sV + tok * kStride + chunk * 8) =
                    widen_codes<KV>(*reinterpret_cast<uint2 const*>(cV + at));
            }
        }
    };
    // Quantized: the query registers (rows x columns of D) times K's channel scales (q·k = Σ q_d s_d code_d).
    // A fragment's registers hold columns kk * 16 + tig * 2 + {0, 1} (0, 1) and + 8 (2, 3).
    auto scale_query = [&](uint32_t (&qf)[D / 16][4]) {
        if constexpr (kQuant) {
            float const* ks = p.k_scale + kvh * D + (threadIdx.x % 4) * 2;
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const float2 s = __ldg(reinterpret_cast<float2 const*>(ks + kk * 16 + (r >> 1) * 8));
                    const float2 q = __half22float2(*reinterpret_cast<__half2 const*>(&qf[kk][r]));
                    qf[kk][r] = ptx::pack2<T>(q.x * s.x, q.y * s.y);
                }
        }
    };

    const int gid = lane >> 2;  // row within the m16 tile (and +8)
    const int tig = lane & 3;   // thread in group: column pair
    const int mi = lane >> 3;   // which 8x8 matrix this lane addresses in an ldmatrix.x4
    const int r8 = lane & 7;    // which row of it
    const float scale_log2 = (p.scale > 0.f ? p.scale : rsqrtf(static_cast<float>(D))) * kLog2e;
    // kExt soft-capping: score = softcap * tanh(scale q.k / softcap), in the log2 domain
    // cap_log2e * tanh(y) with y = scale q.k / softcap; tanh(y) = 1 - 2 / (1 + 2^(2 log2e y)) (exp2f:
    // accurate under --use_fast_math, where tanhf may not be), exactly +-1 where 2^.. over/underflows.
    const bool cap = kExt && p.softcap > 0.f;
    const float cap_exp2 = cap ? 2.f * kLog2e * (p.scale > 0.f ? p.scale : rsqrtf(static_cast<float>(D))) / p.softcap : 0.f;
    const float cap_log2e = cap ? p.softcap * kLog2e : 0.f;

    // Exclusive causal limit per owned row: row (s) sees positions < ctx - Sq + s + 1; with a window,
    // also >= ctx - Sq + s - W + 1 (first[i]).
    int limit[2], first[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int row = row0 + (kMT == 1 ? 0 : warp * 16) + gid + 8 * i;  // this warp's row tile
        const int s = row < rows_total ? row / group : p.query_len - 1;
        limit[i] = min(t_end, ctx_eff - p.query_len + s + 1);
        first[i] = window > 0 ? ctx_eff - p.query_len + s - window + 1 : 0;
    }

    uint32_t qf[D / 16][4];
    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY};
    float l_run[2] = {0.f, 0.f};

    // Prologue: kSt - 1 tiles in flight; every step then issues one more and waits for the oldest.
    // Their table entries (and the first loop tile's) were read together above; from then on each
    // step reads the entries of the tile the next step issues.
    // With prefetch, only their past rows, before the wait; then one group with Q and the rest of
    // those tiles (the new positions), so tile 0 waits for one group more than the steady state.
#pragma unroll
    for (int i = 0; i < kSt - 1; ++i) {
        if (i < num_tiles) copy_tile(i, i, pro_pages[i], t_begin, past_end, true);
        ptx::cp_async_commit();  // (empty when there is no such tile: the group count stays uniform)
    }
    if (prefetch) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
        load_query();
        if (fused) {
            fetch_new();
            check_new();
            __syncthreads();
        }
#pragma unroll
        for (int i = 0; i < kSt - 1; ++i)
            if (i < num_tiles && past_end < t_end) copy_tile(i, i, pro_pages[i], past_end, t_end, false);
        ptx::cp_async_commit();
    } else if (fused && !check_early) {
        check_new();
        __syncthreads();
    }
    if (fused) store_new();
    if constexpr (kMT > 1) {
        // Q sits in the last K stage, which the loop's first step refills: to registers first (the Q
        // group is the oldest without prefetch; with it, Q came with the last group).
        if (prefetch) {
            ptx::cp_async_wait<0>();
        } else {
            ptx::cp_async_wait<kSt - 1>();
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
            ptx::ldmatrix_x4(qf[kk], sQ + (warp * 16 + (mi & 1) * 8 + r8) * kStride + kk * 16 + (mi >> 1) * 8);
        scale_query(qf);
        __syncthreads();
    }
    for (int tile = 0; tile < num_tiles; ++tile) {
        const int next = tile + kSt - 1;
        if (next < num_tiles) {
            copy_tile(next, next % kSt, next_pages, t_begin, t_end, true);
            read_pages(t_begin, t_end, next + 1, next_pages);  // in flight during this step's wait and math
        }
        ptx::cp_async_commit();
        if (prefetch && tile == 0) {
            ptx::cp_async_wait<kSt - 2>();  // tiles 0 .. kSt-2 and the Q group
        } else {
            ptx::cp_async_wait<kSt - 1>();
        }
        widen_tile(tile % kSt);  // quantized: this thread's rows of the tile, to fp16
        __syncthreads();
        if (kMT == 1 && tile == 0) {
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk)
                ptx::ldmatrix_x4(qf[kk], sQ + ((mi & 1) * 8 + r8) * kStride + kk * 16 + (mi >> 1) * 8);
            scale_query(qf);
        }
        // This warp's 16-token chunks of the tile: chunk `warp` (kMT = 1) or all of them.
        constexpr int kCPW = kMT == 1 ? 1 : kTileTokens / 16;
        const int chunk0 = kMT == 1 ? warp : 0;
        // quantized: the one fp16 tile
        T const* tk = sK + (kQuant ? 0 : tile % kStages) * kTileTokens * kStride + chunk0 * 16 * kStride;
        T const* tv = sV + (kQuant ? 0 : tile % kStages) * kTileTokens * kStride + chunk0 * 16 * kStride;

        // S = Q Kᵀ for each 16-token chunk: two n8 tiles.
        float s[kCPW][2][4];
#pragma unroll
        for (int c = 0; c < kCPW; ++c) {
#pragma unroll
            for (int j = 0; j < 2; ++j) s[c][j][0] = s[c][j][1] = s[c][j][2] = s[c][j][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                uint32_t kb[4];
                ptx::ldmatrix_x4(kb, tk + (c * 16 + (mi >> 1) * 8 + r8) * kStride + kk * 16 + (mi & 1) * 8);
                ptx::mma_16816<T>(s[c][0], qf[kk], kb[0], kb[1]);
                ptx::mma_16816<T>(s[c][1], qf[kk], kb[2], kb[3]);
            }
        }

        const int tbase = t_begin + tile * kTileTokens + chunk0 * 16;
#pragma unroll
        for (int c = 0; c < kCPW; ++c)
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int tok = tbase + c * 16 + j * 8 + tig * 2 + (e & 1);
                    if constexpr (kExt) {
                        const float y = cap ? cap_log2e * (1.f - 2.f / (1.f + exp2f(cap_exp2 * s[c][j][e])))
                                            : s[c][j][e] * scale_log2;
                        s[c][j][e] = tok < limit[e >> 1] && tok >= first[e >> 1] ? y : -INFINITY;
                    } else {
                        s[c][j][e] = tok < limit[e >> 1] ? s[c][j][e] * scale_log2 : -INFINITY;
                    }
                }

        // Online softmax, rows gid (i = 0) and gid + 8 (i = 1); a row spans the 4 threads of a quad.
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float mx = -INFINITY;
#pragma unroll
            for (int c = 0; c < kCPW; ++c)
                mx = fmaxf(mx, fmaxf(fmaxf(s[c][0][2 * i], s[c][0][2 * i + 1]), fmaxf(s[c][1][2 * i], s[c][1][2 * i + 1])));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
            const float m_new = fmaxf(m_run[i], mx);
            const float base = m_new == -INFINITY ? 0.f : m_new;  // fully masked so far: keep zeros
            const float alpha = exp2f(m_run[i] - base);
            float sum = 0.f;
#pragma unroll
            for (int c = 0; c < kCPW; ++c)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    s[c][j][2 * i] = exp2f(s[c][j][2 * i] - base);
                    s[c][j][2 * i + 1] = exp2f(s[c][j][2 * i + 1] - base);
                    sum += s[c][j][2 * i] + s[c][j][2 * i + 1];
                }
            l_run[i] = l_run[i] * alpha + sum;  // per-thread partial; quad-reduced at the end
            m_run[i] = m_new;
#pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                o[n][2 * i] *= alpha;
                o[n][2 * i + 1] *= alpha;
            }
        }

        // The S accumulators of a chunk's two n8 tiles are exactly the A fragment of P[16 x 16].
#pragma unroll
        for (int c = 0; c < kCPW; ++c) {
            const uint32_t pa[4] = {ptx::pack2<T>(s[c][0][0], s[c][0][1]), ptx::pack2<T>(s[c][0][2], s[c][0][3]),
                ptx::pack2<T>(s[c][1][0], s[c][1][1]), ptx::pack2<T>(s[c][1][2], s[c][1][3])};
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                uint32_t vb[4];
                ptx::ldmatrix_x4_trans(vb, tv + (c * 16 + (mi & 1) * 8 + r8) * kStride + dp * 16 + (mi >> 1) * 8);
                ptx::mma_16816<T>(o[2 * dp], pa, vb[0], vb[1]);
                ptx::mma_16816<T>(o[2 * dp + 1], pa, vb[2], vb[3]);
            }
        }
        __syncthreads();  // the stage is refilled next iteration
    }
    ptx::cp_async_wait<0>();
    __syncthreads();

    // kMT = 1: merge the four warps (same rows, disjoint tokens); kMT > 1: each warp has its own rows.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l_run[i] += __shfl_xor_sync(0xffffffff, l_run[i], 1);
        l_run[i] += __shfl_xor_sync(0xffffffff, l_run[i], 2);
    }
    if (tig == 0) {
        s_m[warp][gid] = m_run[0];
        s_m[warp][gid + 8] = m_run[1];
        s_l[warp][gid] = l_run[0];
        s_l[warp][gid + 8] = l_run[1];
    }
    __syncthreads();
    if (threadIdx.x < kRows) {
        const int r = threadIdx.x % kRowsPerCta;
        const int w_lo = kMT == 1 ? 0 : threadIdx.x / kRowsPerCta, w_hi = kMT == 1 ? kWarps : w_lo + 1;
        float mx = -INFINITY;
        for (int w = w_lo; w < w_hi; ++w) mx = fmaxf(mx, s_m[w][r]);
        float sum = 0.f;
        for (int w = w_lo; w < w_hi; ++w)
            sum += s_m[w][r] == -INFINITY ? 0.f : s_l[w][r] * exp2f(s_m[w][r] - mx);
        s_row_max[threadIdx.x] = mx;
        s_row_sum[threadIdx.x] = sum;
    }
    __syncthreads();
    float* sO = reinterpret_cast<float*>(sK);  // [kWarps][16][kOStride]: warp w's rows (kMT > 1: block rows 16w..)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = gid + 8 * i;
        const int block_row = (kMT == 1 ? 0 : warp * 16) + r;
        if (row0 + block_row >= rows_total) continue;  // padding rows: never read (decode G = 4: 12 of 16)
        const float f = m_run[i] == -INFINITY ? 0.f : exp2f(m_run[i] - s_row_max[block_row]);
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            float2 v = make_float2(o[n][2 * i] * f, o[n][2 * i + 1] * f);
            *reinterpret_cast<float2*>(sO + (warp * kRowsPerCta + r) * kOStride + n * 8 + tig * 2) = v;
        }
    }
    __syncthreads();

    const bool bad = bad_ctx || s_bad != 0 || s_bad_slot != 0;
    if (bad && threadIdx.x == 0 && p.error_flag != nullptr)
        atomicOr(p.error_flag, (bad_ctx ? kErrorContextLen : 0) | (s_bad ? kErrorBlockTable : 0) |
                                   (s_bad_slot ? kErrorSlotMapping : 0));
    const float nan = __int_as_float(0x7fc00000);
    const int valid_rows = min(kRows, rows_total - row0);  // the block's rows past the padding
    for (int idx = threadIdx.x; idx < valid_rows * (D / 4); idx += kThreads) {
        const int r = idx / (D / 4);
        const int d = (idx % (D / 4)) * 4;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        if constexpr (kMT == 1) {
#pragma unroll
            for (int w = 0; w < kWarps; ++w) {
                const float4 v = *reinterpret_cast<float4 const*>(sO + (w * kRowsPerCta + r) * kOStride + d);
                acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
            }
        } else {
            acc = *reinterpret_cast<float4 const*>(sO + r * kOStride + d);
        }
        const float sum = s_row_sum[r];
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        acc.x *= inv; acc.y *= inv; acc.z *= inv; acc.w *= inv;
        if constexpr (kQuant) {  // V's channel scales (the partials carry them: the merge is linear)
            const float4 vs = __ldg(reinterpret_cast<float4 const*>(p.v_scale + kvh * D + d));
            acc.x *= vs.x; acc.y *= vs.y; acc.z *= vs.z; acc.w *= vs.w;
        }
        if (bad) acc = make_float4(nan, nan, nan, nan);
        // Recomputed rather than read from s_out_row: that read made ptxas allocate 8-60 more
        // registers and the decode grid ran ~2 % slower on an H200 (results/h200_session9_ab3_*).
        const int row = row0 + r;
        const int s_idx = row / group, g = row % group;
        const size_t out_row = (static_cast<size_t>(b) * p.query_len + s_idx) * p.num_heads + kvh * group + g;
        if (num_splits == 1) {
            uint2 packed;
            packed.x = ptx::pack2<T>(acc.x, acc.y);
            packed.y = ptx::pack2<T>(acc.z, acc.w);
            *reinterpret_cast<uint2*>(static_cast<T*>(p.out) + out_row * D + d) = packed;
        } else {
            const size_t part = out_row * num_splits + split;
            *reinterpret_cast<float4*>(p.partial_out + part * D + d) = acc;
            if (d == 0) p.partial_lse[part] = bad ? nan : (sum > 0.f ? s_row_max[r] + log2f(sum) : -INFINITY);
        }
    }
    if (num_splits == 1 || p.split_counters == nullptr) return;  // done, or the reduce kernel merges

    // kLastBlock: publish this block's partials, count it; the last of the num_splits blocks merges.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        int32_t* counter = p.split_counters + (static_cast<size_t>(blockIdx.z) * gridDim.y + blockIdx.y);
        const int last = atomicAdd(counter, 1) == num_splits - 1;
        if (last) {
            atomicExch(counter, 0);  // all num_splits arrived: ready for the next call / graph replay
            __threadfence();         // acquire: the other blocks' partials are visible from here on
        }
        s_last = last;
    }
    __syncthreads();
    if (!s_last) return;
    merge_splits<T, D>(p, s_out_row, num_splits, min(kRows, rows_total - row0));
}

// Merge the splits of one output row (b, s, h) per block. The kReduceWarps warps take every
// kReduceWarps-th split (merge_split_range: 8 splits' loads in flight a warp, so up to 32 splits
// cost one L2 round trip; the earlier loop read the lse first, then the partials four splits at a
// time: ~4 round trips at 32 splits, most of the batch-1 reduce time). Each warp merges its splits
// online (running max, fixed order), then the warps are merged in warp order through shared memory:
// deterministic.
// 128 threads at <= 64 registers (launch bounds: 8 blocks/SM) so that, launched as a programmatic
// dependent, its blocks fit beside two resident split-kernel blocks (D = 128: 2 x 128 x 224
// registers of the 64K) and wait there for the split kernel instead of being scheduled after it.
constexpr int kReduceWarps = 4;
constexpr int kReduceThreads = kReduceWarps * 32;

template <typename T, int D>
__global__ void __launch_bounds__(kReduceThreads, 8) paged_attention_reduce_kernel(Params p, int num_rows, int num_splits) {
    constexpr int V = MergeVec<D>::V;
    __shared__ float s_max[kReduceWarps];
    __shared__ float s_sum[kReduceWarps];
    __shared__ int s_nan[kReduceWarps];
    __shared__ __align__(16) float s_acc[kReduceWarps][D];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");  // the split kernel's partials are complete
    // Let the next kernel in the stream (launched as a programmatic dependent, e.g. the next call's
    // split kernel) be scheduled now; it waits (griddepcontrol.wait) for this grid to finish before
    // its first global read, so nothing it reads or writes can race with this merge.
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    const int row = blockIdx.x;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= num_rows) return;  // the whole block (grid = num_rows)
    // Warp w merges splits w, w + kReduceWarps, ...; then the warps are merged in warp order.
    float m, sum, acc[V];
    int any_nan;
    merge_split_range<D, 8>(p, static_cast<size_t>(row), num_splits, warp, kReduceWarps, lane, m, sum, acc, any_nan);
    any_nan = __any_sync(0xffffffff, any_nan);  // uniform per warp already (every lane read the same lse)
#pragma unroll
    for (int v = 0; v < V; ++v) s_acc[warp][lane * V + v] = acc[v];
    if (lane == 0) {
        s_max[warp] = m;
        s_sum[warp] = sum;
        s_nan[warp] = any_nan;
    }
    __syncthreads();
    if (threadIdx.x < D / 2) {
        float mx = -INFINITY;
        int nan = 0;
#pragma unroll
        for (int w = 0; w < kReduceWarps; ++w) {
            mx = fmaxf(mx, s_max[w]);
            nan |= s_nan[w];
        }
        const int d = threadIdx.x * 2;
        float total = 0.f, a = 0.f, c = 0.f;
#pragma unroll
        for (int w = 0; w < kReduceWarps; ++w) {
            const float f = s_max[w] == -INFINITY ? 0.f : exp2f(s_max[w] - mx);
            total += s_sum[w] * f;
            a += s_acc[w][d] * f;
            c += s_acc[w][d + 1] * f;
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;  // all splits empty: zeros
        a *= inv;
        c *= inv;
        if (nan) a = c = __int_as_float(0x7fc00000);
        *reinterpret_cast<uint32_t*>(static_cast<T*>(p.out) + static_cast<size_t>(row) * D + d) = ptx::pack2<T>(a, c);
    }
}

}  // namespace detail
}  // namespace paged_attention
}  // namespace enginesmith
