// Status: how every layer below the TensorRT wrapper reports failure (no exceptions cross the
// plugin's noexcept boundary). A failed Status names the input at fault and, where there is one,
// the fix.
#pragma once

#include <cuda_runtime_api.h>

#include <string>
#include <utility>

namespace enginesmith {

struct Status {
    bool ok = true;
    std::string message;

    static Status Ok() { return {}; }
    static Status Error(std::string msg) { return Status{false, std::move(msg)}; }
    explicit operator bool() const { return ok; }
};

inline Status cudaStatus(cudaError_t err, char const* what) {
    if (err == cudaSuccess) return Status::Ok();
    return Status::Error(std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

// Element types the kernels take; the values are stable (they cross the C API for ctypes).
enum class DType : int { kFloat16 = 0, kBFloat16 = 1 };

inline char const* dtypeName(DType t) { return t == DType::kFloat16 ? "float16" : "bfloat16"; }

}  // namespace enginesmith

// Every CUDA runtime call is checked: return a Status naming the call on failure.
#define ES_RETURN_IF_CUDA_ERROR(expr)                                                   \
    do {                                                                                \
        cudaError_t es_err_ = (expr);                                                   \
        if (es_err_ != cudaSuccess) return ::enginesmith::cudaStatus(es_err_, #expr);   \
    } while (0)

#define ES_RETURN_IF_ERROR(expr)                     \
    do {                                             \
        ::enginesmith::Status es_st_ = (expr);       \
        if (!es_st_.ok) return es_st_;               \
    } while (0)
