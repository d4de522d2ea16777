// TensorRT wrapper for the 2:4 sparse GEMM.
#include "sparse_gemm_plugin.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <mutex>
#include <string>

#include "../common/plugin_utils.h"
#include "sparse_gemm.h"

namespace enginesmith {
namespace trt {

using namespace nvinfer1;
namespace sg = sparse_gemm;

namespace {
constexpr char const* kName = "SparseGemm24";
constexpr char const* kVersion = "1";

DataType to_trt(DType t) { return t == DType::kBFloat16 ? DataType::kBF16 : DataType::kHALF; }
}  // namespace

// Shared by a plugin and its clones: the weight in one of its two forms and, once a GPU is at hand,
// the cuSPARSELt object holding the compressed weight.
struct SparseGemmState {
    DType dtype = DType::kFloat16;
    int64_t n = 0, k = 0;
    std::vector<uint16_t> dense;       // build phase: W [N, K] as given (validated 2:4)
    std::vector<uint8_t> compressed;   // runtime phase, and after serialization
    int64_t workspace_bytes = 0;       // bound computed at build time, serialized
    int64_t m_opt = 256;               // the profile's opt M (build phase): where tactics are counted
    std::mutex mutex;
    std::unique_ptr<sg::SparseGemm24> gemm;

    Status ensure_gemm(cudaStream_t stream) {
        std::lock_guard<std::mutex> lock(mutex);
        if (gemm) return Status::Ok();
        if (!compressed.empty()) return sg::SparseGemm24::create_from_compressed(compressed.data(), compressed.size(), stream, &gemm);
        void* d = nullptr;
        const size_t bytes = dense.size() * sizeof(uint16_t);
        ES_RETURN_IF_CUDA_ERROR(cudaMalloc(&d, bytes));
        Status st = cudaStatus(cudaMemcpyAsync(d, dense.data(), bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
        if (st.ok) st = sg::SparseGemm24::create_from_dense(dtype, n, k, d, stream, &gemm);
        cudaStreamSynchronize(stream);
        cudaFree(d);
        return st;
    }
};

SparseGemm24Plugin::SparseGemm24Plugin(std::shared_ptr<SparseGemmState> state) : state_(std::move(state)) {}
SparseGemm24Plugin::~SparseGemm24Plugin() = default;

IPluginCapability* SparseGemm24Plugin::getCapabilityInterface(PluginCapabilityType type) noexcept {
    switch (type) {
    case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuild*>(this);
    case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
    case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
    }
    return nullptr;
}

IPluginV3* SparseGemm24Plugin::clone() noexcept {
    auto* copy = new (std::nothrow) SparseGemm24Plugin(state_);
    if (copy != nullptr) copy->tactic_ = tactic_;
    return copy;
}

namespace {
int64_t rows_of(Dims const& d) {  // M: the product of every dimension but the last (>= 1)
    int64_t m = 1;
    for (int i = 0; i < d.nbDims - 1; ++i) m *= std::max<int64_t>(d.d[i], 1);
    return m;
}
}  // namespace

char const* SparseGemm24Plugin::getPluginName() const noexcept { return kName; }
char const* SparseGemm24Plugin::getPluginVersion() const noexcept { return kVersion; }
char const* SparseGemm24Plugin::getPluginNamespace() const noexcept { return kPluginNamespace; }

int32_t SparseGemm24Plugin::getNbOutputs() const noexcept { return 1; }

int32_t SparseGemm24Plugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept {
    if (nbInputs != 1 || nbOutputs != 1) return -1;
    outputTypes[0] = inputTypes[0];
    return 0;
}

int32_t SparseGemm24Plugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const*, int32_t,
    DimsExprs* outputs, int32_t nbOutputs, IExprBuilder& exprBuilder) noexcept {
    if (nbInputs != 1 || nbOutputs != 1 || inputs[0].nbDims < 1) {
        log_error("SparseGemm24: expects one input X[..., K] and one output");
        return -1;
    }
    outputs[0] = inputs[0];
    outputs[0].d[inputs[0].nbDims - 1] = exprBuilder.constant(state_->n);
    return 0;
}

bool SparseGemm24Plugin::supportsFormatCombination(
    int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept {
    if (nbInputs != 1 || nbOutputs != 1 || pos < 0 || pos > 1) return false;
    return inOut[pos].desc.format == TensorFormat::kLINEAR && inOut[pos].desc.type == to_trt(state_->dtype);
}

int32_t SparseGemm24Plugin::configurePlugin(
    DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const*, int32_t nbOutputs) noexcept {
    if (nbInputs != 1 || nbOutputs != 1) return -1;
    Dims const& d = in[0].desc.dims;
    if (d.nbDims < 1 || (d.d[d.nbDims - 1] != -1 && d.d[d.nbDims - 1] != state_->k)) {
        log_error("SparseGemm24: input's last dimension must be in_features=" + std::to_string(state_->k));
        return -1;
    }
    if (in[0].desc.type != to_trt(state_->dtype)) {
        log_error(std::string("SparseGemm24: input type must match the weight's (") + dtypeName(state_->dtype) + ")");
        return -1;
    }
    state_->m_opt = rows_of(in[0].opt);
    return 0;
}

int32_t SparseGemm24Plugin::getNbTactics() noexcept {
    Status st = state_->ensure_gemm(nullptr);
    int count = 0;
    if (st.ok) st = state_->gemm->algorithm_count(state_->m_opt, &count);
    if (!st.ok) {
        log_error("SparseGemm24: " + st.message);
        return 0;  // the default selection only
    }
    return count;
}

int32_t SparseGemm24Plugin::getValidTactics(int32_t* tactics, int32_t nbTactics) noexcept {
    for (int32_t i = 0; i < nbTactics; ++i) tactics[i] = i + 1;  // configuration i; 0 is TensorRT's default
    return 0;
}

int32_t SparseGemm24Plugin::setTactic(int32_t tactic) noexcept {
    if (tactic < 0) {
        log_error("SparseGemm24: tactic " + std::to_string(tactic) + " is not one this plugin offered");
        return -1;
    }
    tactic_ = tactic;
    return 0;
}

size_t SparseGemm24Plugin::getWorkspaceSize(
    DynamicPluginTensorDesc const* inputs, int32_t nbInputs, DynamicPluginTensorDesc const*, int32_t) const noexcept {
    if (nbInputs != 1) return 0;
    Status st = state_->ensure_gemm(nullptr);
    if (!st.ok) {
        log_error("SparseGemm24: " + st.message);
        return 0;
    }
    const int64_t m_max = rows_of(inputs[0].max);
    int count = 0;
    if (!state_->gemm->algorithm_count(m_max, &count).ok) count = 0;
    // Plans differ per M and tactic; take the largest need over powers of two up to the maximum and
    // the maximum, for the default selection and every configuration.
    size_t bound = 0;
    for (int64_t m = 1;; m = std::min(m * 2, m_max)) {
        for (int config = -1; config < count; ++config) {
            size_t bytes = 0;
            if (state_->gemm->workspace_size(m, &bytes, config).ok) bound = std::max(bound, bytes);
        }
        if (m == m_max) break;
    }
    state_->workspace_bytes = std::max<int64_t>(state_->workspace_bytes, static_cast<int64_t>(bound));
    return bound;
}

int32_t SparseGemm24Plugin::onShapeChange(PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const*, int32_t) noexcept {
    if (nbInputs != 1) return -1;
    if (in[0].dims.d[in[0].dims.nbDims - 1] != state_->k) {
        log_error("SparseGemm24: input's last dimension must be in_features=" + std::to_string(state_->k));
        return -1;
    }
    return 0;
}

int32_t SparseGemm24Plugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const*, void const* const* inputs,
    void* const* outputs, void* workspace, cudaStream_t stream) noexcept {
    Status st = state_->ensure_gemm(stream);
    int64_t m = 1;
    Dims const& d = inputDesc[0].dims;
    for (int i = 0; i < d.nbDims - 1; ++i) m *= d.d[i];
    int config = tactic_ - 1;  // -1: the default selection
    size_t need = 0;
    if (st.ok) {
        st = state_->gemm->workspace_size(m, &need, config);
        if (!st.ok && config >= 0) {  // the tactic was timed at the opt M; this M has no such plan
            config = -1;
            st = state_->gemm->workspace_size(m, &need, config);
        }
    }
    if (st.ok && static_cast<int64_t>(need) > state_->workspace_bytes)
        st = Status::Error("workspace for M=" + std::to_string(m) + " exceeds the bound sized at build time");
    if (st.ok) st = state_->gemm->run(inputs[0], outputs[0], m, workspace, need, stream, config);
    if (!st.ok) {
        log_error("SparseGemm24: " + st.message);
        return -1;
    }
    return 0;
}

IPluginV3* SparseGemm24Plugin::attachToContext(IPluginResourceContext*) noexcept { return clone(); }

PluginFieldCollection const* SparseGemm24Plugin::getFieldsToSerialize() noexcept {
    serialized_.clear();
    if (state_->compressed.empty()) {
        Status st = state_->ensure_gemm(nullptr);
        if (st.ok) st = state_->gemm->export_compressed(&state_->compressed, nullptr);
        if (!st.ok) {
            log_error("SparseGemm24: cannot serialize the compressed weight: " + st.message);
            serialized_fc_.nbFields = 0;
            serialized_fc_.fields = nullptr;
            return &serialized_fc_;
        }
    }
    static thread_local int32_t n32, k32, dtype32;
    n32 = static_cast<int32_t>(state_->n);
    k32 = static_cast<int32_t>(state_->k);
    dtype32 = static_cast<int32_t>(state_->dtype);
    serialized_.emplace_back("compressed", state_->compressed.data(), PluginFieldType::kUNKNOWN,
        static_cast<int32_t>(state_->compressed.size()));
    serialized_.emplace_back("out_features", &n32, PluginFieldType::kINT32, 1);
    serialized_.emplace_back("in_features", &k32, PluginFieldType::kINT32, 1);
    serialized_.emplace_back("dtype", &dtype32, PluginFieldType::kINT32, 1);
    serialized_.emplace_back("workspace_bytes", &state_->workspace_bytes, PluginFieldType::kINT64, 1);
    serialized_fc_.nbFields = static_cast<int32_t>(serialized_.size());
    serialized_fc_.fields = serialized_.data();
    return &serialized_fc_;
}

SparseGemm24Creator::SparseGemm24Creator() {
    fields_.emplace_back("weight", nullptr, PluginFieldType::kFLOAT16, 0);
    fields_.emplace_back("out_features", nullptr, PluginFieldType::kINT32, 1);
    fields_.emplace_back("in_features", nullptr, PluginFieldType::kINT32, 1);
    fc_.nbFields = static_cast<int32_t>(fields_.size());
    fc_.fields = fields_.data();
}

PluginFieldCollection const* SparseGemm24Creator::getFieldNames() noexcept { return &fc_; }

IPluginV3* SparseGemm24Creator::createPlugin(char const* name, PluginFieldCollection const* fc, TensorRTPhase phase) noexcept {
    FieldReader r(fc);
    auto state = std::make_shared<SparseGemmState>();
    state->n = r.get_int("out_features", 0, true);
    state->k = r.get_int("in_features", 0, true);
    if (phase == TensorRTPhase::kRUNTIME) {
        state->dtype = static_cast<DType>(r.get_int("dtype", 0, true));
        PluginField const* blob = r.find("compressed");
        PluginField const* ws = r.find("workspace_bytes");
        if (blob == nullptr || blob->type != PluginFieldType::kUNKNOWN || blob->length <= 0)
            r.error("missing field 'compressed' (the engine was not built by this plugin library)");
        else
            state->compressed.assign(static_cast<uint8_t const*>(blob->data),
                static_cast<uint8_t const*>(blob->data) + blob->length);
        if (ws != nullptr && ws->type == PluginFieldType::kINT64 && ws->length == 1)
            state->workspace_bytes = *static_cast<int64_t const*>(ws->data);
        else
            r.error("missing field 'workspace_bytes' (int64)");
    } else {
        PluginField const* w = r.find("weight");
        if (w == nullptr || w->data == nullptr)
            r.error("missing field 'weight' (W [out_features, in_features], float16 or bfloat16)");
        else if (w->type != PluginFieldType::kFLOAT16 && w->type != PluginFieldType::kBF16)
            r.error("field 'weight' must be float16 or bfloat16");
        else if (static_cast<int64_t>(w->length) != state->n * state->k)
            r.error("field 'weight' has " + std::to_string(w->length) + " values, out_features*in_features is " +
                    std::to_string(state->n * state->k));
        else {
            state->dtype = w->type == PluginFieldType::kBF16 ? DType::kBFloat16 : DType::kFloat16;
            state->dense.assign(static_cast<uint16_t const*>(w->data), static_cast<uint16_t const*>(w->data) + w->length);
        }
    }
    if (r.ok()) {
        Status st = sg::check_config(state->dtype, state->n, state->k);
        if (st.ok && phase != TensorRTPhase::kRUNTIME) st = sg::check_24_host(state->dense.data(), state->n, state->k);
        if (st.ok && !sg::available()) st = Status::Error("this plugin library was built without cuSPARSELt");
        if (!st.ok) r.error(st.message);
    }
    if (!r.ok()) {
        log_error(std::string("SparseGemm24 '") + (name ? name : "") + "': " + r.message());
        return nullptr;
    }
    return new (std::nothrow) SparseGemm24Plugin(state);
}

char const* SparseGemm24Creator::getPluginName() const noexcept { return kName; }
char const* SparseGemm24Creator::getPluginVersion() const noexcept { return kVersion; }
char const* SparseGemm24Creator::getPluginNamespace() const noexcept { return kPluginNamespace; }

}  // namespace trt
}  // namespace enginesmith
