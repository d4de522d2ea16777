// Helpers shared by the TensorRT wrappers (layer 4): the logger found through setLoggerFinder,
// error reporting, and reading PluginFieldCollections by name with type checks.
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace enginesmith {
namespace trt {

constexpr char const* kPluginNamespace = "enginesmith";

// Set by the exported setLoggerFinder(); errors go to TensorRT's logger when it is known, else stderr.
void set_logger_finder(nvinfer1::ILoggerFinder* finder);
void log_error(std::string const& message);
void log_warning(std::string const& message);

// Reads named fields from a PluginFieldCollection. Every failure is recorded with the field's name,
// so a creator can report all of them at once.
class FieldReader {
public:
    explicit FieldReader(nvinfer1::PluginFieldCollection const* fc) : fc_(fc) {}

    nvinfer1::PluginField const* find(char const* name) const {
        if (fc_ == nullptr) return nullptr;
        for (int32_t i = 0; i < fc_->nbFields; ++i)
            if (fc_->fields[i].name != nullptr && std::strcmp(fc_->fields[i].name, name) == 0) return &fc_->fields[i];
        return nullptr;
    }

    // An int32 scalar; `fallback` when absent and not required.
    int32_t get_int(char const* name, int32_t fallback, bool required) {
        nvinfer1::PluginField const* f = find(name);
        if (f == nullptr) {
            if (required) errors_.push_back(std::string("missing field '") + name + "' (int32)");
            return fallback;
        }
        if (f->type != nvinfer1::PluginFieldType::kINT32 || f->length != 1 || f->data == nullptr) {
            errors_.push_back(std::string("field '") + name + "' must be one int32");
            return fallback;
        }
        return *static_cast<int32_t const*>(f->data);
    }

    float get_float(char const* name, float fallback) {
        nvinfer1::PluginField const* f = find(name);
        if (f == nullptr) return fallback;
        if (f->type != nvinfer1::PluginFieldType::kFLOAT32 || f->length != 1 || f->data == nullptr) {
            errors_.push_back(std::string("field '") + name + "' must be one float32");
            return fallback;
        }
        return *static_cast<float const*>(f->data);
    }

    void error(std::string message) { errors_.push_back(std::move(message)); }

    bool ok() const { return errors_.empty(); }

    std::string message() const {
        std::string s;
        for (auto const& e : errors_) s += (s.empty() ? "" : "; ") + e;
        return s;
    }

private:
    nvinfer1::PluginFieldCollection const* fc_;
    std::vector<std::string> errors_;
};

}  // namespace trt
}  // namespace enginesmith
