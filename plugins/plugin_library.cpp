// The plugin library's entry points:
//  - getCreators / setLoggerFinder: what IPluginRegistry::loadLibrary and trtexec --dynamicPlugins use;
//  - REGISTER_TENSORRT_PLUGIN: static registration at load time (trtexec --staticPlugins, polygraphy).
// Also the logger used by all wrappers.
#include <NvInferRuntime.h>

#include <atomic>
#include <cstdio>
#include <string>

#include "common/plugin_utils.h"
#include "paged_attention/paged_attention_plugin.h"
#include "sparse_gemm/sparse_gemm_plugin.h"

// The library is built with hidden visibility; these two are what TensorRT looks up by name
// (TENSORRTAPI only exports when building TensorRT itself).
#define ES_PLUGIN_EXPORT __attribute__((visibility("default")))

namespace enginesmith {
namespace trt {
namespace {
std::atomic<nvinfer1::ILoggerFinder*> g_logger_finder{nullptr};

void log(nvinfer1::ILogger::Severity severity, std::string const& message) {
    nvinfer1::ILoggerFinder* finder = g_logger_finder.load();
    nvinfer1::ILogger* logger = finder ? finder->findLogger() : nullptr;
    if (logger != nullptr)
        logger->log(severity, message.c_str());
    else
        std::fprintf(stderr, "[enginesmith plugins] %s\n", message.c_str());
}
}  // namespace

void set_logger_finder(nvinfer1::ILoggerFinder* finder) { g_logger_finder.store(finder); }
void log_error(std::string const& message) { log(nvinfer1::ILogger::Severity::kERROR, message); }
void log_warning(std::string const& message) { log(nvinfer1::ILogger::Severity::kWARNING, message); }

}  // namespace trt
}  // namespace enginesmith

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
