// Paged attention: launcher and dispatch (layers 2 and 3), the split merge and the KV write kernels.
// The split kernel: paged_attention_kernels.cuh, compiled per group (paged_attention_table.h).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "paged_attention.h"
#include "paged_attention_kernels.cuh"
#include "paged_attention_table.h"

namespace enginesmith {
namespace paged_attention {
namespace {

using ReduceFn = void (*)(Params, int, int);

// The compiled groups (CMakeLists.txt compiles the same list): every head and block size of
// limits.json for fp16 and bf16 pages, and for int8 / fp8 pages with fp16 compute (kv_quant.h).
template <typename T, KvFormat KV, int D, size_t... J>
void add_block_sizes(std::vector<Entry const*>& out, std::index_sequence<J...>) {
    (out.push_back(entry<T, KV, D, kSupportedBlockSizes[J]>()), ...);
}

template <typename T, KvFormat KV, size_t... I>
void add_groups(std::vector<Entry const*>& out, std::index_sequence<I...>) {
    constexpr auto blocks = std::make_index_sequence<std::size(kSupportedBlockSizes)>{};
    (add_block_sizes<T, KV, kSupportedHeadSizes[I]>(out, blocks), ...);
}

std::vector<Entry const*> const& groups() {
    static std::vector<Entry const*> const all = [] {
        std::vector<Entry const*> g;
        constexpr auto heads = std::make_index_sequence<std::size(kSupportedHeadSizes)>{};
        add_groups<__half, KvFormat::kNative>(g, heads);
        add_groups<__nv_bfloat16, KvFormat::kNative>(g, heads);
        add_groups<__half, KvFormat::kInt8>(g, heads);
        add_groups<__half, KvFormat::kFp8E4M3>(g, heads);
        return g;
    }();
    return all;
}

// The dispatch table: every (dtype, KV format, head size, block size) with a compiled kernel. Anything
// else is reported by check_config with the supported values.
Entry const* find_entry(DType dtype, int head_size, int block_size, KvFormat kv = KvFormat::kNative) {
    for (Entry const* e : groups())
        if (e->dtype == dtype && e->kv_format == kv && e->head_size == head_size && e->block_size == block_size) return e;
    return nullptr;
}

// The split merge kernel (T, D): compiled here, once per pair.
template <typename T, size_t... I>
ReduceFn reduce_for(int head_size, std::index_sequence<I...>) {
    ReduceFn fn = nullptr;
    ((head_size == kSupportedHeadSizes[I] ? (fn = &detail::paged_attention_reduce_kernel<T, kSupportedHeadSizes[I]>, 0) : 0), ...);
    return fn;
}

ReduceFn reduce_kernel(DType dtype, int head_size) {
    constexpr auto heads = std::make_index_sequence<std::size(kSupportedHeadSizes)>{};
    return dtype == DType::kBFloat16 ? reduce_for<__nv_bfloat16>(head_size, heads) : reduce_for<__half>(head_size, heads);
}

// Copy T new tokens' K/V rows (Hkv * D elements each) to their cache slots, 16 bytes per thread.
__global__ void write_kv_kernel(WriteKVParams p, int chunks_per_token) {
    const int t = blockIdx.x;
    const int slot = p.slot_mapping[t];
    if (slot == -1) return;
    if (slot < 0 || slot >= p.num_blocks * p.block_size) {
        if (threadIdx.x == 0 && p.error_flag != nullptr) atomicOr(p.error_flag, kErrorSlotMapping);
        return;
    }
    uint4 const* key = static_cast<uint4 const*>(p.key) + static_cast<size_t>(t) * chunks_per_token;
    uint4 const* value = static_cast<uint4 const*>(p.value) + static_cast<size_t>(t) * chunks_per_token;
    uint4* kc = static_cast<uint4*>(p.k_cache) + static_cast<size_t>(slot) * chunks_per_token;
    uint4* vc = static_cast<uint4*>(p.v_cache) + static_cast<size_t>(slot) * chunks_per_token;
    for (int i = threadIdx.x; i < chunks_per_token; i += blockDim.x) {
        kc[i] = key[i];
        vc[i] = value[i];
    }
}

template <size_t N>
std::string join(int const (&values)[N]) {
    std::string s;
    for (size_t i = 0; i < N; ++i) s += (i ? ", " : "") + std::to_string(values[i]);
    return s;
}

int ceil_div(int a, int b) { return (a + b - 1) / b; }

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

}  // namespace

Status check_config(DType dtype, int head_size, int block_size, int num_heads, int num_kv_heads, int query_len,
    KvFormat kv_format) {
    if (dtype != DType::kFloat16 && dtype != DType::kBFloat16)
        return Status::Error("paged attention: dtype must be float16 or bfloat16");
    if (kv_quantized(kv_format) && dtype != DType::kFloat16)
        return Status::Error(std::string("paged attention: ") + kv_format_name(kv_format) +
                             " KV pages need float16 compute, got " + dtypeName(dtype));
    if (std::find(std::begin(kSupportedHeadSizes), std::end(kSupportedHeadSizes), head_size) ==
        std::end(kSupportedHeadSizes))
        return Status::Error("paged attention: head size " + std::to_string(head_size) +
                             " is not supported (supported: " + join(kSupportedHeadSizes) + ")");
    if (std::find(std::begin(kSupportedBlockSizes), std::end(kSupportedBlockSizes), block_size) ==
        std::end(kSupportedBlockSizes))
        return Status::Error("paged attention: block size " + std::to_string(block_size) +
                             " is not supported (supported: " + join(kSupportedBlockSizes) + ")");
    if (num_kv_heads <= 0 || num_heads <= 0 || num_heads % num_kv_heads != 0)
        return Status::Error("paged attention: num_heads (" + std::to_string(num_heads) +
                             ") must be a positive multiple of num_kv_heads (" + std::to_string(num_kv_heads) + ")");
    if (query_len < 1 || query_len > kMaxQueryLen)
        return Status::Error("paged attention: query length " + std::to_string(query_len) + " is outside [1, " +
                             std::to_string(kMaxQueryLen) + "]; run longer prompts through the prefill path");
    if (find_entry(dtype, head_size, block_size, kv_format) == nullptr)
        return Status::Error(std::string("paged attention: no kernel compiled for dtype=") + dtypeName(dtype) +
                             " kv=" + kv_format_name(kv_format) + " head_size=" + std::to_string(head_size) +
                             " block_size=" + std::to_string(block_size));
    return Status::Ok();
}

static Status configure_smem(Variant const& v) {
    if (!v.smem_configured->load(std::memory_order_acquire)) {
        ES_RETURN_IF_CUDA_ERROR(cudaFuncSetAttribute(reinterpret_cast<void const*>(v.kernel),
            cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(v.smem)));
        v.smem_configured->store(true, std::memory_order_release);
    }
    return Status::Ok();
}

Status resident_slots(DType dtype, int head_size, int block_size, int* slots, KvFormat kv_format) {
    Entry const* e = find_entry(dtype, head_size, block_size, kv_format);
    if (e == nullptr) return check_config(dtype, head_size, block_size, 1, 1, 1, kv_format);
    int cached = e->slots->load(std::memory_order_acquire);
    if (cached == 0) {  // one GPU kind per process is assumed (as TensorRT engines do)
        int dev = 0, sms = 0, per_sm = 1 << 30;
        ES_RETURN_IF_CUDA_ERROR(cudaGetDevice(&dev));
        ES_RETURN_IF_CUDA_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
        for (Variant const* v : {&e->single_tile, &e->multi_tile}) {  // the lower of the two variants
            int n = 0;
            ES_RETURN_IF_ERROR(configure_smem(*v));
            ES_RETURN_IF_CUDA_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                &n, reinterpret_cast<void const*>(v->kernel), detail::kThreads, v->smem));
            per_sm = std::min(per_sm, n);
        }
        cached = std::max(1, sms * std::max(per_sm, 1));
        e->slots->store(cached, std::memory_order_release);
    }
    *slots = cached;
    return Status::Ok();
}

// Programmatic dependent launch needs sm_90 (griddepcontrol); checked once per process.
static bool dependent_launch_supported() {
    static int const major = [] {
        int dev = 0, value = 0;
        if (cudaGetDevice(&dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&value, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
            cudaGetLastError();
            return 0;
        }
        return value;
    }();
    return major >= 9;
}

int choose_num_splits(int batch, int query_len, int num_heads, int num_kv_heads, int max_blocks_per_seq,
    int block_size, int slots, int window) {
    if (batch <= 0 || num_kv_heads <= 0) return 1;
    const int rows = num_heads / num_kv_heads * query_len;
    const int row_blocks = ceil_div(rows, block_rows(rows));
    const int base = batch * num_kv_heads * row_blocks;
    const int want = std::max(1, std::max(slots, 1) / base);  // at most one full wave
    // the keys a sequence's blocks read: the table's full length, or (window) its window's span
    const int tokens = window > 0 ? std::min(max_blocks_per_seq * block_size, window_span(window, query_len, block_size))
                                  : max_blocks_per_seq * block_size;
    const int by_len = std::max(1, tokens / kMinTokensPerSplit);
    const int splits = std::max(1, std::min({want, by_len, kMaxSplits}));
    // The kernel gives each split whole kTileTokens tiles (ceil(ctx / splits) rounded up), so at the
    // table's full length some trailing splits may get no tokens (33 wanted at 8k-32k on an H200 ->
    // 32 used): drop them (no empty blocks, one partial fewer per row for the reduce). Never more
    // than before, and monotone in `slots`, so workspace_bound still covers every launch.
    const int per_split = ceil_div(ceil_div(tokens, splits), kTileTokens) * kTileTokens;
    return std::max(1, std::min(splits, ceil_div(tokens, per_split)));
}

size_t workspace_size(int batch, int query_len, int num_heads, int head_size, int num_splits) {
    if (num_splits <= 1) return 0;
    const size_t rows = static_cast<size_t>(batch) * query_len * num_heads * num_splits;
    return align_up(rows * head_size * sizeof(float), 256) + align_up(rows * sizeof(float), 256);
}

int split_counters_needed(int batch, int query_len, int num_heads, int num_kv_heads) {
    if (batch <= 0 || num_kv_heads <= 0 || num_heads <= 0) return 0;
    const int rows = num_heads / num_kv_heads * query_len;
    return batch * num_kv_heads * ceil_div(rows, block_rows(rows));
}

ReduceMode default_reduce_mode() {
    static ReduceMode const mode = [] {
        char const* env = std::getenv("ES_PAGED_ATTENTION_REDUCE");
        // Two kernels by default: the last-block merge measured ~1 us slower at batch 1 on an H100
        // (8k: 15.5 vs 14.4 us; benchmarks/plugins/results/h100_session7_single_vs_two.json).
        return env != nullptr && std::strcmp(env, "single") == 0 ? ReduceMode::kLastBlock : ReduceMode::kSeparateKernel;
    }();
    return mode;
}

size_t workspace_bound(int max_batch, int max_query_len, int num_heads, int num_kv_heads, int head_size,
    int block_size, int max_blocks_per_seq, int max_splits) {
    size_t bound = 0;
    for (int b = 1; b <= max_batch; ++b)
        for (int s = 1; s <= max_query_len; ++s) {
            const int splits = std::min(max_splits,
                choose_num_splits(b, s, num_heads, num_kv_heads, max_blocks_per_seq, block_size, kSlotBudget));
            bound = std::max(bound, workspace_size(b, s, num_heads, head_size, splits));
        }
    return bound;
}

Status launch_paged_attention(Params p, void* workspace, size_t workspace_bytes, int slots, cudaStream_t stream) {
    ES_RETURN_IF_ERROR(
        check_config(p.dtype, p.head_size, p.block_size, p.num_heads, p.num_kv_heads, p.query_len, p.kv_format));
    if (p.batch <= 0) return Status::Ok();
    if (p.max_blocks_per_seq <= 0 || p.num_blocks <= 0)
        return Status::Error("paged attention: block table width and page count must be positive");
    if (!p.query || !p.k_cache || !p.v_cache || !p.block_tables || !p.context_lens || !p.out)
        return Status::Error("paged attention: a required pointer is null");
    const int fused = (p.new_key != nullptr) + (p.new_value != nullptr) + (p.slot_mapping != nullptr);
    if (fused != 0 && fused != 3)
        return Status::Error("paged attention: the fused KV write needs new_key, new_value and slot_mapping together");
    if (kv_quantized(p.kv_format) && (p.k_scale == nullptr || p.v_scale == nullptr))
        return Status::Error(std::string("paged attention: ") + kv_format_name(p.kv_format) +
                             " KV pages need k_scale and v_scale [num_kv_heads, head_size]");
    if (!(p.softcap >= 0.f) || !std::isfinite(p.softcap))
        return Status::Error("paged attention: softcap must be >= 0 (0: off), got " + std::to_string(p.softcap));
    if (p.window == 0 || p.window < -1)
        return Status::Error("paged attention: window must be positive, or -1 (off), got " + std::to_string(p.window));
    const bool ext = p.softcap > 0.f || p.window > 0;
    Entry const* e = find_entry(p.dtype, p.head_size, p.block_size, p.kv_format);
    const int group = p.num_heads / p.num_kv_heads;
    Variant const& kernel = e->variant(group * p.query_len, ext);
    ES_RETURN_IF_ERROR(configure_smem(kernel));
    if (p.num_splits <= 0 && slots <= 0)
        ES_RETURN_IF_ERROR(resident_slots(p.dtype, p.head_size, p.block_size, &slots, p.kv_format));
    int splits = p.num_splits > 0 ? p.num_splits
                                  : choose_num_splits(p.batch, p.query_len, p.num_heads, p.num_kv_heads,
                                        p.max_blocks_per_seq, p.block_size, slots, p.window);
    if (splits > kMaxSplits)
        return Status::Error("paged attention: num_splits " + std::to_string(splits) + " exceeds " +
                             std::to_string(kMaxSplits));
    const size_t need = workspace_size(p.batch, p.query_len, p.num_heads, p.head_size, splits);
    if (need > workspace_bytes || (need > 0 && workspace == nullptr))
        return Status::Error("paged attention: workspace of " + std::to_string(workspace_bytes) + " bytes, " +
                             std::to_string(need) + " needed for " + std::to_string(splits) + " splits");
    if (splits > 1) {
        const size_t rows = static_cast<size_t>(p.batch) * p.query_len * p.num_heads * splits;
        p.partial_out = static_cast<float*>(workspace);
        p.partial_lse = reinterpret_cast<float*>(
            static_cast<char*>(workspace) + align_up(rows * p.head_size * sizeof(float), 256));
    }
    p.num_splits = splits;

    // Who merges the splits: the last block (counters given) or the reduce kernel.
    ReduceMode mode = p.reduce;
    if (mode == ReduceMode::kAuto)
        mode = p.split_counters != nullptr ? default_reduce_mode() : ReduceMode::kSeparateKernel;
    if (mode != ReduceMode::kLastBlock && mode != ReduceMode::kSeparateKernel)
        return Status::Error("paged attention: unknown reduce mode " + std::to_string(static_cast<int>(mode)));
    const bool last_block = mode == ReduceMode::kLastBlock;
    if (last_block && splits > 1) {
        const int need_counters = split_counters_needed(p.batch, p.query_len, p.num_heads, p.num_kv_heads);
        if (p.split_counters == nullptr || p.num_split_counters < need_counters)
            return Status::Error("paged attention: the last-block reduce needs " + std::to_string(need_counters) +
                                 " zeroed int32 split counters, " + std::to_string(p.num_split_counters) + " given");
    }
    if (!last_block || splits == 1) p.split_counters = nullptr;  // the kernel reads this as the mode

    const int row_blocks = ceil_div(group * p.query_len, block_rows(group * p.query_len));
    const dim3 grid(splits, p.num_kv_heads * row_blocks, p.batch);
    if (grid.y > 65535 || grid.z > 65535) return Status::Error("paged attention: batch or heads exceed the grid limit");
    {
        // sm_90+: optionally a programmatic dependent of the previous kernel in the stream (the kernel
        // waits on griddepcontrol before its first global read), hiding most of the launch gap.
        const bool pdl = dependent_launch_supported() && p.dependent_launch != 0;
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t config = {};
        config.gridDim = grid;
        config.blockDim = dim3(detail::kThreads);
        config.dynamicSmemBytes = kernel.smem;
        config.stream = stream;
        config.attrs = attr;
        config.numAttrs = pdl ? 1 : 0;
        ES_RETURN_IF_CUDA_ERROR(cudaLaunchKernelEx(&config, kernel.kernel, p, row_blocks));
    }
    if (splits > 1 && !last_block) {
        // On sm_90+ the reduce is a programmatic dependent launch: its blocks are scheduled while the
        // split kernel drains and wait (griddepcontrol.wait) for its results, hiding one launch gap.
        const int rows = p.batch * p.query_len * p.num_heads;
        cudaLaunchAttribute pdl[1];
        pdl[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        pdl[0].val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t config = {};
        config.gridDim = dim3(rows);
        config.blockDim = dim3(detail::kReduceThreads);
        config.dynamicSmemBytes = 0;
        config.stream = stream;
        config.attrs = pdl;
        config.numAttrs = dependent_launch_supported() ? 1 : 0;
        ES_RETURN_IF_CUDA_ERROR(cudaLaunchKernelEx(&config, reduce_kernel(p.dtype, p.head_size), p, rows, splits));
    }
    return Status::Ok();
}

Status launch_write_kv(WriteKVParams const& p, cudaStream_t stream) {
    if (std::find(std::begin(kSupportedHeadSizes), std::end(kSupportedHeadSizes), p.head_size) ==
        std::end(kSupportedHeadSizes))
        return Status::Error("write kv: head size " + std::to_string(p.head_size) + " is not supported (supported: " +
                             join(kSupportedHeadSizes) + ")");
    if (std::find(std::begin(kSupportedBlockSizes), std::end(kSupportedBlockSizes), p.block_size) ==
        std::end(kSupportedBlockSizes))
        return Status::Error("write kv: block size " + std::to_string(p.block_size) +
                             " is not supported (supported: " + join(kSupportedBlockSizes) + ")");
    if (p.num_tokens <= 0) return Status::Ok();
    if (!p.key || !p.value || !p.slot_mapping || !p.k_cache || !p.v_cache)
        return Status::Error("write kv: a required pointer is null");
    const int chunks = p.num_kv_heads * p.head_size * 2 / 16;  // 16-bit elements, 16-byte chunks
    write_kv_kernel<<<p.num_tokens, std::min(256, ((chunks + 31) / 32) * 32), 0, stream>>>(p, chunks);
    ES_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    return Status::Ok();
}

}  // namespace paged_attention
}  // namespace enginesmith
