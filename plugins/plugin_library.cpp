// The plugin library's entry points:
//  - getCreators / setLoggerFinder: what IPluginRegistry::loadLibrary and trtexec --dynamicPlugins use;
//  - REGISTER_TENSORRT_PLUGIN: static registration at load time (trtexec --staticPlugins, polygraphy).
// (The wrappers' logger lives in common/plugin_log.cpp.)
#include <NvInferRuntime.h>

#include "common/plugin_utils.h"
#include "paged_attention/paged_attention_plugin.h"
#include "sparse_gemm/sparse_gemm_plugin.h"

// The library is built with hidden visibility; these two are what TensorRT looks up by name
// (TENSORRTAPI only exports when building TensorRT itself).
#define ES_PLUGIN_EXPORT __attribute__((visibility("default")))

namespace {
using enginesmith::trt::PagedAttentionCreator;
using enginesmith::trt::SparseGemm24Creator;
}  // namespace

#if !defined(ENGINESMITH_NO_STATIC_REGISTRATION)
REGISTER_TENSORRT_PLUGIN(PagedAttentionCreator);
REGISTER_TENSORRT_PLUGIN(SparseGemm24Creator);
#endif

extern "C" ES_PLUGIN_EXPORT void setLoggerFinder(nvinfer1::ILoggerFinder* finder) {
    enginesmith::trt::set_logger_finder(finder);
}

extern "C" ES_PLUGIN_EXPORT nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
    static PagedAttentionCreator paged_attention;
    static SparseGemm24Creator sparse_gemm;
    static nvinfer1::IPluginCreatorInterface* const creators[] = {&paged_attention, &sparse_gemm};
    nbCreators = 2;
    return creators;
}
