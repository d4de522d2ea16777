// libenginesmith_ort_ops.so: ONNX Runtime custom ops (domain com.enginesmith) for the decode GEMVs
// that ORT CUDA runs below the memory bandwidth (see gemv.h):
//
//   Gemv(x, W[N,K])                                   y = x · Wᵀ                 fp16
//   SwiGluGemv(x, Wg[N,K], Wu[N,K])                   y = silu(x·Wgᵀ) * (x·Wuᵀ)  fp16
//   GemvQ4(x, B, scales; K, N, block_size)            y = x · Wᵀ, W int4 as MatMulNBits (symmetric)
//   SwiGluGemvQ4(x, Bg, Sg, Bu, Su; K, N, block_size)
//
// Each op has a CUDA kernel (CUDAExecutionProvider, on ORT's compute stream, so it can be captured in
// a CUDA graph) and a CPU kernel (the reference, so the graph runs and is checked on ORT CPU).
// fp16 calls with kCublasMinRows rows of x or more (prefill, batched decode) go to cuBLAS (loaded with
// dlopen; its handle and a fixed workspace are made when a CUDA kernel is created, at session start,
// so cuBLAS allocates nothing inside a CUDA-graph capture); int4 calls always run the GEMV kernel.
//
// Verified on an H200 only with the session on a user compute stream (runtime/ort_cuda.GqaEngine sets
// one): with ORT's own stream the launches failed with "invalid argument" (not understood).
//
// Load it with SessionOptions.register_custom_ops_library(path) (entry point RegisterCustomOps).
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cstdio>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "gemv.h"
#include "ort_abi.h"

using namespace ortabi;
using enginesmith::GemvProblem;

namespace {

const Api* g_api = nullptr;
// fp16: the GEMV kernel turns compute-bound past ~4 rows (H200, batch 16: 5.6k tok/s on it, 12.7k on
// cuBLAS).
constexpr int kCublasMinRows = 5;
constexpr size_t kCublasWorkspace = 32 << 20;  // bytes

enum class Kind { kGemv, kSwiGlu, kGemvQ4, kSwiGluQ4 };

struct OpDef {
  CustomOp op;  // first member: ORT hands the CustomOp* back to the callbacks
  const char* name;
  const char* provider;
  Kind kind;
  bool cuda;
};

bool quantized(Kind k) { return k == Kind::kGemvQ4 || k == Kind::kSwiGluQ4; }
bool swiglu(Kind k) { return k == Kind::kSwiGlu || k == Kind::kSwiGluQ4; }
size_t input_count(Kind k) {
  switch (k) {
    case Kind::kGemv: return 2;
    case Kind::kSwiGlu: return 3;
    case Kind::kGemvQ4: return 3;
    case Kind::kSwiGluQ4: return 5;
  }
  return 0;
}

struct Kernel {
  const OpDef* def;
  int64_t K = 0, N = 0, block_size = 0;  // int4 ops: from the node's attributes
};

OrtStatus* error(const std::string& msg) { return g_api->CreateStatus(kInvalidArgument, msg.c_str()); }

#define ORT_TRY(expr)                 \
  do {                                \
    if (OrtStatus* _s = (expr)) return _s; \
  } while (0)

struct Tensor {
  void* data = nullptr;
  std::vector<int64_t> dims;
  ElementType type = kUndefined;
};

OrtStatus* read_input(OrtKernelContext* ctx, size_t i, Tensor* t) {
  const OrtValue* v = nullptr;
  ORT_TRY(g_api->KernelContextGetInput(ctx, i, &v));
  if (v == nullptr) return error("input " + std::to_string(i) + " is missing");
  OrtTensorTypeAndShapeInfo* info = nullptr;
  ORT_TRY(g_api->GetTensorTypeAndShape(v, &info));
  size_t n = 0;
  OrtStatus* s = g_api->GetDimensionsCount(info, &n);
  if (!s) {
    t->dims.resize(n);
    s = g_api->GetDimensions(info, t->dims.data(), n);
  }
  if (!s) s = g_api->GetTensorElementType(info, &t->type);
  g_api->ReleaseTensorTypeAndShapeInfo(info);
  if (s) return s;
  return g_api->GetTensorMutableData(const_cast<OrtValue*>(v), &t->data);
}

// ---- cuBLAS, loaded on first use (prefill-sized fp16 calls only).
struct Cublas {
  using Create = int (*)(void**);
  using SetStream = int (*)(void*, cudaStream_t);
  using GemmEx = int (*)(void*, int, int, int, int, int, const void*, const void*, int, int, const void*, int,
                         int, const void*, void*, int, int, int, int);
  using SetWorkspace = int (*)(void*, void*, size_t);
  Create create = nullptr;
  SetStream set_stream = nullptr;
  GemmEx gemm_ex = nullptr;
  SetWorkspace set_workspace = nullptr;
  void* workspace = nullptr;
  void* handle = nullptr;
  std::string problem;
  std::mutex mu;
};

Cublas& cublas() {
  static Cublas c;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = nullptr;
    for (const char* name : {"libcublas.so.13", "libcublas.so.12", "libcublas.so"})
      if ((lib = dlopen(name, RTLD_NOW | RTLD_GLOBAL)) != nullptr) break;
    if (lib == nullptr) {
      c.problem = "libcublas not found (call onnxruntime.preload_dlls() or put the CUDA libraries on LD_LIBRARY_PATH)";
      return;
    }
    c.create = reinterpret_cast<Cublas::Create>(dlsym(lib, "cublasCreate_v2"));
    c.set_stream = reinterpret_cast<Cublas::SetStream>(dlsym(lib, "cublasSetStream_v2"));
    c.gemm_ex = reinterpret_cast<Cublas::GemmEx>(dlsym(lib, "cublasGemmEx"));
    c.set_workspace = reinterpret_cast<Cublas::SetWorkspace>(dlsym(lib, "cublasSetWorkspace_v2"));
    if (!c.create || !c.set_stream || !c.gemm_ex || !c.set_workspace || c.create(&c.handle) != 0 ||
        cudaMalloc(&c.workspace, kCublasWorkspace) != cudaSuccess ||
        c.set_workspace(c.handle, c.workspace, kCublasWorkspace) != 0)
      c.problem = "libcublas was found but could not be initialised";
  });
  return c;
}

// y[M, N] = x[M, K] · W[N, K]ᵀ; column-major cuBLAS sees yᵀ = W · xᵀ (W read transposed).
OrtStatus* cublas_gemm(const __half* x, const void* w, __half* y, int M, int N, int K, cudaStream_t stream) {
  Cublas& c = cublas();
  if (!c.problem.empty()) return error(c.problem);
  constexpr int kOpN = 0, kOpT = 1, kR16F = 2, kCompute32F = 68, kDefaultAlgo = -1;
  const float alpha = 1.f, beta = 0.f;
  std::lock_guard<std::mutex> lock(c.mu);
  // cublasSetStream drops a user workspace: set ours again (no allocation inside a graph capture).
  if (c.set_stream(c.handle, stream) != 0 || c.set_workspace(c.handle, c.workspace, kCublasWorkspace) != 0)
    return error("cublasSetStream/cublasSetWorkspace failed");
  const int st = c.gemm_ex(c.handle, kOpT, kOpN, N, M, K, &alpha, w, kR16F, K, x, kR16F, K, &beta, y, kR16F, N,
                           kCompute32F, kDefaultAlgo);
  return st == 0 ? nullptr : error("cublasGemmEx failed with status " + std::to_string(st));
}

OrtStatus* cuda_status(const Kernel& k, cudaError_t err) {
  return err == cudaSuccess ? nullptr : error(std::string(k.def->name) + ": " + cudaGetErrorString(err));
}

OrtStatus* run_cuda(const Kernel& k, const GemvProblem& p, OrtKernelContext* ctx) {
  void* stream_ptr = nullptr;
  ORT_TRY(g_api->KernelContextGetGPUComputeStream(ctx, &stream_ptr));
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  // cudaGetLastError after a launch also returns an earlier, unrelated error of this thread's runtime
  // (ORT leaves some unchecked): clear it first so a launch is judged on its own.
  (void)cudaGetLastError();
  // int4 always runs the GEMV kernel (chunks of kGemvMaxRows rows): a dequantize + cuBLAS path gave
  // wrong prefill logits on the H200 and was taken out until that is understood.
  if (p.q4 || p.M < kCublasMinRows) return cuda_status(k, enginesmith::gemv_launch(p, stream));
  OrtStatus* status = cublas_gemm(p.x, p.w[0], p.y, p.M, p.N, p.K, stream);
  if (status || !p.swiglu) return status;
  __half* up = nullptr;  // SwiGLU: the up product in a stream-ordered temporary, then the epilogue
  if (cudaError_t err = cudaMallocAsync(reinterpret_cast<void**>(&up), size_t(p.M) * p.N * sizeof(__half), stream))
    return cuda_status(k, err);
  status = cublas_gemm(p.x, p.w[1], up, p.M, p.N, p.K, stream);
  const cudaError_t err = status ? cudaSuccess : enginesmith::swiglu_combine(p.y, up, size_t(p.M) * p.N, stream);
  cudaFreeAsync(up, stream);
  return status ? status : cuda_status(k, err);
}

OrtStatus* compute(void* kernel_ptr, OrtKernelContext* ctx) {
  const Kernel& k = *static_cast<Kernel*>(kernel_ptr);
  const Kind kind = k.def->kind;
  const std::string_view op = k.def->name;  // strings are built only on the error paths
  std::vector<Tensor> in(input_count(kind));
  for (size_t i = 0; i < in.size(); ++i) ORT_TRY(read_input(ctx, i, &in[i]));
  const Tensor& x = in[0];
  if (x.type != kFloat16 || x.dims.empty()) return error(std::string(op) + ": x must be a float16 tensor [..., K]");
  GemvProblem p;
  p.q4 = quantized(kind);
  p.swiglu = swiglu(kind);
  p.K = int(x.dims.back());
  int64_t M = 1;
  for (size_t i = 0; i + 1 < x.dims.size(); ++i) M *= x.dims[i];
  p.M = int(M);
  const int nw = p.swiglu ? 2 : 1;
  if (!p.q4) {
    for (int w = 0; w < nw; ++w) {
      const Tensor& t = in[1 + w];
      if (t.type != kFloat16 || t.dims.size() != 2 || t.dims[1] != p.K || (w == 1 && t.dims[0] != in[1].dims[0]))
        return error(std::string(op) + ": weights must be float16 [N, K] with K = " + std::to_string(p.K));
      p.w[w] = t.data;
    }
    p.N = int(in[1].dims[0]);
  } else {
    if (p.K != k.K) return error(std::string(op) + ": x has K = " + std::to_string(p.K) + ", the node says " + std::to_string(k.K));
    p.N = int(k.N);
    p.block_size = int(k.block_size);
    for (int w = 0; w < nw; ++w) {
      const Tensor& b = in[1 + 2 * w];
      const Tensor& s = in[2 + 2 * w];
      int64_t b_elems = 1, s_elems = 1;
      for (int64_t d : b.dims) b_elems *= d;
      for (int64_t d : s.dims) s_elems *= d;
      if (b.type != kUint8 || b_elems != k.N * k.K / 2 || s.type != kFloat16 || s_elems != k.N * (k.K / k.block_size))
        return error(std::string(op) + ": packed weights must be uint8 [N, K/block_size, block_size/2] and scales float16 "
                          "[N, K/block_size]");
      p.w[w] = b.data;
      p.scales[w] = static_cast<const __half*>(s.data);
    }
  }
  p.x = static_cast<const __half*>(x.data);
  std::vector<int64_t> out_dims(x.dims.begin(), x.dims.end() - 1);
  out_dims.push_back(p.N);
  OrtValue* out = nullptr;
  ORT_TRY(g_api->KernelContextGetOutput(ctx, 0, out_dims.data(), out_dims.size(), &out));
  void* y = nullptr;
  ORT_TRY(g_api->GetTensorMutableData(out, &y));
  p.y = static_cast<__half*>(y);
  if (p.M == 0) return nullptr;
  if (const char* why = enginesmith::gemv_check(p); *why) return error(std::string(op) + ": " + why);
  if (k.def->cuda) return run_cuda(k, p, ctx);
  enginesmith::gemv_reference(p);
  return nullptr;
}

// ---- OrtCustomOp callbacks.
const OpDef& def_of(const CustomOp* op) { return *reinterpret_cast<const OpDef*>(op); }

OrtStatus* create_kernel(const CustomOp* op, const void*, const OrtKernelInfo* info, void** out) {
  if (def_of(op).cuda && !quantized(def_of(op).kind)) cublas();  // at session start, not inside a capture
  auto kernel = new Kernel{&def_of(op)};
  if (quantized(kernel->def->kind)) {
    for (auto [name, dst] : {std::pair<const char*, int64_t*>{"K", &kernel->K}, {"N", &kernel->N},
                             {"block_size", &kernel->block_size}}) {
      if (OrtStatus* s = g_api->KernelInfoGetAttributeInt64(info, name, dst)) {
        delete kernel;
        return s;
      }
    }
    if (kernel->K <= 0 || kernel->N <= 0 || kernel->block_size <= 0) {
      delete kernel;
      return error(std::string(def_of(op).name) + ": K, N and block_size must be positive");
    }
  }
  *out = kernel;
  return nullptr;
}

void* create_kernel_v1(const CustomOp* op, const void* api, const OrtKernelInfo* info) {
  void* kernel = nullptr;
  if (OrtStatus* s = create_kernel(op, api, info, &kernel)) {
    std::fprintf(stderr, "enginesmith ort_ops: %s\n", g_api->GetErrorMessage(s));
    g_api->ReleaseStatus(s);
  }
  return kernel;
}

void compute_v1(void* kernel, OrtKernelContext* ctx) {
  if (OrtStatus* s = compute(kernel, ctx)) {
    std::fprintf(stderr, "enginesmith ort_ops: %s\n", g_api->GetErrorMessage(s));
    g_api->ReleaseStatus(s);
  }
}

ElementType input_type(const CustomOp* op, size_t i) {
  if (i == 0) return kFloat16;
  if (!quantized(def_of(op).kind)) return kFloat16;
  return (i % 2 == 1) ? kUint8 : kFloat16;  // B, scales, B, scales
}

OpDef make(const char* name, Kind kind, bool cuda) {
  OpDef d{};
  d.name = name;
  d.kind = kind;
  d.cuda = cuda;
  d.provider = cuda ? "CUDAExecutionProvider" : "CPUExecutionProvider";
  CustomOp& o = d.op;
  o.version = kApiVersion;
  o.CreateKernel = create_kernel_v1;
  o.GetName = [](const CustomOp* op) { return def_of(op).name; };
  o.GetExecutionProviderType = [](const CustomOp* op) { return def_of(op).provider; };
  o.GetInputType = input_type;
  o.GetInputTypeCount = [](const CustomOp* op) { return input_count(def_of(op).kind); };
  o.GetOutputType = [](const CustomOp*, size_t) { return kFloat16; };
  o.GetOutputTypeCount = [](const CustomOp*) { return size_t(1); };
  o.KernelCompute = compute_v1;
  o.KernelDestroy = [](void* kernel) { delete static_cast<Kernel*>(kernel); };
  o.GetInputCharacteristic = [](const CustomOp*, size_t) { return 0; };
  o.GetOutputCharacteristic = [](const CustomOp*, size_t) { return 0; };
  o.GetInputMemoryType = [](const CustomOp*, size_t) { return 0; };
  o.GetVariadicInputMinArity = [](const CustomOp*) { return 1; };
  o.GetVariadicInputHomogeneity = [](const CustomOp*) { return 1; };
  o.GetVariadicOutputMinArity = [](const CustomOp*) { return 1; };
  o.GetVariadicOutputHomogeneity = [](const CustomOp*) { return 1; };
  o.CreateKernelV2 = create_kernel;
  o.KernelComputeV2 = compute;
  o.InferOutputShapeFn = nullptr;
  o.GetStartVersion = [](const CustomOp*) { return 1; };
  o.GetEndVersion = [](const CustomOp*) { return 2147483647; };
  return d;
}

std::vector<OpDef>& ops() {
  static std::vector<OpDef> all = [] {
    std::vector<OpDef> v;
    for (bool cuda : {false, true}) {
      v.push_back(make("Gemv", Kind::kGemv, cuda));
      v.push_back(make("SwiGluGemv", Kind::kSwiGlu, cuda));
      v.push_back(make("GemvQ4", Kind::kGemvQ4, cuda));
      v.push_back(make("SwiGluGemvQ4", Kind::kSwiGluQ4, cuda));
    }
    return v;
  }();
  return all;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                               const OrtApiBase* base) {
  static std::once_flag once;
  std::call_once(once, [base] {
    if (const void* table = base->GetApi(kApiVersion)) g_api = new Api(table);
  });
  if (g_api == nullptr) {
    std::fprintf(stderr, "enginesmith ort_ops: ONNX Runtime %s does not serve C API version %u (needs >= 1.16)\n",
                 base->GetVersionString(), kApiVersion);
    return nullptr;  // no ops registered: the session then names the unknown op
  }
  OrtCustomOpDomain* domain = nullptr;
  ORT_TRY(g_api->CreateCustomOpDomain("com.enginesmith", &domain));
  for (OpDef& d : ops()) ORT_TRY(g_api->CustomOpDomainAdd(domain, &d.op));
  return g_api->AddCustomOpDomain(options, domain);
}
