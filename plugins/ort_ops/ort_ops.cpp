// libenginesmith_ort_ops.so: ONNX Runtime custom ops (domain com.enginesmith) for the decode GEMVs
// that ORT CUDA runs below the memory bandwidth (see gemv.h):
//
//   Gemv(x, W[N,K])                                   y = x · Wᵀ                 fp16
//   SwiGluGemv(x, Wg[N,K], Wu[N,K])                   y = silu(x·Wgᵀ) * (x·Wuᵀ)  fp16
//   GemvQ4(x, B, scales; K, N, block_size)            y = x · Wᵀ, W int4 as MatMulNBits (symmetric)
//   SwiGluGemvQ4(x, Bg, Sg, Bu, Su; K, N, block_size)
//
// and each with the decoder's RMSNorm before it folded in (epsilon attribute; see gemv.h):
//   RmsNorm<op>(x, gamma, <weights>)              the product of rms_norm(x) * gamma
//   SkipRmsNorm<op>(x, skip, gamma, <weights>)    the same of x + skip; second output: x + skip
// (inputs as com.microsoft.SkipSimplifiedLayerNormalization's, outputs y and the residual sum),
// and the attention of the decoder (see attention.h):
//   GroupQueryAttention(qkv, past_key, past_value, seqlens_k, total_sequence_length, cos_cache,
//                       sin_cache[, kv_scale]; num_heads, kv_num_heads, scale, softcap = 0,
//                       local_window_size = -1) -> output, present_key, present_value
// (com.microsoft.GroupQueryAttention's inputs without the unused key/value, packed QKV, rotary always
// on, past and present one buffer: with another present buffer, past is copied into it first; softcap
// and local_window_size as com.microsoft's, optional; caches of float16, or of int8 / uint8 = fp8 e4m3
// codes with kv_scale float32 [2, kv_num_heads, head_size] as the paged op's: one kernel per cache type),
// and its paged twin for the in-flight-batching engine (see paged_gqa.h):
//   PagedGroupQueryAttention(qkv, key_pool, value_pool, block_tables, context_lens, slot_mapping,
//                            cos_cache, sin_cache[, kv_scale]; num_heads, kv_num_heads, scale,
//                            softcap = 0, local_window_size = -1)
//                            -> output, present_key_pool, present_value_pool
// (the pools written in place at the new tokens' slots; another present buffer gets a copy first;
// pools of float16, or of int8 / uint8 = fp8 e4m3 codes with kv_scale float32 [2, kv_num_heads,
// head_size]: quantized KV pages, paged_attention/kv_quant.h; one kernel per pool type).
//
// Each op has a CUDA kernel (CUDAExecutionProvider, on ORT's compute stream, so it can be captured in
// a CUDA graph) and a CPU kernel (the reference, so the graph runs and is checked on ORT CPU).
// Calls with kCublasMinRows rows of x or more (prefill, batched decode) go to cuBLAS (loaded with
// dlopen; its handle and a fixed workspace are made when a CUDA kernel is created, at session start,
// so cuBLAS allocates nothing inside a CUDA-graph capture); int4 weights are first dequantized, a
// slice at a time, into a stream-ordered temporary (which a capture records as graph memory nodes).
//
// The library carries its own static CUDA runtime (plugins/CMakeLists.txt says why). Verified on an
// H200 on ORT's own compute stream and on a user stream.
//
// Load it with SessionOptions.register_custom_ops_library(path) (entry point RegisterCustomOps).
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <algorithm>
#include <vector>

#include "attention.h"
#include "gemv.h"
#include "gemm_q4.h"
#include "launch.cuh"
#include "ort_abi.h"
#include "paged_gqa.h"

using namespace ortabi;
using enginesmith::AttentionProblem;
using enginesmith::GemvProblem;

namespace {

const Api* g_api = nullptr;
// fp16: the GEMV kernel turns compute-bound past ~4 rows (H200, batch 16: 5.6k tok/s on it, 12.7k on
// cuBLAS).
constexpr int kCublasMinRows = 5;

// ES_BATCH_INVARIANT=1 (read once, at the first kernel's creation): every row's result is independent
// of how many rows share the call, as a request's greedy tokens alone and batched then are. GEMMs run
// in fixed slabs of rows through cuBLAS (invariant_gemm: cuBLAS picks kernels and split-K by M), and
// the paged attention splits keys as a one-row, one-token call would (the split count depends only on
// the graph's shapes). Costs some speed (batch 1 loses the GEMV kernel); off by default.
bool batch_invariant() {
  static const bool on = [] {
    const char* v = std::getenv("ES_BATCH_INVARIANT");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return on;
}
constexpr size_t kCublasWorkspace = 32 << 20;  // bytes

enum class Norm { kNone, kRms, kSkipRms };

struct OpDef {
  CustomOp op;  // first member: ORT hands the CustomOp* back to the callbacks
  std::string name;
  const char* provider;
  bool q4, swiglu;
  Norm norm;
  bool cuda;
  bool attention;  // GroupQueryAttention (the other fields are the GEMVs')
  bool paged;      // PagedGroupQueryAttention
  ElementType pool = kFloat16;  // the attention ops: their pools' / caches' element type (int8, uint8: codes)
};

// GroupQueryAttention's inputs and outputs; total_sequence_length is read on the host; the last input
// (kv_scale, float32) is optional: quantized caches only.
constexpr size_t kAttentionInputs = 8, kAttentionOutputs = 3, kTotalLengthInput = 4, kAttentionScaleInput = 7;
// PagedGroupQueryAttention's; inputs 3, 4, 5 (block_tables, context_lens, slot_mapping) are int32, the
// last (kv_scale, float32) is optional: quantized pools only.
constexpr size_t kPagedInputs = 9, kPagedOutputs = 3, kKvScaleInput = 8;

// GEMV inputs: x, then skip (SkipRmsNorm) and gamma (both norms), then the weights.
size_t norm_inputs(const OpDef& d) { return d.norm == Norm::kSkipRms ? 2 : d.norm == Norm::kRms ? 1 : 0; }
size_t first_weight(const OpDef& d) { return 1 + norm_inputs(d); }
size_t input_count(const OpDef& d) {
  if (d.paged) return kPagedInputs;
  return d.attention ? kAttentionInputs : first_weight(d) + (d.q4 ? 2 : 1) * (d.swiglu ? 2 : 1);
}
size_t output_count(const OpDef& d) {
  return d.paged ? kPagedOutputs : d.attention ? kAttentionOutputs : d.norm == Norm::kSkipRms ? 2 : 1;
}

struct Kernel {
  explicit Kernel(const OpDef* d) : def(d) {}
  const OpDef* def;
  int64_t K = 0, N = 0, block_size = 0;  // int4 ops: from the node's attributes
  float eps = 0.f;                        // norm ops: the epsilon attribute
  // GroupQueryAttention and PagedGroupQueryAttention: attributes, the device's multiprocessors, whether
  // launches are dependent, and the workspace (GQA: split partials; paged: scratch + split partials,
  // one buffer) and split counters. It grows outside captures only, and a grown-out buffer is kept
  // until the kernel goes: a CUDA graph captured earlier (another step shape) still launches on it.
  int64_t heads = 0, kv_heads = 0;
  float scale = 0.f;
  float softcap = 0.f;   // GroupQueryAttention's optional attributes: 0 = off
  int64_t window = -1;   // local_window_size: -1 = off
  int sms = 0;
  bool dependent = false;
  void* workspace = nullptr;
  int32_t* counters = nullptr;
  size_t workspace_bytes = 0, counter_count = 0;
  std::vector<void*> buffers;  // every workspace buffer allocated, freed with the kernel
  std::mutex mu;

  ~Kernel() {
    for (void* b : buffers) cudaFree(b);
  }
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

// y[M, N] (rows ldy apart) = x[M, K] · W[N, K]ᵀ; column-major cuBLAS sees yᵀ = W · xᵀ (W read transposed).
OrtStatus* cublas_gemm(const __half* x, const void* w, __half* y, int M, int N, int K, int ldy, cudaStream_t stream) {
  Cublas& c = cublas();
  if (!c.problem.empty()) return error(c.problem);
  constexpr int kOpN = 0, kOpT = 1, kR16F = 2, kCompute32F = 68, kDefaultAlgo = -1;
  const float alpha = 1.f, beta = 0.f;
  std::lock_guard<std::mutex> lock(c.mu);
  // cublasSetStream drops a user workspace: set ours again (no allocation inside a graph capture).
  if (c.set_stream(c.handle, stream) != 0 || c.set_workspace(c.handle, c.workspace, kCublasWorkspace) != 0)
    return error("cublasSetStream/cublasSetWorkspace failed");
  const int st = c.gemm_ex(c.handle, kOpT, kOpN, N, M, K, &alpha, w, kR16F, K, x, kR16F, K, &beta, y, kR16F, ldy,
                           kCompute32F, kDefaultAlgo);
  return st == 0 ? nullptr : error("cublasGemmEx failed with status " + std::to_string(st));
}

// ES_BATCH_INVARIANT=1: every GEMM runs in slabs of kInvariantRows rows of x (the last one padded), so
// cuBLAS always sees the same M and picks the same kernel and split-K; a row's result then does not
// depend on how many rows share the call (as the per-M choice of the default path does), at near the
// default path's speed where the weights' read dominates (decode), where the GEMV kernel for every M
// was 9x slower at 64 rows (H100).
constexpr int kInvariantRows = 64;

OrtStatus* invariant_gemm(const __half* x, const void* w, __half* y, int M, int N, int K, int ldy,
                          cudaStream_t stream) {
  __half *xs = nullptr, *ys = nullptr;
  cudaError_t err = cudaMallocAsync(reinterpret_cast<void**>(&xs), size_t(kInvariantRows) * K * sizeof(__half), stream);
  if (err == cudaSuccess)
    err = cudaMallocAsync(reinterpret_cast<void**>(&ys), size_t(kInvariantRows) * N * sizeof(__half), stream);
  if (err == cudaSuccess) err = cudaMemsetAsync(xs, 0, size_t(kInvariantRows) * K * sizeof(__half), stream);
  OrtStatus* status = nullptr;
  for (int m0 = 0; m0 < M && err == cudaSuccess && !status; m0 += kInvariantRows) {
    const int rows = std::min(kInvariantRows, M - m0);
    err = cudaMemcpyAsync(xs, x + size_t(m0) * K, size_t(rows) * K * sizeof(__half), cudaMemcpyDeviceToDevice, stream);
    if (err == cudaSuccess) status = cublas_gemm(xs, w, ys, kInvariantRows, N, K, N, stream);
    if (err == cudaSuccess && !status)
      err = cudaMemcpy2DAsync(y + size_t(m0) * ldy, size_t(ldy) * sizeof(__half), ys, size_t(N) * sizeof(__half),
                              size_t(N) * sizeof(__half), rows, cudaMemcpyDeviceToDevice, stream);
  }
  for (__half* t : {ys, xs})
    if (t) cudaFreeAsync(t, stream);
  if (status) return status;
  return err == cudaSuccess ? nullptr : error(std::string("invariant GEMM: ") + cudaGetErrorString(err));
}

OrtStatus* cuda_status(const Kernel& k, cudaError_t err) {
  return err == cudaSuccess ? nullptr : error(k.def->name + ": " + cudaGetErrorString(err));
}

// int4 weights for a GEMM are dequantized in slices of at most this many values (a bounded temporary).
constexpr size_t kDequantSlice = size_t(16) << 20;

// int4 weights, 5..64 rows, on tensor cores (gemm_q4.h; opt-in): the folded norm first, as on the cuBLAS
// path, then the product straight from the int4 weights through an fp32 split-K workspace.
OrtStatus* run_gemm_q4(const Kernel& k, const GemvProblem& p, cudaStream_t stream) {
  __half* xn = nullptr;
  float* workspace = nullptr;
  cudaError_t err = cudaSuccess;
  if (p.gamma && (err = cudaMallocAsync(reinterpret_cast<void**>(&xn), size_t(p.M) * p.K * sizeof(__half), stream)) ==
      cudaSuccess)
    err = enginesmith::rmsnorm_launch(p, xn, stream);
  if (err == cudaSuccess)
    err = cudaMallocAsync(reinterpret_cast<void**>(&workspace), enginesmith::gemm_q4_workspace_bytes(p), stream);
  if (err == cudaSuccess) err = enginesmith::gemm_q4_launch(p, xn ? xn : p.x, workspace, stream);
  if (workspace) cudaFreeAsync(workspace, stream);
  if (xn) cudaFreeAsync(xn, stream);
  return cuda_status(k, err);
}

OrtStatus* run_cuda(const Kernel& k, const GemvProblem& p, OrtKernelContext* ctx) {
  void* stream_ptr = nullptr;
  ORT_TRY(g_api->KernelContextGetGPUComputeStream(ctx, &stream_ptr));
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  (void)cudaGetLastError();  // a launch is judged on its own error only
  const bool invariant = batch_invariant();
  if (p.M < kCublasMinRows && !invariant) return cuda_status(k, enginesmith::gemv_launch(p, stream));
  if (!invariant && enginesmith::gemm_q4_applies(p)) return run_gemm_q4(k, p, stream);
  // GEMM path, with stream-ordered temporaries (capturable): the normalized x of a norm op, the up
  // product of a SwiGLU, a slice of dequantized int4 weights.
  const int nw = p.swiglu ? 2 : 1;
  const int slice_rows = p.q4 ? int(std::max<size_t>(1, std::min<size_t>(p.N, kDequantSlice / p.K))) : p.N;
  __half *xn = nullptr, *up = nullptr, *wq = nullptr;
  auto temp = [&](__half** ptr, size_t elems) {
    return cudaMallocAsync(reinterpret_cast<void**>(ptr), elems * sizeof(__half), stream);
  };
  OrtStatus* status = nullptr;
  cudaError_t err = cudaSuccess;
  if (p.gamma && (err = temp(&xn, size_t(p.M) * p.K)) == cudaSuccess) err = enginesmith::rmsnorm_launch(p, xn, stream);
  if (err == cudaSuccess && p.swiglu) err = temp(&up, size_t(p.M) * p.N);
  if (err == cudaSuccess && p.q4) err = temp(&wq, size_t(slice_rows) * p.K);
  const __half* x = xn ? xn : p.x;
  for (int w = 0; w < nw && err == cudaSuccess && !status; ++w) {
    __half* out = w == 0 ? p.y : up;
    for (int n0 = 0; n0 < p.N && err == cudaSuccess && !status; n0 += slice_rows) {
      const int rows = std::min(slice_rows, p.N - n0);
      const void* weights = p.w[w];
      if (p.q4) {
        err = enginesmith::dequant_q4(static_cast<const uint8_t*>(p.w[w]) + size_t(n0) * (p.K / 2),
                                      p.scales[w] + size_t(n0) * (p.K / p.block_size), wq, rows, p.K,
                                      p.block_size, stream);
        weights = wq;
      }
      if (err == cudaSuccess)
        status = invariant ? invariant_gemm(x, weights, out + n0, p.M, rows, p.K, p.N, stream)
                           : cublas_gemm(x, weights, out + n0, p.M, rows, p.K, p.N, stream);
    }
  }
  if (err == cudaSuccess && !status && p.swiglu) err = enginesmith::swiglu_combine(p.y, up, size_t(p.M) * p.N, stream);
  for (__half* t : {wq, up, xn})
    if (t) cudaFreeAsync(t, stream);
  return status ? status : cuda_status(k, err);
}

// ---- GroupQueryAttention and PagedGroupQueryAttention.
// Grows the node's workspace to `bytes` and its split counters to `counters` (zeroed), at least
// doubling, with floors (1 MiB, 1024) so that few shapes ever grow them. Only outside a CUDA-graph
// capture; the buffers grown out stay allocated until the kernel goes (a graph captured earlier still
// launches on them). The caller holds k.mu.
OrtStatus* grow_workspace(Kernel& k, size_t bytes, size_t counters, cudaStream_t stream) {
  if (bytes <= k.workspace_bytes && counters <= k.counter_count) return nullptr;
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capturing) != cudaSuccess || capturing != cudaStreamCaptureStatusNone)
    return error(k.def->name + ": its workspace must grow inside a CUDA-graph capture; run this shape once before capturing");
  bytes = std::max({bytes, 2 * k.workspace_bytes, size_t(1) << 20});
  counters = std::max({counters, 2 * k.counter_count, size_t(1024)});
  void* buffer = nullptr;
  int32_t* counts = nullptr;
  cudaError_t err = cudaMalloc(&buffer, bytes);
  if (err == cudaSuccess) k.buffers.push_back(buffer);
  if (err == cudaSuccess && (err = cudaMalloc(&counts, counters * sizeof(int32_t))) == cudaSuccess)
    k.buffers.push_back(counts);
  if (err == cudaSuccess) err = cudaMemsetAsync(counts, 0, counters * sizeof(int32_t), stream);
  if (err != cudaSuccess) return cuda_status(k, err);
  k.workspace = buffer;
  k.counters = counts;
  k.workspace_bytes = bytes;
  k.counter_count = counters;
  return nullptr;
}

OrtStatus* output_like(OrtKernelContext* ctx, size_t i, const std::vector<int64_t>& dims, void** data) {
  OrtValue* v = nullptr;
  ORT_TRY(g_api->KernelContextGetOutput(ctx, i, dims.data(), dims.size(), &v));
  return g_api->GetTensorMutableData(v, data);
}

// The three outputs of both attention ops: out, and the present K and V caches of the past's shape
// (the same memory as the past when the runtime binds them so).
OrtStatus* attention_outputs(OrtKernelContext* ctx, const std::vector<int64_t>& out_dims,
                             const std::vector<int64_t>& cache_dims, void** out, void** present_k, void** present_v) {
  ORT_TRY(output_like(ctx, 0, out_dims, out));
  ORT_TRY(output_like(ctx, 1, cache_dims, present_k));
  return output_like(ctx, 2, cache_dims, present_v);
}

// Shared with PagedGroupQueryAttention (defined with it below): type names and the input check.
std::string type_name(ElementType t);
OrtStatus* expect(const std::string& op, const char* name, const Tensor& t, ElementType type,
                  const std::vector<int64_t>& want, const std::string& legend);

OrtStatus* compute_attention(Kernel& k, OrtKernelContext* ctx) {
  const std::string& op = k.def->name;
  std::vector<Tensor> in(kAttentionInputs);
  size_t given = 0;
  ORT_TRY(g_api->KernelContextGetInputCount(ctx, &given));
  const OrtValue* scale_value = nullptr;
  if (given > kAttentionScaleInput) ORT_TRY(g_api->KernelContextGetInput(ctx, kAttentionScaleInput, &scale_value));
  for (size_t i = 0; i < in.size(); ++i)
    if (i != kAttentionScaleInput || scale_value != nullptr) ORT_TRY(read_input(ctx, i, &in[i]));
  const Tensor &qkv = in[0], &past_k = in[1], &past_v = in[2], &seqlens = in[3], &total = in[4], &cos = in[5],
               &sin = in[6], &kv_scale = in[kAttentionScaleInput];
  AttentionProblem p;
  p.H = int(k.heads);
  p.Hkv = int(k.kv_heads);
  p.scale = k.scale;
  p.softcap = k.softcap;
  p.window = int(k.window);
  if (qkv.type != kFloat16 || qkv.dims.size() != 3 || qkv.dims[2] % (p.H + 2 * p.Hkv) != 0)
    return error(op + ": qkv must be float16 [B, S, (num_heads + 2 kv_num_heads) * head_size]");
  p.B = int(qkv.dims[0]);
  p.S = int(qkv.dims[1]);
  p.D = int(qkv.dims[2] / (p.H + 2 * p.Hkv));
  const ElementType cache_type = k.def->pool;
  for (const Tensor* t : {&past_k, &past_v})
    if (t->type != cache_type || t->dims.size() != 4 || t->dims[0] != p.B || t->dims[1] != p.Hkv ||
        t->dims[3] != p.D || t->dims != past_k.dims)
      return error(op + ": past_key and past_value must be " + type_name(cache_type) +
                   " [B, kv_num_heads, capacity, head_size] with B = " + std::to_string(p.B) + ", head_size = " +
                   std::to_string(p.D));
  p.C = int(past_k.dims[2]);
  p.kv = cache_type == kInt8    ? enginesmith::KvFormat::kInt8
         : cache_type == kUint8 ? enginesmith::KvFormat::kFp8E4M3 : enginesmith::KvFormat::kNative;
  if (enginesmith::kv_quantized(p.kv)) {  // the paged op's rule and layout (kv_quant.h)
    if (scale_value == nullptr)
      return error(op + ": " + type_name(cache_type) + " caches hold codes and need kv_scale (input 7), float32 "
                   "[2, kv_num_heads, head_size]");
    ORT_TRY(expect(op, "kv_scale", kv_scale, kFloat, {2, p.Hkv, p.D},
                   "[2, kv_num_heads = " + std::to_string(p.Hkv) + ", head_size = " + std::to_string(p.D) + "]"));
    p.kv_scale = static_cast<const float*>(kv_scale.data);
  } else if (scale_value != nullptr) {
    return error(op + ": kv_scale is for int8 / uint8 (fp8 e4m3) caches; float16 caches hold the values");
  }
  if (seqlens.type != kInt32 || seqlens.dims != std::vector<int64_t>{p.B})
    return error(op + ": seqlens_k must be int32 [B]");
  int64_t total_elems = 1;
  for (int64_t d : total.dims) total_elems *= d;
  if (total.type != kInt32 || total_elems != 1) return error(op + ": total_sequence_length must be one int32");
  p.max_total = *static_cast<const int32_t*>(total.data);
  for (const Tensor* t : {&cos, &sin})
    if (t->type != kFloat16 || t->dims.size() != 2 || t->dims[1] != p.D / 2 || t->dims != cos.dims)
      return error(op + ": cos_cache and sin_cache must be float16 [positions, head_size / 2]");
  p.P = int(cos.dims[0]);
  p.qkv = static_cast<const __half*>(qkv.data);
  p.seqlens = static_cast<const int32_t*>(seqlens.data);
  p.cos = static_cast<const __half*>(cos.data);
  p.sin = static_cast<const __half*>(sin.data);
  void *out = nullptr, *present_k = nullptr, *present_v = nullptr;
  ORT_TRY(attention_outputs(ctx, {p.B, p.S, int64_t(p.H) * p.D}, past_k.dims, &out, &present_k, &present_v));
  p.out = static_cast<__half*>(out);
  p.k_cache = present_k;
  p.v_cache = present_v;
  if (p.B == 0 || p.S == 0) return nullptr;
  if (const char* why = enginesmith::attention_check(p); *why) return error(op + ": " + why);
  const size_t item = enginesmith::kv_quantized(p.kv) ? 1 : sizeof(__half);  // a code, or an fp16 value
  const size_t cache_bytes = size_t(p.B) * p.Hkv * p.C * p.D * item;
  if (!k.def->cuda) {
    if (present_k != past_k.data) std::memcpy(present_k, past_k.data, cache_bytes);
    if (present_v != past_v.data) std::memcpy(present_v, past_v.data, cache_bytes);
    enginesmith::attention_reference(p);
    return nullptr;
  }
  void* stream_ptr = nullptr;
  ORT_TRY(g_api->KernelContextGetGPUComputeStream(ctx, &stream_ptr));
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  (void)cudaGetLastError();
  cudaError_t err = cudaSuccess;
  for (auto [dst, src] : {std::pair<void*, void*>{present_k, past_k.data}, {present_v, past_v.data}})
    if (dst != src && err == cudaSuccess) err = cudaMemcpyAsync(dst, src, cache_bytes, cudaMemcpyDeviceToDevice, stream);
  if (err != cudaSuccess) return cuda_status(k, err);
  enginesmith::AttentionPlan plan = enginesmith::attention_plan(p, k.sms);
  plan.dependent = k.dependent;
  std::lock_guard<std::mutex> lock(k.mu);  // one workspace per node: launches in order, growth in between
  ORT_TRY(grow_workspace(k, plan.partial_floats * sizeof(float), plan.counters, stream));
  return cuda_status(k, enginesmith::attention_launch(p, plan, static_cast<float*>(k.workspace), k.counters, stream));
}

// ---- PagedGroupQueryAttention.
std::string type_name(ElementType t) {
  return t == kFloat16 ? "float16" : t == kInt32 ? "int32" : t == kFloat ? "float32" : t == kInt8 ? "int8"
         : t == kUint8 ? "uint8" : "type " + std::to_string(t);
}

std::string dims_text(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// One input against the type and shape the op expects (-1 in `want`: any size); `legend` names the
// dimensions for the message.
OrtStatus* expect(const std::string& op, const char* name, const Tensor& t, ElementType type,
                  const std::vector<int64_t>& want, const std::string& legend) {
  bool ok = t.type == type && t.dims.size() == want.size();
  for (size_t i = 0; ok && i < want.size(); ++i) ok = want[i] < 0 || t.dims[i] == want[i];
  if (ok) return nullptr;
  return error(op + ": " + name + " must be " + type_name(type) + " " + legend + ", got " + type_name(t.type) + " " +
               dims_text(t.dims));
}

OrtStatus* compute_paged_attention(Kernel& k, OrtKernelContext* ctx) {
  const std::string& op = k.def->name;
  std::vector<Tensor> in(kPagedInputs);
  size_t given = 0;
  ORT_TRY(g_api->KernelContextGetInputCount(ctx, &given));
  const OrtValue* scale_value = nullptr;
  if (given > kKvScaleInput) ORT_TRY(g_api->KernelContextGetInput(ctx, kKvScaleInput, &scale_value));
  for (size_t i = 0; i < in.size(); ++i)
    if (i != kKvScaleInput || scale_value != nullptr) ORT_TRY(read_input(ctx, i, &in[i]));
  const Tensor &qkv = in[0], &key_pool = in[1], &value_pool = in[2], &tables = in[3], &lens = in[4], &slots = in[5],
               &cos = in[6], &sin = in[7];
  enginesmith::PagedGqaProblem p;
  p.H = int(k.heads);
  p.Hkv = int(k.kv_heads);
  const auto n = [](int64_t v) { return std::to_string(v); };
  const int64_t heads = p.H + 2 * p.Hkv;
  if (qkv.type != kFloat16 || qkv.dims.size() != 3 || qkv.dims[2] % heads != 0)
    return error(op + ": qkv must be float16 [batch, seq, (num_heads + 2 kv_num_heads) * head_size] with num_heads = " +
                 n(p.H) + ", kv_num_heads = " + n(p.Hkv) + ", got " + type_name(qkv.type) + " " + dims_text(qkv.dims));
  p.B = int(qkv.dims[0]);
  p.S = int(qkv.dims[1]);
  p.D = int(qkv.dims[2] / heads);
  const std::string pool = "[num_blocks, block_size, kv_num_heads = " + n(p.Hkv) + ", head_size = " + n(p.D) + "]";
  const ElementType pool_type = k.def->pool;
  ORT_TRY(expect(op, "key_pool", key_pool, pool_type, {-1, -1, p.Hkv, p.D}, pool));
  ORT_TRY(expect(op, "value_pool", value_pool, pool_type, key_pool.dims,
                 "with key_pool's shape " + dims_text(key_pool.dims)));
  p.kv = pool_type == kInt8 ? enginesmith::KvFormat::kInt8
         : pool_type == kUint8 ? enginesmith::KvFormat::kFp8E4M3 : enginesmith::KvFormat::kNative;
  const Tensor& kv_scale = in[kKvScaleInput];
  if (enginesmith::kv_quantized(p.kv)) {
    if (scale_value == nullptr)
      return error(op + ": " + type_name(pool_type) + " pools hold codes and need kv_scale (input 8), float32 "
                   "[2, kv_num_heads, head_size]");
    ORT_TRY(expect(op, "kv_scale", kv_scale, kFloat, {2, p.Hkv, p.D},
                   "[2, kv_num_heads = " + n(p.Hkv) + ", head_size = " + n(p.D) + "]"));
    p.kv_scale = static_cast<const float*>(kv_scale.data);
  } else if (scale_value != nullptr) {
    return error(op + ": kv_scale is for int8 / uint8 (fp8 e4m3) pools; float16 pools hold the values");
  }
  p.NB = int(key_pool.dims[0]);
  p.BS = int(key_pool.dims[1]);
  ORT_TRY(expect(op, "block_tables", tables, kInt32, {p.B, -1}, "[batch = " + n(p.B) + ", max_blocks_per_seq]"));
  p.MB = int(tables.dims[1]);
  ORT_TRY(expect(op, "context_lens", lens, kInt32, {p.B}, "[batch = " + n(p.B) + "]"));
  ORT_TRY(expect(op, "slot_mapping", slots, kInt32, {p.B, p.S}, "[batch = " + n(p.B) + ", seq = " + n(p.S) + "]"));
  ORT_TRY(expect(op, "cos_cache", cos, kFloat16, {-1, p.D / 2}, "[positions, head_size / 2 = " + n(p.D / 2) + "]"));
  ORT_TRY(expect(op, "sin_cache", sin, kFloat16, cos.dims, "with cos_cache's shape " + dims_text(cos.dims)));
  p.P = int(cos.dims[0]);
  p.scale = k.scale > 0.f ? k.scale : 1.f / std::sqrt(float(p.D));
  p.softcap = k.softcap;
  p.window = int(k.window);
  p.qkv = static_cast<const __half*>(qkv.data);
  p.block_tables = static_cast<const int32_t*>(tables.data);
  p.context_lens = static_cast<const int32_t*>(lens.data);
  p.slot_mapping = static_cast<const int32_t*>(slots.data);
  p.cos = static_cast<const __half*>(cos.data);
  p.sin = static_cast<const __half*>(sin.data);
  if (p.B > 0 && p.S > 0)
    if (const std::string why = enginesmith::paged_gqa_check(p); !why.empty()) return error(op + ": " + why);
  void *out = nullptr, *present_k = nullptr, *present_v = nullptr;
  ORT_TRY(attention_outputs(ctx, {p.B, p.S, int64_t(p.H) * p.D}, key_pool.dims, &out, &present_k, &present_v));
  p.out = static_cast<__half*>(out);
  p.key_pool = present_k;
  p.value_pool = present_v;
  size_t pool_bytes = enginesmith::kv_quantized(p.kv) ? 1 : sizeof(__half);
  for (int64_t d : key_pool.dims) pool_bytes *= size_t(d);
  const std::pair<void*, const void*> copies[] = {{present_k, key_pool.data}, {present_v, value_pool.data}};
  if (!k.def->cuda) {
    for (auto [dst, src] : copies)
      if (dst != src) std::memcpy(dst, src, pool_bytes);
    if (p.B > 0 && p.S > 0) enginesmith::paged_gqa_reference(p);
    return nullptr;
  }
  void* stream_ptr = nullptr;
  ORT_TRY(g_api->KernelContextGetGPUComputeStream(ctx, &stream_ptr));
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  (void)cudaGetLastError();
  cudaError_t err = cudaSuccess;
  for (auto [dst, src] : copies)
    if (dst != src && err == cudaSuccess) err = cudaMemcpyAsync(dst, src, pool_bytes, cudaMemcpyDeviceToDevice, stream);
  if (err != cudaSuccess) return cuda_status(k, err);
  if (p.B == 0 || p.S == 0) return nullptr;
  enginesmith::PagedGqaPlan plan;
  enginesmith::Status st = enginesmith::paged_gqa_plan(p, &plan, batch_invariant());
  plan.dependent = k.dependent;
  std::lock_guard<std::mutex> lock(k.mu);  // one workspace per node: launches in order, growth in between
  if (st.ok) ORT_TRY(grow_workspace(k, plan.scratch_bytes, size_t(plan.counters), stream));
  if (st.ok) st = enginesmith::paged_gqa_launch(p, plan, k.workspace, k.counters, stream);
  return st.ok ? nullptr : error(op + ": " + st.message);
}

OrtStatus* compute(void* kernel_ptr, OrtKernelContext* ctx) {
  Kernel& k = *static_cast<Kernel*>(kernel_ptr);
  if (k.def->paged) return compute_paged_attention(k, ctx);
  if (k.def->attention) return compute_attention(k, ctx);
  const OpDef& d = *k.def;
  const std::string& op = d.name;  // strings are built only on the error paths
  std::vector<Tensor> in(input_count(d));
  for (size_t i = 0; i < in.size(); ++i) ORT_TRY(read_input(ctx, i, &in[i]));
  const Tensor& x = in[0];
  if (x.type != kFloat16 || x.dims.empty()) return error(op + ": x must be a float16 tensor [..., K]");
  GemvProblem p;
  p.q4 = d.q4;
  p.swiglu = d.swiglu;
  const size_t w0 = first_weight(d);
  p.K = int(x.dims.back());
  int64_t M = 1;
  for (size_t i = 0; i + 1 < x.dims.size(); ++i) M *= x.dims[i];
  p.M = int(M);
  const int nw = p.swiglu ? 2 : 1;
  if (!p.q4) {
    for (int w = 0; w < nw; ++w) {
      const Tensor& t = in[w0 + w];
      if (t.type != kFloat16 || t.dims.size() != 2 || t.dims[1] != p.K || (w == 1 && t.dims[0] != in[w0].dims[0]))
        return error(op + ": weights must be float16 [N, K] with K = " + std::to_string(p.K));
      p.w[w] = t.data;
    }
    p.N = int(in[w0].dims[0]);
  } else {
    if (p.K != k.K) return error(op + ": x has K = " + std::to_string(p.K) + ", the node says " + std::to_string(k.K));
    p.N = int(k.N);
    p.block_size = int(k.block_size);
    for (int w = 0; w < nw; ++w) {
      const Tensor& b = in[w0 + 2 * w];
      const Tensor& s = in[w0 + 1 + 2 * w];
      int64_t b_elems = 1, s_elems = 1;
      for (int64_t d : b.dims) b_elems *= d;
      for (int64_t d : s.dims) s_elems *= d;
      if (b.type != kUint8 || b_elems != k.N * k.K / 2 || s.type != kFloat16 || s_elems != k.N * (k.K / k.block_size))
        return error(op + ": packed weights must be uint8 [N, K/block_size, block_size/2] and scales float16 "
                          "[N, K/block_size]");
      p.w[w] = b.data;
      p.scales[w] = static_cast<const __half*>(s.data);
    }
  }
  p.x = static_cast<const __half*>(x.data);
  if (d.norm != Norm::kNone) {
    const Tensor& gamma = in[w0 - 1];
    if (gamma.type != kFloat16 || gamma.dims.size() != 1 || gamma.dims[0] != p.K)
      return error(op + ": gamma must be float16 [K] with K = " + std::to_string(p.K));
    p.gamma = static_cast<const __half*>(gamma.data);
    p.eps = k.eps;
    if (d.norm == Norm::kSkipRms) {
      const Tensor& skip = in[1];
      if (skip.type != kFloat16 || skip.dims != x.dims) return error(op + ": skip must be float16 with x's shape");
      p.skip = static_cast<const __half*>(skip.data);
      OrtValue* sum = nullptr;
      ORT_TRY(g_api->KernelContextGetOutput(ctx, 1, x.dims.data(), x.dims.size(), &sum));
      void* sum_data = nullptr;
      ORT_TRY(g_api->GetTensorMutableData(sum, &sum_data));
      p.sum_out = static_cast<__half*>(sum_data);
    }
  }
  std::vector<int64_t> out_dims(x.dims.begin(), x.dims.end() - 1);
  out_dims.push_back(p.N);
  OrtValue* out = nullptr;
  ORT_TRY(g_api->KernelContextGetOutput(ctx, 0, out_dims.data(), out_dims.size(), &out));
  void* y = nullptr;
  ORT_TRY(g_api->GetTensorMutableData(out, &y));
  p.y = static_cast<__half*>(y);
  if (p.M == 0) return nullptr;
  if (const char* why = enginesmith::gemv_check(p); *why) return error(op + ": " + why);
  if (d.cuda) return run_cuda(k, p, ctx);
  enginesmith::gemv_reference(p);
  return nullptr;
}

// ---- OrtCustomOp callbacks.
const OpDef& def_of(const CustomOp* op) { return *reinterpret_cast<const OpDef*>(op); }

// GroupQueryAttention's softcap and local_window_size: absent means off; present, they are checked.
OrtStatus* optional_attributes(const OrtKernelInfo* info, Kernel* kernel) {
  if (OrtStatus* s = g_api->KernelInfoGetAttributeFloat(info, "softcap", &kernel->softcap)) {
    g_api->ReleaseStatus(s);
    kernel->softcap = 0.f;
  }
  if (OrtStatus* s = g_api->KernelInfoGetAttributeInt64(info, "local_window_size", &kernel->window)) {
    g_api->ReleaseStatus(s);
    kernel->window = -1;
  }
  const std::string& name = kernel->def->name;
  if (!(kernel->softcap >= 0.f) || !std::isfinite(kernel->softcap))
    return error(name + ": softcap must be >= 0 (0: off), got " + std::to_string(kernel->softcap));
  if (kernel->window == 0 || kernel->window < -1 || kernel->window > INT32_MAX)
    return error(name + ": local_window_size must be positive, or -1 (off), got " + std::to_string(kernel->window));
  return nullptr;
}

OrtStatus* create_kernel(const CustomOp* op, const void*, const OrtKernelInfo* info, void** out) {
  const OpDef& d = def_of(op);
  if (d.cuda && !d.attention && !d.paged) {  // the GEMVs' launch setting and cuBLAS: at session start, not in a capture
    enginesmith::gemv_prepare();
    cublas();
  }
  auto kernel = new Kernel(&d);
  if (d.attention || d.paged) {
    OrtStatus* s = g_api->KernelInfoGetAttributeInt64(info, "num_heads", &kernel->heads);
    if (!s) s = g_api->KernelInfoGetAttributeInt64(info, "kv_num_heads", &kernel->kv_heads);
    if (!s) s = g_api->KernelInfoGetAttributeFloat(info, "scale", &kernel->scale);
    if (s && d.paged) {  // optional there: 0 (the default) means 1 / sqrt(head_size)
      g_api->ReleaseStatus(s);
      s = nullptr;
      kernel->scale = 0.f;
    }
    if (!s && (kernel->heads <= 0 || kernel->kv_heads <= 0 || kernel->heads % kernel->kv_heads != 0))
      s = error(d.name + ": num_heads must be a positive multiple of kv_num_heads");
    if (!s && d.attention && !(kernel->scale > 0.f)) s = error(d.name + ": scale must be positive");
    if (!s) s = optional_attributes(info, kernel);  // both ops: softcap, local_window_size
    if (!s && d.paged && !(kernel->scale >= 0.f && std::isfinite(kernel->scale)))
      s = error(d.name + ": scale must be positive, or 0 for 1 / sqrt(head_size)");
    if (!s && d.cuda) {
      int device = 0;
      if (cudaGetDevice(&device) != cudaSuccess ||
          cudaDeviceGetAttribute(&kernel->sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
        s = error(d.name + ": cannot query the CUDA device");
      kernel->dependent = enginesmith::dependent_launches_enabled();
    }
    if (s) {
      delete kernel;
      return s;
    }
    *out = kernel;
    return nullptr;
  }
  if (d.norm != Norm::kNone) {
    if (OrtStatus* s = g_api->KernelInfoGetAttributeFloat(info, "epsilon", &kernel->eps)) {
      delete kernel;
      return s;
    }
    if (!(kernel->eps >= 0.f)) {
      delete kernel;
      return error(d.name + ": epsilon must be >= 0");
    }
  }
  if (d.q4) {
    for (auto [name, dst] : {std::pair<const char*, int64_t*>{"K", &kernel->K}, {"N", &kernel->N},
                             {"block_size", &kernel->block_size}}) {
      if (OrtStatus* s = g_api->KernelInfoGetAttributeInt64(info, name, dst)) {
        delete kernel;
        return s;
      }
    }
    if (kernel->K <= 0 || kernel->N <= 0 || kernel->block_size <= 0) {
      delete kernel;
      return error(d.name + ": K, N and block_size must be positive");
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
  const OpDef& d = def_of(op);
  if (d.paged) {  // the pools, block_tables, context_lens, slot_mapping, kv_scale
    return (i == 1 || i == 2) ? d.pool : (i >= 3 && i <= 5) ? kInt32 : i == kKvScaleInput ? kFloat : kFloat16;
  }
  if (d.attention)  // the caches, seqlens_k, total_sequence_length, kv_scale
    return (i == 1 || i == 2)                           ? d.pool
           : (i == 3 || i == kTotalLengthInput)         ? kInt32
           : i == kAttentionScaleInput                  ? kFloat
                                                        : kFloat16;
  if (i < first_weight(d) || !d.q4) return kFloat16;
  return ((i - first_weight(d)) % 2 == 0) ? kUint8 : kFloat16;  // B, scales, B, scales
}

OpDef make(bool swiglu, bool q4, Norm norm, bool cuda, bool attention = false, bool paged = false,
         ElementType pool = kFloat16) {
  OpDef d{};
  d.pool = pool;
  d.name = paged       ? std::string("PagedGroupQueryAttention")
           : attention ? std::string("GroupQueryAttention")
                       : std::string(norm == Norm::kSkipRms ? "SkipRmsNorm" : norm == Norm::kRms ? "RmsNorm" : "") +
                           (swiglu ? "SwiGluGemv" : "Gemv") + (q4 ? "Q4" : "");
  d.attention = attention;
  d.paged = paged;
  d.q4 = q4;
  d.swiglu = swiglu;
  d.norm = norm;
  d.cuda = cuda;
  d.provider = cuda ? "CUDAExecutionProvider" : "CPUExecutionProvider";
  CustomOp& o = d.op;
  o.version = kApiVersion;
  o.CreateKernel = create_kernel_v1;
  o.GetName = [](const CustomOp* op) { return def_of(op).name.c_str(); };
  o.GetExecutionProviderType = [](const CustomOp* op) { return def_of(op).provider; };
  o.GetInputType = input_type;
  o.GetInputTypeCount = [](const CustomOp* op) { return input_count(def_of(op)); };
  o.GetOutputType = [](const CustomOp* op, size_t i) {
    const OpDef& d = def_of(op);  // present pools / caches: the pools' / caches' type
    return (d.paged || d.attention) && (i == 1 || i == 2) ? d.pool : kFloat16;
  };
  o.GetOutputTypeCount = [](const CustomOp* op) { return output_count(def_of(op)); };
  o.KernelCompute = compute_v1;
  o.KernelDestroy = [](void* kernel) { delete static_cast<Kernel*>(kernel); };
  o.GetInputCharacteristic = [](const CustomOp* op, size_t i) {
    const OpDef& d = def_of(op);  // 1: optional (kv_scale)
    return (d.paged && i == kKvScaleInput) || (d.attention && i == kAttentionScaleInput) ? 1 : 0;
  };
  o.GetOutputCharacteristic = [](const CustomOp*, size_t) { return 0; };
  o.GetInputMemoryType = [](const CustomOp* op, size_t i) {
    return def_of(op).attention && def_of(op).cuda && i == kTotalLengthInput ? -2 : 0;  // -2: host memory
  };
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
    std::vector<OpDef> v;  // built once, never resized after: the names' c_str() stay valid
    for (bool cuda : {false, true})
      for (Norm norm : {Norm::kNone, Norm::kRms, Norm::kSkipRms})
        for (bool swiglu : {false, true})
          for (bool q4 : {false, true}) v.push_back(make(swiglu, q4, norm, cuda));
    for (bool cuda : {false, true})
      for (ElementType cache : {kFloat16, kInt8, kUint8})  // one kernel per cache type, one op
        v.push_back(make(false, false, Norm::kNone, cuda, true, false, cache));
    for (bool cuda : {false, true})
      for (ElementType pool : {kFloat16, kInt8, kUint8})  // one kernel per pool type, one op
        v.push_back(make(false, false, Norm::kNone, cuda, false, true, pool));
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
