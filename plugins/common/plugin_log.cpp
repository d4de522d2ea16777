// The wrappers' logger: TensorRT's, found through the ILoggerFinder passed to setLoggerFinder(),
// else stderr.
#include <atomic>
#include <cstdio>
#include <string>

#include "plugin_utils.h"

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
