// The slice of ONNX Runtime's C ABI that the custom-op library uses.
//
// ORT's Python wheels ship no C headers, so the few declarations needed are written here from ORT's
// public, frozen ABI: `OrtApi` is a table of function pointers whose order never changes once an API
// version has shipped (slot numbers below are valid from API version 10 on), and `OrtCustomOp` is a
// versioned struct of callbacks (the layout below is its API-16 form). The library asks for API 16,
// which every ORT >= 1.16 serves.
//
// Checked by the CPU tests: registering the library into an ORT CPU session and running its ops
// calls every slot below except KernelContext_GetGPUComputeStream (CUDA-only, checked on the GPU).
#pragma once

#include <cstddef>
#include <cstdint>

namespace ortabi {

struct OrtStatus;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtValue;
struct OrtTensorTypeAndShapeInfo;
struct OrtSessionOptions;
struct OrtCustomOpDomain;
struct OrtShapeInferContext;

// ONNXTensorElementDataType (the ONNX TensorProto codes).
enum ElementType : int { kUndefined = 0, kFloat = 1, kUint8 = 2, kInt8 = 3, kInt32 = 6, kFloat16 = 10 };
// OrtErrorCode.
enum ErrorCode : int { kOk = 0, kFail = 1, kInvalidArgument = 2 };

constexpr uint32_t kApiVersion = 16;

struct OrtApiBase {
  const void* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};

// Positions in the OrtApi function table.
enum Slot : int {
  kCreateStatus = 0,
  kGetErrorMessage = 2,
  kCreateCustomOpDomain = 26,
  kCustomOpDomainAdd = 27,
  kAddCustomOpDomain = 28,
  kGetTensorMutableData = 51,
  kGetTensorElementType = 60,
  kGetDimensionsCount = 61,
  kGetDimensions = 62,
  kGetTensorTypeAndShape = 65,
  kKernelInfoGetAttributeFloat = 85,
  kKernelInfoGetAttributeInt64 = 86,
  kKernelContextGetInputCount = 88,
  kKernelContextGetInput = 90,
  kKernelContextGetOutput = 91,
  kReleaseStatus = 93,
  kReleaseTensorTypeAndShapeInfo = 99,
  kKernelContextGetGPUComputeStream = 193,
};

// Typed calls through the table.
class Api {
 public:
  explicit Api(const void* table) : t_(static_cast<const void* const*>(table)) {}

  OrtStatus* CreateStatus(ErrorCode code, const char* msg) const {
    return fn<OrtStatus* (*)(ErrorCode, const char*)>(kCreateStatus)(code, msg);
  }
  const char* GetErrorMessage(const OrtStatus* s) const {
    return fn<const char* (*)(const OrtStatus*)>(kGetErrorMessage)(s);
  }
  void ReleaseStatus(OrtStatus* s) const { fn<void (*)(OrtStatus*)>(kReleaseStatus)(s); }
  OrtStatus* CreateCustomOpDomain(const char* domain, OrtCustomOpDomain** out) const {
    return fn<OrtStatus* (*)(const char*, OrtCustomOpDomain**)>(kCreateCustomOpDomain)(domain, out);
  }
  OrtStatus* CustomOpDomainAdd(OrtCustomOpDomain* d, const void* op) const {
    return fn<OrtStatus* (*)(OrtCustomOpDomain*, const void*)>(kCustomOpDomainAdd)(d, op);
  }
  OrtStatus* AddCustomOpDomain(OrtSessionOptions* o, OrtCustomOpDomain* d) const {
    return fn<OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*)>(kAddCustomOpDomain)(o, d);
  }
  OrtStatus* GetTensorMutableData(OrtValue* v, void** out) const {
    return fn<OrtStatus* (*)(OrtValue*, void**)>(kGetTensorMutableData)(v, out);
  }
  OrtStatus* GetTensorTypeAndShape(const OrtValue* v, OrtTensorTypeAndShapeInfo** out) const {
    return fn<OrtStatus* (*)(const OrtValue*, OrtTensorTypeAndShapeInfo**)>(kGetTensorTypeAndShape)(v, out);
  }
  OrtStatus* GetTensorElementType(const OrtTensorTypeAndShapeInfo* i, ElementType* out) const {
    return fn<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, ElementType*)>(kGetTensorElementType)(i, out);
  }
  OrtStatus* GetDimensionsCount(const OrtTensorTypeAndShapeInfo* i, size_t* out) const {
    return fn<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, size_t*)>(kGetDimensionsCount)(i, out);
  }
  OrtStatus* GetDimensions(const OrtTensorTypeAndShapeInfo* i, int64_t* dims, size_t n) const {
    return fn<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, int64_t*, size_t)>(kGetDimensions)(i, dims, n);
  }
  void ReleaseTensorTypeAndShapeInfo(OrtTensorTypeAndShapeInfo* i) const {
    fn<void (*)(OrtTensorTypeAndShapeInfo*)>(kReleaseTensorTypeAndShapeInfo)(i);
  }
  OrtStatus* KernelInfoGetAttributeFloat(const OrtKernelInfo* info, const char* name, float* out) const {
    return fn<OrtStatus* (*)(const OrtKernelInfo*, const char*, float*)>(kKernelInfoGetAttributeFloat)(info, name, out);
  }
  OrtStatus* KernelInfoGetAttributeInt64(const OrtKernelInfo* info, const char* name, int64_t* out) const {
    return fn<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(kKernelInfoGetAttributeInt64)(
        info, name, out);
  }
  OrtStatus* KernelContextGetInputCount(const OrtKernelContext* c, size_t* out) const {
    return fn<OrtStatus* (*)(const OrtKernelContext*, size_t*)>(kKernelContextGetInputCount)(c, out);
  }
  OrtStatus* KernelContextGetInput(const OrtKernelContext* c, size_t i, const OrtValue** out) const {
    return fn<OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**)>(kKernelContextGetInput)(c, i, out);
  }
  OrtStatus* KernelContextGetOutput(OrtKernelContext* c, size_t i, const int64_t* dims, size_t n,
                                    OrtValue** out) const {
    return fn<OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**)>(
        kKernelContextGetOutput)(c, i, dims, n, out);
  }
  OrtStatus* KernelContextGetGPUComputeStream(const OrtKernelContext* c, void** out) const {
    return fn<OrtStatus* (*)(const OrtKernelContext*, void**)>(kKernelContextGetGPUComputeStream)(c, out);
  }

 private:
  template <typename F>
  F fn(Slot s) const { return reinterpret_cast<F>(const_cast<void*>(t_[s])); }
  const void* const* t_;
};

// OrtCustomOp, API-16 layout (ORT reads the fields its `version` says exist).
struct CustomOp {
  uint32_t version;
  void* (*CreateKernel)(const CustomOp*, const void* api, const OrtKernelInfo*);
  const char* (*GetName)(const CustomOp*);
  const char* (*GetExecutionProviderType)(const CustomOp*);
  ElementType (*GetInputType)(const CustomOp*, size_t);
  size_t (*GetInputTypeCount)(const CustomOp*);
  ElementType (*GetOutputType)(const CustomOp*, size_t);
  size_t (*GetOutputTypeCount)(const CustomOp*);
  void (*KernelCompute)(void* kernel, OrtKernelContext*);
  void (*KernelDestroy)(void* kernel);
  int (*GetInputCharacteristic)(const CustomOp*, size_t);   // 0: required
  int (*GetOutputCharacteristic)(const CustomOp*, size_t);
  int (*GetInputMemoryType)(const CustomOp*, size_t);       // 0: the EP's default memory, -2: host
  int (*GetVariadicInputMinArity)(const CustomOp*);
  int (*GetVariadicInputHomogeneity)(const CustomOp*);
  int (*GetVariadicOutputMinArity)(const CustomOp*);
  int (*GetVariadicOutputHomogeneity)(const CustomOp*);
  OrtStatus* (*CreateKernelV2)(const CustomOp*, const void* api, const OrtKernelInfo*, void** kernel);
  OrtStatus* (*KernelComputeV2)(void* kernel, OrtKernelContext*);
  OrtStatus* (*InferOutputShapeFn)(const CustomOp*, OrtShapeInferContext*);
  int (*GetStartVersion)(const CustomOp*);
  int (*GetEndVersion)(const CustomOp*);
};

}  // namespace ortabi
