// C entry points over the kernel layer, for the ctypes test binding (plugins/kernels.py). No
// TensorRT and no Python here: pointers are raw device addresses, streams are cudaStream_t values.
// Every function returns 0 on success, -1 on failure with the reason in es_last_error().
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../paged_attention/paged_attention.h"
#include "../sparse_gemm/sparse_gemm.h"

#define ES_CAPI extern "C" __attribute__((visibility("default")))

namespace {
thread_local std::string g_last_error;

int fail(enginesmith::Status const& st) {
    g_last_error = st.message;
    return -1;
}

int done(enginesmith::Status const& st) { return st.ok ? 0 : fail(st); }

namespace pa = enginesmith::paged_attention;
namespace sg = enginesmith::sparse_gemm;
using enginesmith::DType;
}  // namespace

ES_CAPI char const* es_last_error() { return g_last_error.c_str(); }

ES_CAPI int es_abi_version() { return 5; }  // 3: es_paged_attention takes prefetch_past; 4: sparse configs;
                                            // 5: es_paged_attention takes the fused write's inputs

// Limits of the paged attention kernels, so Python never restates them.
ES_CAPI int es_paged_attention_limits(int* head_sizes, int* num_head_sizes, int* block_sizes, int* num_block_sizes,
    int* max_query_len, int* max_splits) {
    int i = 0;
    for (int v : pa::kSupportedHeadSizes) head_sizes[i++] = v;
    *num_head_sizes = i;
    i = 0;
    for (int v : pa::kSupportedBlockSizes) block_sizes[i++] = v;
    *num_block_sizes = i;
    *max_query_len = pa::kMaxQueryLen;
    *max_splits = pa::kMaxSplits;
    return 0;
}

ES_CAPI int es_paged_attention_check(int dtype, int head_size, int block_size, int num_heads, int num_kv_heads, int query_len) {
    return done(pa::check_config(static_cast<DType>(dtype), head_size, block_size, num_heads, num_kv_heads, query_len));
}

// Splits the launcher would use (num_splits == 0 asks for its choice) and the workspace they need.
ES_CAPI int es_paged_attention_plan(int batch, int query_len, int num_heads, int num_kv_heads, int head_size,
    int block_size, int max_blocks_per_seq, int num_splits, int dtype, int* splits_out, size_t* workspace_bytes) {
    int splits = num_splits;
    if (splits <= 0) {
        int slots = 0;
        enginesmith::Status st = pa::resident_slots(static_cast<DType>(dtype), head_size, block_size, &slots);
        if (!st.ok) return fail(st);
        splits = pa::choose_num_splits(batch, query_len, num_heads, num_kv_heads, max_blocks_per_seq, block_size, slots);
    }
    *splits_out = splits;
    *workspace_bytes = pa::workspace_size(batch, query_len, num_heads, head_size, splits);
    return 0;
}

// int32 split counters the last-block reduce needs for these shapes (zeroed once by the caller).
ES_CAPI int es_paged_attention_counters(int batch, int query_len, int num_heads, int num_kv_heads) {
    return pa::split_counters_needed(batch, query_len, num_heads, num_kv_heads);
}

// reduce_mode: 0 auto ($ES_PAGED_ATTENTION_REDUCE when counters are given), 1 last block, 2 reduce
// kernel. dependent_launch: -1 auto, 0 off, 1 on; prefetch_past 0/1 (see pa::Params).
ES_CAPI int es_paged_attention(void const* query, void const* k_cache, void const* v_cache, int32_t const* block_tables,
    int32_t const* context_lens, void* out, void* workspace, size_t workspace_bytes, int32_t* error_flag, int batch,
    int query_len, int num_heads, int num_kv_heads, int head_size, int block_size, int num_blocks,
    int max_blocks_per_seq, int num_splits, float scale, int dtype, int32_t* split_counters, int num_split_counters,
    int reduce_mode, int dependent_launch, int prefetch_past, void const* new_key, void const* new_value,
    int32_t const* slot_mapping, void* stream) {
    pa::Params p;
    p.new_key = new_key;
    p.new_value = new_value;
    p.slot_mapping = slot_mapping;
    p.query = query;
    p.k_cache = k_cache;
    p.v_cache = v_cache;
    p.block_tables = block_tables;
    p.context_lens = context_lens;
    p.out = out;
    p.error_flag = error_flag;
    p.batch = batch;
    p.query_len = query_len;
    p.num_heads = num_heads;
    p.num_kv_heads = num_kv_heads;
    p.head_size = head_size;
    p.block_size = block_size;
    p.num_blocks = num_blocks;
    p.max_blocks_per_seq = max_blocks_per_seq;
    p.num_splits = num_splits;
    p.scale = scale;
    p.dtype = static_cast<DType>(dtype);
    p.split_counters = split_counters;
    p.num_split_counters = num_split_counters;
    p.reduce = static_cast<pa::ReduceMode>(reduce_mode);
    p.dependent_launch = dependent_launch;
    p.prefetch_past = prefetch_past;
    return done(pa::launch_paged_attention(p, workspace, workspace_bytes, 0, static_cast<cudaStream_t>(stream)));
}

ES_CAPI int es_write_kv(void const* key, void const* value, int32_t const* slot_mapping, void* k_cache, void* v_cache,
    int32_t* error_flag, int num_tokens, int num_kv_heads, int head_size, int block_size, int num_blocks, int dtype,
    void* stream) {
    pa::WriteKVParams p;
    p.key = key;
    p.value = value;
    p.slot_mapping = slot_mapping;
    p.k_cache = k_cache;
    p.v_cache = v_cache;
    p.error_flag = error_flag;
    p.num_tokens = num_tokens;
    p.num_kv_heads = num_kv_heads;
    p.head_size = head_size;
    p.block_size = block_size;
    p.num_blocks = num_blocks;
    p.dtype = static_cast<DType>(dtype);
    return done(pa::launch_write_kv(p, static_cast<cudaStream_t>(stream)));
}

ES_CAPI int es_sparse_available() { return sg::available() ? 1 : 0; }

ES_CAPI int es_check_24_host(void const* weight, int64_t n, int64_t k) {
    return done(sg::check_24_host(static_cast<uint16_t const*>(weight), n, k));
}

ES_CAPI int es_check_24_device(void const* weight, int64_t n, int64_t k, int64_t* bad_groups, int64_t* first_bad, void* stream) {
    return done(sg::check_24_device(weight, n, k, bad_groups, first_bad, static_cast<cudaStream_t>(stream)));
}

ES_CAPI void* es_sparse_gemm_create(int dtype, int64_t n, int64_t k, void const* d_weight, void* stream) {
    std::unique_ptr<sg::SparseGemm24> g;
    enginesmith::Status st =
        sg::SparseGemm24::create_from_dense(static_cast<DType>(dtype), n, k, d_weight, static_cast<cudaStream_t>(stream), &g);
    if (!st.ok) {
        fail(st);
        return nullptr;
    }
    return g.release();
}

ES_CAPI void* es_sparse_gemm_create_from_blob(void const* blob, size_t bytes, void* stream) {
    std::unique_ptr<sg::SparseGemm24> g;
    enginesmith::Status st = sg::SparseGemm24::create_from_compressed(blob, bytes, static_cast<cudaStream_t>(stream), &g);
    if (!st.ok) {
        fail(st);
        return nullptr;
    }
    return g.release();
}

// Two calls: blob == nullptr reports the size; then the bytes are copied into blob.
ES_CAPI int es_sparse_gemm_export(void* handle, void* blob, size_t* bytes, void* stream) {
    std::vector<uint8_t> data;
    enginesmith::Status st = static_cast<sg::SparseGemm24*>(handle)->export_compressed(&data, static_cast<cudaStream_t>(stream));
    if (!st.ok) return fail(st);
    if (blob != nullptr) {
        if (*bytes < data.size()) return fail(enginesmith::Status::Error("sparse gemm: export buffer too small"));
        std::memcpy(blob, data.data(), data.size());
    }
    *bytes = data.size();
    return 0;
}

// config: cuSPARSELt's kernel configuration, -1 its default (sg::SparseGemm24).
ES_CAPI int es_sparse_gemm_workspace_size(void* handle, int64_t m, int config, size_t* bytes) {
    return done(static_cast<sg::SparseGemm24*>(handle)->workspace_size(m, bytes, config));
}

ES_CAPI int es_sparse_gemm_run(void* handle, void const* x, void* y, int64_t m, void* workspace, size_t workspace_bytes,
    int config, void* stream) {
    return done(static_cast<sg::SparseGemm24*>(handle)->run(x, y, m, workspace, workspace_bytes,
        static_cast<cudaStream_t>(stream), config));
}

ES_CAPI int es_sparse_gemm_algorithm_count(void* handle, int64_t m, int* count) {
    return done(static_cast<sg::SparseGemm24*>(handle)->algorithm_count(m, count));
}

ES_CAPI void es_sparse_gemm_destroy(void* handle) { delete static_cast<sg::SparseGemm24*>(handle); }
