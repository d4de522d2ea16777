// TensorRT IPluginV3 wrapper for the 2:4 sparse GEMM (layer 4). Compiled against the TensorRT
// headers, never run here (TensorRT cannot be installed on this project's machines).
//
// Plugin "SparseGemm24", version "1", namespace "enginesmith".   Y[..., N] = X[..., K] · Wᵀ
// Fields at build:   weight (kFLOAT16 | kBF16, N*K values, W [N, K] row-major, 2:4 along K),
//                    out_features N, in_features K (int32).
// Fields serialized: compressed (kUNKNOWN bytes: header + cuSPARSELt's compressed W), out_features,
//                    in_features, dtype (int32, enginesmith::DType), workspace_bytes (kINT64).
// The creator validates the 2:4 pattern on the host and rejects a weight that breaks it (the error
// names the first bad group). W is compressed once, on the GPU, when the engine is built; the engine
// then carries only the compressed weight, tied to the cuSPARSELt version and SM that made it.
// Tactics: cuSPARSELt's kernel configurations, tactic c + 1 for configuration c (0: its default
// selection); TensorRT times them at the profile's opt shape and keeps the fastest in the engine
// (on an H100 the best configuration beat the default by up to 1.9x at M = 2048).
#pragma once

#include <NvInferRuntime.h>

#include <memory>
#include <string>
#include <vector>

#include "../common/status.h"

namespace enginesmith {
namespace sparse_gemm {
class SparseGemm24;
}

namespace trt {

struct SparseGemmState;  // weights (dense for build or compressed for runtime) + the cuSPARSELt object

class SparseGemm24Plugin : public nvinfer1::IPluginV3,
                           public nvinfer1::IPluginV3OneCore,
                           public nvinfer1::IPluginV3OneBuild,
                           public nvinfer1::IPluginV3OneRuntime {
public:
    explicit SparseGemm24Plugin(std::shared_ptr<SparseGemmState> state);
    ~SparseGemm24Plugin() override;

    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
    nvinfer1::IPluginV3* clone() noexcept override;

    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

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
    int32_t getNbTactics() noexcept override;
    int32_t getValidTactics(int32_t* tactics, int32_t nbTactics) noexcept override;

    int32_t setTactic(int32_t tactic) noexcept override;

    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
        int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

private:
    std::shared_ptr<SparseGemmState> state_;
    int32_t tactic_ = 0;  // 0: cuSPARSELt's default selection; c + 1: kernel configuration c
    std::vector<nvinfer1::PluginField> serialized_;
    nvinfer1::PluginFieldCollection serialized_fc_{};
};

class SparseGemm24Creator : public nvinfer1::IPluginCreatorV3One {
public:
    SparseGemm24Creator();
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
