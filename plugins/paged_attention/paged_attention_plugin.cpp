// TensorRT wrapper for paged attention: shape/type checks at build time, kernel launches at enqueue.
#include "paged_attention_plugin.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>

#include "../common/plugin_utils.h"
#include "paged_attention.h"

namespace enginesmith {
namespace trt {
namespace {

using namespace nvinfer1;
namespace pa = paged_attention;

constexpr char const* kName = "PagedAttention";
constexpr char const* kVersion = "1";

bool is_float16ish(DataType t) { return t == DataType::kHALF || t == DataType::kBF16; }

DType to_dtype(DataType t) { return t == DataType::kBF16 ? DType::kBFloat16 : DType::kFloat16; }

std::string dims_str(Dims const& d) {
    std::string s = "[";
    for (int i = 0; i < d.nbDims; ++i) s += (i ? "," : "") + std::to_string(d.d[i]);
    return s + "]";
}

// A static dimension must equal `want`; -1 (dynamic) passes here and is checked again at runtime.
bool dim_is(int64_t got, int64_t want) { return got == -1 || got == want; }

Status validate_config(PagedAttentionConfig const& c) {
    ES_RETURN_IF_ERROR(pa::check_config(DType::kFloat16, c.head_size, c.block_size, c.num_heads, c.num_kv_heads, 1));
    if (c.write_kv != 0 && c.write_kv != 1) return Status::Error("write_kv must be 0 or 1");
    if (c.max_splits < 1 || c.max_splits > pa::kMaxSplits)
        return Status::Error("max_splits must be in [1, " + std::to_string(pa::kMaxSplits) + "]");
    if (!(c.scale >= 0.f)) return Status::Error("scale must be >= 0 (0 means 1/sqrt(head_size))");
    return Status::Ok();
}

}  // namespace

PagedAttentionPlugin::PagedAttentionPlugin(PagedAttentionConfig const& config) : config_(config) {}

PagedAttentionPlugin::~PagedAttentionPlugin() {
    if (error_flag_host_ != nullptr) cudaFreeHost(error_flag_host_);
    if (split_counters_ != nullptr) cudaFree(split_counters_);
    for (int32_t* c : retired_counters_) cudaFree(c);
}

Status PagedAttentionPlugin::ensure_split_counters(int needed, cudaStream_t stream) {
    if (needed <= num_split_counters_) return Status::Ok();
    const int capacity = std::max({needed, 2 * num_split_counters_, 1024});
    // cudaMalloc is not a stream operation; relaxed mode allows it while this thread captures a graph.
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    ES_RETURN_IF_CUDA_ERROR(cudaThreadExchangeStreamCaptureMode(&mode));
    int32_t* fresh = nullptr;
    const cudaError_t alloc = cudaMalloc(reinterpret_cast<void**>(&fresh), sizeof(int32_t) * capacity);
    ES_RETURN_IF_CUDA_ERROR(cudaThreadExchangeStreamCaptureMode(&mode));
    ES_RETURN_IF_CUDA_ERROR(alloc);
    // Zeroed once, in stream order before the kernel that first uses them; kernels leave them zero.
    const cudaError_t zero = cudaMemsetAsync(fresh, 0, sizeof(int32_t) * capacity, stream);
    if (zero != cudaSuccess) {
        cudaFree(fresh);
        ES_RETURN_IF_CUDA_ERROR(zero);
    }
    if (split_counters_ != nullptr) retired_counters_.push_back(split_counters_);  // a graph may still use it
    split_counters_ = fresh;
    num_split_counters_ = capacity;
    return Status::Ok();
}

PagedAttentionPlugin::Io PagedAttentionPlugin::io() const {
    if (config_.write_kv) return Io{0, 1, 2, 3, 4, 5, 6, 7, 8, 3};
    return Io{0, -1, -1, 1, 2, 3, 4, -1, 5, 1};
}

IPluginCapability* PagedAttentionPlugin::getCapabilityInterface(PluginCapabilityType type) noexcept {
    switch (type) {
    case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuildV2*>(this);
    case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
    case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
    }
    return nullptr;
}

IPluginV3* PagedAttentionPlugin::clone() noexcept {
    auto* p = new (std::nothrow) PagedAttentionPlugin(config_);
    if (p) p->slots_ = slots_;
    return p;
}

char const* PagedAttentionPlugin::getPluginName() const noexcept { return kName; }
char const* PagedAttentionPlugin::getPluginVersion() const noexcept { return kVersion; }
char const* PagedAttentionPlugin::getPluginNamespace() const noexcept { return kPluginNamespace; }

int32_t PagedAttentionPlugin::getNbOutputs() const noexcept { return io().nb_outputs; }

int32_t PagedAttentionPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept {
    Io const x = io();
    if (nbInputs != x.nb_inputs || nbOutputs != x.nb_outputs) return -1;
    outputTypes[0] = inputTypes[x.query];
    if (config_.write_kv) {
        outputTypes[1] = inputTypes[x.k_cache];
        outputTypes[2] = inputTypes[x.v_cache];
    }
    return 0;
}

int32_t PagedAttentionPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const*, int32_t,
    DimsExprs* outputs, int32_t nbOutputs, IExprBuilder&) noexcept {
    Io const x = io();
    if (nbInputs != x.nb_inputs || nbOutputs != x.nb_outputs) {
        log_error(std::string("PagedAttention: expected ") + std::to_string(x.nb_inputs) + " inputs and " +
                  std::to_string(x.nb_outputs) + " outputs (write_kv=" + std::to_string(config_.write_kv) + ")");
        return -1;
    }
    outputs[0] = inputs[x.query];
    if (config_.write_kv) {
        outputs[1] = inputs[x.k_cache];
        outputs[2] = inputs[x.v_cache];
    }
    return 0;
}

bool PagedAttentionPlugin::supportsFormatCombination(
    int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept {
    Io const x = io();
    if (nbInputs != x.nb_inputs || nbOutputs != x.nb_outputs || pos < 0 || pos >= nbInputs + nbOutputs) return false;
    PluginTensorDesc const& d = inOut[pos].desc;
    if (d.format != TensorFormat::kLINEAR) return false;
    if (pos == x.block_tables || pos == x.context_lens || pos == x.slot_mapping) return d.type == DataType::kINT32;
    if (pos == x.query) return is_float16ish(d.type);
    return d.type == inOut[x.query].desc.type;  // K/V, caches and outputs share the query's type
}

int32_t PagedAttentionPlugin::configurePlugin(
    DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const*, int32_t nbOutputs) noexcept {
    Io const x = io();
    auto reject = [&](std::string const& why) {
        log_error("PagedAttention: " + why);
        return int32_t{-1};
    };
    if (nbInputs != x.nb_inputs || nbOutputs != x.nb_outputs) return reject("wrong number of inputs/outputs");
    PagedAttentionConfig const& c = config_;
    const DataType t = in[x.query].desc.type;
    if (!is_float16ish(t)) return reject("query must be float16 or bfloat16");
    for (int i = 0; i < nbInputs; ++i) {
        const bool is_int = i == x.block_tables || i == x.context_lens || i == x.slot_mapping;
        if (is_int ? in[i].desc.type != DataType::kINT32 : in[i].desc.type != t)
            return reject("input " + std::to_string(i) + (is_int ? " must be int32" : " must have the query's type"));
    }
    Status st = pa::check_config(to_dtype(in[x.query].desc.type), c.head_size, c.block_size, c.num_heads,
        c.num_kv_heads, static_cast<int>(std::max<int64_t>(1, in[x.query].max.d[1])));
    if (!st.ok) return reject(st.message);
    Dims const& q = in[x.query].desc.dims;
    if (q.nbDims != 4 || !dim_is(q.d[2], c.num_heads) || !dim_is(q.d[3], c.head_size))
        return reject("query must be [B, Sq, " + std::to_string(c.num_heads) + ", " + std::to_string(c.head_size) +
                      "], got " + dims_str(q));
    for (int idx : {x.k_cache, x.v_cache}) {
        Dims const& kc = in[idx].desc.dims;
        if (kc.nbDims != 4 || !dim_is(kc.d[1], c.block_size) || !dim_is(kc.d[2], c.num_kv_heads) ||
            !dim_is(kc.d[3], c.head_size))
            return reject("caches must be [NB, " + std::to_string(c.block_size) + ", " + std::to_string(c.num_kv_heads) +
                          ", " + std::to_string(c.head_size) + "], got " + dims_str(kc));
    }
    if (in[x.block_tables].desc.dims.nbDims != 2) return reject("block_tables must be [B, MB] int32");
    if (in[x.context_lens].desc.dims.nbDims != 1) return reject("context_lens must be [B] int32");
    if (c.write_kv) {
        for (int idx : {x.key, x.value}) {
            Dims const& kv = in[idx].desc.dims;
            if (kv.nbDims != 4 || !dim_is(kv.d[2], c.num_kv_heads) || !dim_is(kv.d[3], c.head_size))
                return reject("key/value must be [B, Sq, " + std::to_string(c.num_kv_heads) + ", " +
                              std::to_string(c.head_size) + "], got " + dims_str(kv));
        }
        Dims const& sm = in[x.slot_mapping].desc.dims;
        if (sm.nbDims != 2) return reject("slot_mapping must be [B, Sq] int32, got " + dims_str(sm));
    }
    return 0;
}

size_t PagedAttentionPlugin::getWorkspaceSize(
    DynamicPluginTensorDesc const* inputs, int32_t nbInputs, DynamicPluginTensorDesc const*, int32_t) const noexcept {
    Io const x = io();
    if (nbInputs != x.nb_inputs) return 0;
    const int max_batch = static_cast<int>(inputs[x.query].max.d[0]);
    const int max_q = static_cast<int>(std::min<int64_t>(inputs[x.query].max.d[1], pa::kMaxQueryLen));
    const int max_blocks = static_cast<int>(inputs[x.block_tables].max.d[1]);
    return pa::workspace_bound(max_batch, max_q, config_.num_heads, config_.num_kv_heads, config_.head_size,
        config_.block_size, max_blocks, config_.max_splits);
}

int32_t PagedAttentionPlugin::getAliasedInput(int32_t outputIndex) noexcept {
    if (!config_.write_kv) return -1;
    Io const x = io();
    if (outputIndex == 1) return x.k_cache;
    if (outputIndex == 2) return x.v_cache;
    return -1;
}

int32_t PagedAttentionPlugin::onShapeChange(PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const*, int32_t) noexcept {
    Io const x = io();
    if (nbInputs != x.nb_inputs) return -1;
    Dims const& q = in[x.query].dims;
    Dims const& kc = in[x.k_cache].dims;
    if (q.d[1] < 1 || q.d[1] > pa::kMaxQueryLen) {
        log_error("PagedAttention: query length " + std::to_string(q.d[1]) + " outside [1, " +
                  std::to_string(pa::kMaxQueryLen) + "]");
        return -1;
    }
    if (in[x.block_tables].dims.d[0] != q.d[0] || in[x.context_lens].dims.d[0] != q.d[0]) {
        log_error("PagedAttention: block_tables/context_lens batch differs from the query's " + std::to_string(q.d[0]));
        return -1;
    }
    if (kc.d[1] != config_.block_size || kc.d[2] != config_.num_kv_heads || kc.d[3] != config_.head_size) {
        log_error("PagedAttention: cache shape " + dims_str(kc) + " does not match the plugin's fields");
        return -1;
    }
    return 0;
}

int32_t PagedAttentionPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const*,
    void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept {
    Io const x = io();
    if (error_flag_host_ == nullptr) {
        if (cudaHostAlloc(reinterpret_cast<void**>(&error_flag_host_), sizeof(int32_t), cudaHostAllocMapped) != cudaSuccess ||
            cudaHostGetDevicePointer(reinterpret_cast<void**>(&error_flag_device_), error_flag_host_, 0) != cudaSuccess) {
            log_error("PagedAttention: cannot allocate the mapped error flag");
            return -1;
        }
        *error_flag_host_ = 0;
    }
    // Errors flagged by earlier launches (their stream work has had time to land; see the header).
    if (const int32_t flag = *const_cast<int32_t volatile*>(error_flag_host_)) {
        log_error(std::string("PagedAttention: invalid data in an earlier call (outputs were set to NaN):") +
                  ((flag & pa::kErrorBlockTable) ? " a block table entry outside [0, num_blocks)" : "") +
                  ((flag & pa::kErrorContextLen) ? " a context length outside [Sq, MB*block_size]" : "") +
                  ((flag & pa::kErrorSlotMapping)
                          ? " a slot mapping entry outside the pool or not its token's slot in the block table"
                          : ""));
        *error_flag_host_ = 0;
        return -1;
    }
    const DType dtype_in = to_dtype(inputDesc[x.query].type);
    if (slots_ == 0) {
        Status st = pa::resident_slots(dtype_in, config_.head_size, config_.block_size, &slots_);
        if (!st.ok) {
            log_error("PagedAttention: " + st.message);
            return -1;
        }
    }
    Dims const& q = inputDesc[x.query].dims;
    Dims const& kc = inputDesc[x.k_cache].dims;
    Dims const& bt = inputDesc[x.block_tables].dims;
    const DType dtype = to_dtype(inputDesc[x.query].type);
    const int batch = static_cast<int>(q.d[0]);
    const int query_len = static_cast<int>(q.d[1]);
    void* k_cache = config_.write_kv ? outputs[1] : const_cast<void*>(inputs[x.k_cache]);
    void* v_cache = config_.write_kv ? outputs[2] : const_cast<void*>(inputs[x.v_cache]);

    pa::Params p;
    if (config_.write_kv) {
        // The fused KV write (one kernel; the separate write_kv kernel cost ~2.9 us a call at batch 1
        // on an H100): the attention kernel stores the new tokens at their slots and reads them from
        // key/value. Each slot must be its token's slot in the block table (the paged-KV runtime
        // derives the mapping from the table); anything else is flagged, not written.
        p.new_key = inputs[x.key];
        p.new_value = inputs[x.value];
        p.slot_mapping = static_cast<int32_t const*>(inputs[x.slot_mapping]);
    }
    p.query = inputs[x.query];
    p.k_cache = k_cache;
    p.v_cache = v_cache;
    p.block_tables = static_cast<int32_t const*>(inputs[x.block_tables]);
    p.context_lens = static_cast<int32_t const*>(inputs[x.context_lens]);
    p.out = outputs[0];
    p.error_flag = error_flag_device_;
    p.batch = batch;
    p.query_len = query_len;
    p.num_heads = config_.num_heads;
    p.num_kv_heads = config_.num_kv_heads;
    p.head_size = config_.head_size;
    p.block_size = config_.block_size;
    p.num_blocks = static_cast<int>(kc.d[0]);
    p.max_blocks_per_seq = static_cast<int>(bt.d[1]);
    p.scale = config_.scale;
    p.dtype = dtype;
    // prefetch_past stays off: with the separate write_kv kernel in front it measured no faster on an
    // H100 (benchmarks/plugins/results/h100_session7_paged_prefetch*.json, mode wkv-prefetch).
    // Same rule getWorkspaceSize sized for (workspace_bound), so the workspace always fits.
    p.num_splits = std::min<int>(config_.max_splits,
        pa::choose_num_splits(batch, query_len, p.num_heads, p.num_kv_heads, p.max_blocks_per_seq, p.block_size,
            std::min(slots_, pa::kSlotBudget)));
    const size_t ws = pa::workspace_size(batch, query_len, p.num_heads, p.head_size, p.num_splits);
    Status st = Status::Ok();
    if (p.num_splits > 1 && pa::default_reduce_mode() == pa::ReduceMode::kLastBlock) {
        st = ensure_split_counters(pa::split_counters_needed(batch, query_len, p.num_heads, p.num_kv_heads), stream);
        if (!st.ok) {
            log_error("PagedAttention: split counters: " + st.message);
            return -1;
        }
        p.split_counters = split_counters_;
        p.num_split_counters = num_split_counters_;
        p.reduce = pa::ReduceMode::kLastBlock;
    } else {
        p.reduce = pa::ReduceMode::kSeparateKernel;
    }
    st = pa::launch_paged_attention(p, workspace, ws, slots_, stream);
    if (!st.ok) {
        log_error("PagedAttention: " + st.message);
        return -1;
    }
    return 0;
}

IPluginV3* PagedAttentionPlugin::attachToContext(IPluginResourceContext*) noexcept { return clone(); }

PluginFieldCollection const* PagedAttentionPlugin::getFieldsToSerialize() noexcept {
    serialized_.clear();
    serialized_.emplace_back("num_heads", &config_.num_heads, PluginFieldType::kINT32, 1);
    serialized_.emplace_back("num_kv_heads", &config_.num_kv_heads, PluginFieldType::kINT32, 1);
    serialized_.emplace_back("head_size", &config_.head_size, PluginFieldType::kINT32, 1);
    serialized_.emplace_back("block_size", &config_.block_size, PluginFieldType::kINT32, 1);
    serialized_.emplace_back("scale", &config_.scale, PluginFieldType::kFLOAT32, 1);
    serialized_.emplace_back("write_kv", &config_.write_kv, PluginFieldType::kINT32, 1);
    serialized_.emplace_back("max_splits", &config_.max_splits, PluginFieldType::kINT32, 1);
    serialized_fc_.nbFields = static_cast<int32_t>(serialized_.size());
    serialized_fc_.fields = serialized_.data();
    return &serialized_fc_;
}

PagedAttentionCreator::PagedAttentionCreator() {
    fields_.emplace_back("num_heads", nullptr, PluginFieldType::kINT32, 1);
    fields_.emplace_back("num_kv_heads", nullptr, PluginFieldType::kINT32, 1);
    fields_.emplace_back("head_size", nullptr, PluginFieldType::kINT32, 1);
    fields_.emplace_back("block_size", nullptr, PluginFieldType::kINT32, 1);
    fields_.emplace_back("scale", nullptr, PluginFieldType::kFLOAT32, 1);
    fields_.emplace_back("write_kv", nullptr, PluginFieldType::kINT32, 1);
    fields_.emplace_back("max_splits", nullptr, PluginFieldType::kINT32, 1);
    fc_.nbFields = static_cast<int32_t>(fields_.size());
    fc_.fields = fields_.data();
}

PluginFieldCollection const* PagedAttentionCreator::getFieldNames() noexcept { return &fc_; }

IPluginV3* PagedAttentionCreator::createPlugin(char const* name, PluginFieldCollection const* fc, TensorRTPhase) noexcept {
    FieldReader r(fc);
    PagedAttentionConfig c;
    c.num_heads = r.get_int("num_heads", 0, true);
    c.num_kv_heads = r.get_int("num_kv_heads", 0, true);
    c.head_size = r.get_int("head_size", 0, true);
    c.block_size = r.get_int("block_size", 0, true);
    c.scale = r.get_float("scale", 0.f);
    c.write_kv = r.get_int("write_kv", 1, false);
    c.max_splits = r.get_int("max_splits", 64, false);
    if (r.ok()) {
        Status st = validate_config(c);
        if (!st.ok) r.error(st.message);
    }
    if (!r.ok()) {
        log_error(std::string("PagedAttention '") + (name ? name : "") + "': " + r.message());
        return nullptr;
    }
    return new (std::nothrow) PagedAttentionPlugin(c);
}

char const* PagedAttentionCreator::getPluginName() const noexcept { return kName; }
char const* PagedAttentionCreator::getPluginVersion() const noexcept { return kVersion; }
char const* PagedAttentionCreator::getPluginNamespace() const noexcept { return kPluginNamespace; }

}  // namespace trt
}  // namespace enginesmith
