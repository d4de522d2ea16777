// A host-only harness over the TensorRT wrappers' validation, for CPU tests: it calls the creators'
// createPlugin and the plugins' configurePlugin directly, as TensorRT would, and captures what they
// log. No TensorRT library is loaded or needed (these paths call no libnvinfer function), so this
// checks our wrappers' input validation, not TensorRT's behaviour.
#include <NvInferRuntime.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../common/plugin_utils.h"
#include "../paged_attention/paged_attention_plugin.h"
#include "../sparse_gemm/sparse_gemm_plugin.h"

#define ES_CAPI extern "C" __attribute__((visibility("default")))

namespace {
using namespace nvinfer1;

class CapturingLogger : public ILogger {
public:
    void log(Severity severity, AsciiChar const* msg) noexcept override {
        if (severity <= Severity::kWARNING) messages += std::string(messages.empty() ? "" : "\n") + msg;
    }
    std::string messages;
};

class Finder : public ILoggerFinder {
public:
    ILogger* findLogger() override { return &logger; }
    CapturingLogger logger;
};

Finder& finder() {
    static Finder* f = new Finder();  // lives for the process (TensorRT owns its finder likewise)
    return *f;
}

int finish(bool ok, char* err, int err_len) {
    std::string const& m = finder().logger.messages;
    if (err != nullptr && err_len > 0) {
        std::strncpy(err, m.c_str(), static_cast<size_t>(err_len) - 1);
        err[err_len - 1] = '\0';
    }
    return ok ? 0 : -1;
}

void begin() {
    enginesmith::trt::set_logger_finder(&finder());
    finder().logger.messages.clear();
}

Dims dims_of(int64_t const* d, int n) {
    Dims x{};
    x.nbDims = n;
    for (int i = 0; i < n; ++i) x.d[i] = d[i];
    return x;
}

DynamicPluginTensorDesc desc(Dims const& d, DataType t) {
    DynamicPluginTensorDesc x{};
    x.desc.dims = d;
    x.desc.type = t;
    x.desc.format = TensorFormat::kLINEAR;
    x.min = d;
    x.max = d;
    x.opt = d;
    return x;
}

PluginFieldCollection paged_fields(std::vector<PluginField>& f, int32_t const* v) {
    f = {PluginField("num_heads", &v[0], PluginFieldType::kINT32, 1),
        PluginField("num_kv_heads", &v[1], PluginFieldType::kINT32, 1),
        PluginField("head_size", &v[2], PluginFieldType::kINT32, 1),
        PluginField("block_size", &v[3], PluginFieldType::kINT32, 1),
        PluginField("write_kv", &v[4], PluginFieldType::kINT32, 1)};
    return PluginFieldCollection{static_cast<int32_t>(f.size()), f.data()};
}
}  // namespace

// createPlugin(kBUILD) for PagedAttention; 0 when a plugin came back.
ES_CAPI int es_trt_paged_attention_create(int num_heads, int num_kv_heads, int head_size, int block_size, int write_kv,
    char* err, int err_len) {
    begin();
    int32_t const v[5] = {num_heads, num_kv_heads, head_size, block_size, write_kv};
    std::vector<PluginField> f;
    PluginFieldCollection fc = paged_fields(f, v);
    enginesmith::trt::PagedAttentionCreator creator;
    std::unique_ptr<IPluginV3> p(creator.createPlugin("check", &fc, TensorRTPhase::kBUILD));
    return finish(p != nullptr, err, err_len);
}

// configurePlugin for PagedAttention (write_kv = 0) with the given query / cache dims and a
// block table [B, MB]; dtype 0 = fp16, 1 = bf16, 2 = fp32 (unsupported).
ES_CAPI int es_trt_paged_attention_configure(int num_heads, int num_kv_heads, int head_size, int block_size,
    int64_t const* query_dims, int64_t const* cache_dims, int64_t batch, int64_t max_blocks, int dtype, char* err,
    int err_len) {
    begin();
    int32_t const v[5] = {num_heads, num_kv_heads, head_size, block_size, 0};
    std::vector<PluginField> f;
    PluginFieldCollection fc = paged_fields(f, v);
    enginesmith::trt::PagedAttentionCreator creator;
    std::unique_ptr<IPluginV3> p(creator.createPlugin("check", &fc, TensorRTPhase::kBUILD));
    if (!p) return finish(false, err, err_len);
    auto* build = static_cast<IPluginV3OneBuild*>(p->getCapabilityInterface(PluginCapabilityType::kBUILD));
    DataType const t = dtype == 0 ? DataType::kHALF : dtype == 1 ? DataType::kBF16 : DataType::kFLOAT;
    int64_t const bt[2] = {batch, max_blocks};
    int64_t const cl[1] = {batch};
    DynamicPluginTensorDesc in[5] = {desc(dims_of(query_dims, 4), t), desc(dims_of(cache_dims, 4), t),
        desc(dims_of(cache_dims, 4), t), desc(dims_of(bt, 2), DataType::kINT32), desc(dims_of(cl, 1), DataType::kINT32)};
    DynamicPluginTensorDesc out[1] = {desc(dims_of(query_dims, 4), t)};
    return finish(build->configurePlugin(in, 5, out, 1) == 0, err, err_len);
}

// createPlugin(kBUILD) for SparseGemm24 with W [n, k] (16-bit values on the host).
ES_CAPI int es_trt_sparse_gemm_create(uint16_t const* weight, int n, int k, int bf16, char* err, int err_len) {
    begin();
    int32_t const nn = n, kk = k;
    std::vector<PluginField> f = {
        PluginField("weight", weight, bf16 ? PluginFieldType::kBF16 : PluginFieldType::kFLOAT16, n * k),
        PluginField("out_features", &nn, PluginFieldType::kINT32, 1),
        PluginField("in_features", &kk, PluginFieldType::kINT32, 1)};
    PluginFieldCollection fc{static_cast<int32_t>(f.size()), f.data()};
    enginesmith::trt::SparseGemm24Creator creator;
    std::unique_ptr<IPluginV3> p(creator.createPlugin("check", &fc, TensorRTPhase::kBUILD));
    return finish(p != nullptr, err, err_len);
}

// getFieldNames of both creators, joined by ',' (what ONNX attributes the lowering must emit).
ES_CAPI int es_trt_field_names(char* out, int out_len) {
    enginesmith::trt::PagedAttentionCreator pa;
    enginesmith::trt::SparseGemm24Creator sg;
    std::string s;
    for (IPluginCreatorV3One* c : {static_cast<IPluginCreatorV3One*>(&pa), static_cast<IPluginCreatorV3One*>(&sg)}) {
        s += std::string(s.empty() ? "" : ";") + c->getPluginName() + ":";
        PluginFieldCollection const* fc = c->getFieldNames();
        for (int i = 0; i < fc->nbFields; ++i) s += std::string(i ? "," : "") + fc->fields[i].name;
    }
    std::strncpy(out, s.c_str(), static_cast<size_t>(out_len) - 1);
    out[out_len - 1] = '\0';
    return 0;
}
