// TensorRT IPluginV3 wrapper for paged attention (layer 4). Compiled against the TensorRT headers;
// TensorRT itself cannot be installed on this project's machines, so this wrapper is compiled, never
// run here (the kernels under it are tested through the ctypes binding).
//
// Plugin "PagedAttention", version "1", namespace "enginesmith".
// Fields (build): num_heads, num_kv_heads, head_size, block_size (int32, required);
//                 scale (float32, 0 = 1/sqrt(head_size)); write_kv (int32, default 1);
//                 max_splits (int32, default 64, <= kMaxSplits).
//
// write_kv = 1  inputs:  0 query [B,Sq,H,D]  1 key [B,Sq,Hkv,D]  2 value [B,Sq,Hkv,D]
//                        3 k_cache [NB,BS,Hkv,D]  4 v_cache  5 block_tables [B,MB] i32
//                        6 context_lens [B] i32  7 slot_mapping [B,Sq] i32 (-1 = padding)
//               outputs: 0 out [B,Sq,H,D]  1 k_cache (aliases input 3)  2 v_cache (aliases input 4)
//               The aliasing needs the builder's PreviewFeature::kALIASED_PLUGIN_IO_10_03.
//               One kernel writes the new tokens and attends (Params' fused KV write): each slot must
//               be its token's slot in the block table (-1 skips the token); others are flagged.
// write_kv = 0  inputs:  0 query  1 k_cache  2 v_cache  3 block_tables  4 context_lens;  output: 0 out
//
// Memory: the split-K partials live in TensorRT's per-enqueue workspace (getWorkspaceSize, scratch).
// The single-kernel split merge (ReduceMode::kLastBlock) also needs int32 counters that persist
// between calls (B * Hkv * ceil(G*Sq/16) of them); TensorRT's workspace is shared with other layers,
// so the plugin owns them: enqueue allocates them when a shape needs more than it holds (cudaMalloc
// in relaxed capture mode, so also while TensorRT captures a CUDA graph) and zeroes them once with a
// cudaMemsetAsync on the enqueue stream, ordered before the kernel (captured as a memset node if the
// stream is being captured); every kernel call leaves them zero. Each execution context has its own
// plugin clone (attachToContext), hence its own counters. Replaced buffers are freed with the plugin,
// since a captured graph may still use them. $ES_PAGED_ATTENTION_REDUCE=two selects the reduce kernel.
//
// Bad configuration (head size, block size, heads, query length, dtypes, shapes) is rejected by the
// creator or configurePlugin with a logged error. Bad data (a page index outside the pool, a context
// length beyond the block table, a slot not its token's) is only visible on the device: the kernel writes NaN for that
// sequence and sets a host-mapped flag, and the next enqueue logs the error and fails.
#pragma once

#include <NvInferRuntime.h>
#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include "../common/status.h"

namespace enginesmith {
namespace trt {

struct PagedAttentionConfig {
    int32_t num_heads = 0;
    int32_t num_kv_heads = 0;
    int32_t head_size = 0;
    int32_t block_size = 0;
    float scale = 0.f;
    int32_t write_kv = 1;
    int32_t max_splits = 64;
};

class PagedAttentionPlugin : public nvinfer1::IPluginV3,
                             public nvinfer1::IPluginV3OneCore,
                             public nvinfer1::IPluginV3OneBuildV2,
                             public nvinfer1::IPluginV3OneRuntime {
public:
    explicit PagedAttentionPlugin(PagedAttentionConfig const& config);
    ~PagedAttentionPlugin() override;

    // IPluginV3
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
    nvinfer1::IPluginV3* clone() noexcept override;

    // IPluginV3OneCore
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

    // IPluginV3OneBuild(V2)
    int32_t getNbOutputs() const noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs, nvinfer1::DataType const* inputTypes,
        int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
        int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
        nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;
    int32_t getAliasedInput(int32_t outputIndex) noexcept override;

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
        int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

    // Tensor positions for this config (write_kv decides the I/O list).
    struct Io {
        int query, key, value, k_cache, v_cache, block_tables, context_lens, slot_mapping;
        int nb_inputs, nb_outputs;
    };
    Io io() const;

private:
    PagedAttentionConfig config_;
    int slots_ = 0;  // resident blocks on this GPU (pa::resident_slots), for the split choice
    int32_t* error_flag_host_ = nullptr;  // cudaHostAllocMapped: written by the kernels
    int32_t* error_flag_device_ = nullptr;
    int32_t* split_counters_ = nullptr;  // persistent, zeroed at allocation; see the header comment
    int num_split_counters_ = 0;
    std::vector<int32_t*> retired_counters_;  // outgrown buffers, freed with the plugin
    Status ensure_split_counters(int needed, cudaStream_t stream);
    std::vector<nvinfer1::PluginField> serialized_;
    nvinfer1::PluginFieldCollection serialized_fc_{};
};

class PagedAttentionCreator : public nvinfer1::IPluginCreatorV3One {
public:
    PagedAttentionCreator();
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
    nvinfer1::IPluginV3* createPlugin(
        char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept override;
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

private:
    std::vector<nvinfer1::PluginField> fields_;
    nvinfer1::PluginFieldCollection fc_{};
};

}  // namespace trt
}  // namespace enginesmith
