// SparseGemm24 over cuSPARSELt (built when CMake finds it; otherwise every call says how to get it).
#include "sparse_gemm.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#if defined(ENGINESMITH_WITH_CUSPARSELT)
#include <cusparseLt.h>
#endif

namespace enginesmith {
namespace sparse_gemm {

#if !defined(ENGINESMITH_WITH_CUSPARSELT)

namespace {
Status unavailable() {
    return Status::Error(
        "sparse gemm: this build has no cuSPARSELt; install nvidia-cusparselt-cu13 (or set CUSPARSELT_ROOT) and "
        "rebuild the plugins");
}
}  // namespace

bool available() { return false; }
struct SparseGemm24::Impl {};
SparseGemm24::SparseGemm24(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SparseGemm24::~SparseGemm24() = default;
Status SparseGemm24::create_from_dense(DType, int64_t, int64_t, void const*, cudaStream_t, std::unique_ptr<SparseGemm24>*) {
    return unavailable();
}
Status SparseGemm24::create_from_compressed(void const*, size_t, cudaStream_t, std::unique_ptr<SparseGemm24>*) {
    return unavailable();
}
Status SparseGemm24::export_compressed(std::vector<uint8_t>*, cudaStream_t) const { return unavailable(); }
Status SparseGemm24::workspace_size(int64_t, size_t*, int) { return unavailable(); }
Status SparseGemm24::run(void const*, void*, int64_t, void*, size_t, cudaStream_t, int) { return unavailable(); }
Status SparseGemm24::algorithm_count(int64_t, int*) { return unavailable(); }
DType SparseGemm24::dtype() const { return DType::kFloat16; }
int64_t SparseGemm24::n() const { return 0; }
int64_t SparseGemm24::k() const { return 0; }
size_t SparseGemm24::compressed_bytes() const { return 0; }

#else

namespace {

#define ES_RETURN_IF_LT_ERROR(expr)                                                                              \
    do {                                                                                                         \
        cusparseStatus_t es_lt_ = (expr);                                                                        \
        if (es_lt_ != CUSPARSE_STATUS_SUCCESS)                                                                   \
            return Status::Error(std::string("cuSPARSELt: ") + #expr + " failed: " + cusparseLtGetErrorName(es_lt_) + \
                                 " (" + cusparseLtGetErrorString(es_lt_) + ")");                                 \
    } while (0)

constexpr uint32_t kAlignment = 16;
constexpr int64_t kPadM = 16;  // fallback when cuSPARSELt rejects a plan for an unaligned M
constexpr uint32_t kBlobMagic = 0x34324753;  // "SG24"

struct BlobHeader {
    uint32_t magic;
    uint32_t header_bytes;
    int32_t cusparselt_version;
    int32_t sm;  // major * 10 + minor of the device that compressed
    int32_t dtype;
    int32_t layout;  // Layout the compressed bytes were made for
    int64_t n;
    int64_t k;
    uint64_t compressed_bytes;
};

// How W and X are described to cuSPARSELt (the memory is the same either way):
//   kRowA:  A = W row-major N x K, op N;  B = X row-major M x K, op T  (PyTorch's _cslt_sparse_mm)
//   kColAT: A = W as column-major K x N, op T;  B = X as column-major K x M, op N
// Measured on an H200 (cuSPARSELt of torch 2.11): the same speed. ES_SPARSE_LAYOUT=col picks kColAT.
enum class Layout { kRowA, kColAT };
const Layout kLayout = [] {
    char const* v = std::getenv("ES_SPARSE_LAYOUT");
    return (v != nullptr && std::string(v) == "col") ? Layout::kColAT : Layout::kRowA;
}();
cusparseOperation_t op_a() {
    return kLayout == Layout::kRowA ? CUSPARSE_OPERATION_NON_TRANSPOSE : CUSPARSE_OPERATION_TRANSPOSE;
}

// C order: kCol writes Y [M, N] row-major directly (Yᵀ column-major); kRowT has cuSPARSELt write
// Yᵀ [N, M] row-major (what PyTorch's F.linear path returns, as a transposed view) into the
// workspace and transposes it into Y. On an H200, transpose included, kRowT was 4-5x faster at
// M <= 16, median 1.4x (0.75x-2.6x) at M >= 256, slower only on 2048-wide shapes
// (benchmarks/plugins/results), so it is the default. ES_SPARSE_OUT=col picks kCol.
enum class OutOrder { kCol, kRowT };
const OutOrder kOut = [] {
    char const* v = std::getenv("ES_SPARSE_OUT");
    return (v != nullptr && std::string(v) == "col") ? OutOrder::kCol : OutOrder::kRowT;
}();

cusparseOperation_t op_b() {
    return kLayout == Layout::kRowA ? CUSPARSE_OPERATION_TRANSPOSE : CUSPARSE_OPERATION_NON_TRANSPOSE;
}

cudaDataType cuda_type(DType t) { return t == DType::kFloat16 ? CUDA_R_16F : CUDA_R_16BF; }

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

Status current_sm(int* sm) {
    int dev = 0, major = 0, minor = 0;
    ES_RETURN_IF_CUDA_ERROR(cudaGetDevice(&dev));
    ES_RETURN_IF_CUDA_ERROR(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    ES_RETURN_IF_CUDA_ERROR(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    *sm = major * 10 + minor;
    return Status::Ok();
}

}  // namespace

bool available() { return true; }

struct Plan {
    int64_t m_plan = 0;  // M the plan was made for (M itself, or M rounded up to kPadM)
    bool padded = false;
    cusparseLtMatDescriptor_t mat_b{}, mat_c{};
    cusparseLtMatmulDescriptor_t matmul{};
    cusparseLtMatmulAlgSelection_t alg{};
    cusparseLtMatmulPlan_t plan{};
    size_t lt_workspace = 0;
    bool ready = false;

    ~Plan() {
        if (!ready) return;
        cusparseLtMatmulPlanDestroy(&plan);
        cusparseLtMatmulAlgSelectionDestroy(&alg);
        cusparseLtMatDescriptorDestroy(&mat_b);
        cusparseLtMatDescriptorDestroy(&mat_c);
    }
};

struct SparseGemm24::Impl {
    DType dtype = DType::kFloat16;
    int64_t n = 0, k = 0;
    cusparseLtHandle_t handle{};
    cusparseLtMatDescriptor_t mat_a{};
    bool handle_ready = false, mat_a_ready = false;
    void* compressed = nullptr;
    size_t compressed_size = 0;
    std::mutex mutex;
    std::map<std::pair<int64_t, int>, std::unique_ptr<Plan>> plans;  // by (M, config)
    // (M, config) pairs cuSPARSELt refused, with why: asked again (the TensorRT plugin falls back to
    // the default on every enqueue at such an M), the answer comes without another plan attempt.
    std::map<std::pair<int64_t, int>, std::string> refused;

    ~Impl() {
        plans.clear();
        if (compressed) cudaFree(compressed);
        if (mat_a_ready) cusparseLtMatDescriptorDestroy(&mat_a);
        if (handle_ready) cusparseLtDestroy(&handle);
    }

    Status init(DType t, int64_t rows_n, int64_t cols_k) {
        ES_RETURN_IF_ERROR(check_config(t, rows_n, cols_k));
        dtype = t;
        n = rows_n;
        k = cols_k;
        ES_RETURN_IF_LT_ERROR(cusparseLtInit(&handle));
        handle_ready = true;
        // A = W [N, K] as stored (row-major), not transposed; see sparse_gemm.h for B and C.
        if (kLayout == Layout::kRowA)
            ES_RETURN_IF_LT_ERROR(cusparseLtStructuredDescriptorInit(&handle, &mat_a, n, k, k, kAlignment,
                cuda_type(dtype), CUSPARSE_ORDER_ROW, CUSPARSELT_SPARSITY_50_PERCENT));
        else
            ES_RETURN_IF_LT_ERROR(cusparseLtStructuredDescriptorInit(&handle, &mat_a, k, n, k, kAlignment,
                cuda_type(dtype), CUSPARSE_ORDER_COL, CUSPARSELT_SPARSITY_50_PERCENT));
        mat_a_ready = true;
        size_t buffer_size = 0;
        ES_RETURN_IF_LT_ERROR(cusparseLtSpMMACompressedSize2(&handle, &mat_a, &compressed_size, &buffer_size));
        ES_RETURN_IF_CUDA_ERROR(cudaMalloc(&compressed, compressed_size));
        return Status::Ok();
    }

    // config_id < 0: cuSPARSELt's default selection; else that kernel configuration.
    Status make_plan(int64_t m_plan, Plan* p, int config_id = -1) {
        p->m_plan = m_plan;
        // B = Xᵀ: kRowA describes X [M, K] row-major used transposed (PyTorch's choice), kColAT the
        // same memory as a column-major K x M.
        if (kLayout == Layout::kRowA)
            ES_RETURN_IF_LT_ERROR(cusparseLtDenseDescriptorInit(
                &handle, &p->mat_b, m_plan, k, k, kAlignment, cuda_type(dtype), CUSPARSE_ORDER_ROW));
        else
            ES_RETURN_IF_LT_ERROR(cusparseLtDenseDescriptorInit(
                &handle, &p->mat_b, k, m_plan, k, kAlignment, cuda_type(dtype), CUSPARSE_ORDER_COL));
        cusparseStatus_t st = kOut == OutOrder::kCol
            ? cusparseLtDenseDescriptorInit(&handle, &p->mat_c, n, m_plan, n, kAlignment, cuda_type(dtype), CUSPARSE_ORDER_COL)
            : cusparseLtDenseDescriptorInit(&handle, &p->mat_c, n, m_plan, m_plan, kAlignment, cuda_type(dtype), CUSPARSE_ORDER_ROW);
        if (st != CUSPARSE_STATUS_SUCCESS) {
            cusparseLtMatDescriptorDestroy(&p->mat_b);
            ES_RETURN_IF_LT_ERROR(st);
        }
        st = cusparseLtMatmulDescriptorInit(&handle, &p->matmul, op_a(),
            op_b(), &mat_a, &p->mat_b, &p->mat_c, &p->mat_c, CUSPARSE_COMPUTE_32F);
        if (st == CUSPARSE_STATUS_SUCCESS)
            st = cusparseLtMatmulAlgSelectionInit(&handle, &p->alg, &p->matmul, CUSPARSELT_MATMUL_ALG_DEFAULT);
        if (st == CUSPARSE_STATUS_SUCCESS && config_id >= 0) {
            int count = 0;
            st = cusparseLtMatmulAlgGetAttribute(
                &handle, &p->alg, CUSPARSELT_MATMUL_ALG_CONFIG_MAX_ID, &count, sizeof(count));
            if (st == CUSPARSE_STATUS_SUCCESS && config_id >= count) {
                cusparseLtMatmulAlgSelectionDestroy(&p->alg);
                cusparseLtMatDescriptorDestroy(&p->mat_b);
                cusparseLtMatDescriptorDestroy(&p->mat_c);
                return Status::Error("sparse gemm: config " + std::to_string(config_id) + " outside [0, " +
                                     std::to_string(count) + ") for M=" + std::to_string(m_plan));
            }
            if (st == CUSPARSE_STATUS_SUCCESS)
                st = cusparseLtMatmulAlgSetAttribute(
                    &handle, &p->alg, CUSPARSELT_MATMUL_ALG_CONFIG_ID, &config_id, sizeof(config_id));
            if (st != CUSPARSE_STATUS_SUCCESS) cusparseLtMatmulAlgSelectionDestroy(&p->alg);
        }
        if (st == CUSPARSE_STATUS_SUCCESS) {
            st = cusparseLtMatmulPlanInit(&handle, &p->plan, &p->matmul, &p->alg);
            if (st != CUSPARSE_STATUS_SUCCESS) cusparseLtMatmulAlgSelectionDestroy(&p->alg);
        }
        if (st != CUSPARSE_STATUS_SUCCESS) {
            cusparseLtMatDescriptorDestroy(&p->mat_b);
            cusparseLtMatDescriptorDestroy(&p->mat_c);
            ES_RETURN_IF_LT_ERROR(st);
        }
        p->ready = true;
        ES_RETURN_IF_LT_ERROR(cusparseLtMatmulGetWorkspace(&handle, &p->plan, &p->lt_workspace));
        return Status::Ok();
    }

    // The cached plan for (M, config): exact M if cuSPARSELt takes it, else M rounded up to kPadM.
    Status plan_for(int64_t m, int config, Plan** out) {
        if (config < -1) return Status::Error("sparse gemm: config " + std::to_string(config) + " is not an id");
        std::lock_guard<std::mutex> lock(mutex);
        auto it = plans.find({m, config});
        if (it != plans.end()) {
            *out = it->second.get();
            return Status::Ok();
        }
        auto no = refused.find({m, config});
        if (no != refused.end()) return Status::Error(no->second);
        auto p = std::make_unique<Plan>();
        Status st = make_plan(m, p.get(), config);
        if (!st.ok && m % kPadM != 0) {
            p = std::make_unique<Plan>();
            st = make_plan((m + kPadM - 1) / kPadM * kPadM, p.get(), config);
            p->padded = true;
        }
        if (!st.ok) {
            refused.emplace(std::make_pair(m, config), st.message);
            return st;
        }
        *out = p.get();
        plans.emplace(std::make_pair(m, config), std::move(p));
        return Status::Ok();
    }

    // Staging in the workspace: X and Y padded to m_plan rows when padded; Yᵀ when kRowT.
    size_t staging_bytes(Plan const& p) const {
        if (!p.padded && kOut == OutOrder::kCol) return 0;
        return align_up(static_cast<size_t>(p.m_plan) * k * 2, 256) + align_up(static_cast<size_t>(p.m_plan) * n * 2, 256);
    }

    size_t total_workspace(Plan const& p) const { return align_up(p.lt_workspace, 256) + staging_bytes(p); }

    // Resolve the buffers cuSPARSELt sees: the caller's, or padded staging copies in the workspace.
    Status bind(Plan const& p, void const* x, void* y, int64_t m, void* ws, size_t ws_bytes, cudaStream_t stream,
        void const** bx, void** by, void** lt_ws) {
        if (total_workspace(p) > ws_bytes)
            return Status::Error("sparse gemm: workspace of " + std::to_string(ws_bytes) + " bytes, " +
                                 std::to_string(total_workspace(p)) + " needed for M=" + std::to_string(m));
        *lt_ws = p.lt_workspace ? ws : nullptr;
        *bx = x;
        *by = y;
        char* base = static_cast<char*>(ws) + align_up(p.lt_workspace, 256);
        void* y_stage = base + align_up(static_cast<size_t>(p.m_plan) * k * 2, 256);
        if (p.padded) {
            ES_RETURN_IF_CUDA_ERROR(
                cudaMemcpyAsync(base, x, static_cast<size_t>(m) * k * 2, cudaMemcpyDeviceToDevice, stream));
            *bx = base;
        }
        if (p.padded || kOut == OutOrder::kRowT) *by = y_stage;
        return Status::Ok();
    }

    // The plan for (M, config) with its buffers bound: what one matmul needs.
    struct Bound {
        Plan* plan = nullptr;
        void const* x = nullptr;
        void* y = nullptr;
        void* lt_ws = nullptr;
    };
    Status prepare(int64_t m, int config, void const* x, void* y, void* ws, size_t ws_bytes, cudaStream_t stream,
        Bound* out) {
        ES_RETURN_IF_ERROR(plan_for(m, config, &out->plan));
        return bind(*out->plan, x, y, m, ws, ws_bytes, stream, &out->x, &out->y, &out->lt_ws);
    }

    // Move cuSPARSELt's result into Y [M, N] row-major.
    Status finish(Plan const& p, void const* by, void* y, int64_t m, cudaStream_t stream) const {
        if (kOut == OutOrder::kRowT) {
            // by holds Yᵀ [N, m_plan] row-major; its first m columns are Y's rows.
            return launch_transpose16(by, y, n, m, p.m_plan, stream);
        }
        if (p.padded)
            ES_RETURN_IF_CUDA_ERROR(
                cudaMemcpyAsync(y, by, static_cast<size_t>(m) * n * 2, cudaMemcpyDeviceToDevice, stream));
        return Status::Ok();
    }
};

SparseGemm24::SparseGemm24(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SparseGemm24::~SparseGemm24() = default;

Status SparseGemm24::create_from_dense(
    DType dtype, int64_t n, int64_t k, void const* d_weight, cudaStream_t stream, std::unique_ptr<SparseGemm24>* out) {
    ES_RETURN_IF_ERROR(check_config(dtype, n, k));
    ES_RETURN_IF_ERROR(check_24_device(d_weight, n, k, nullptr, nullptr, stream));
    auto impl = std::make_unique<Impl>();
    ES_RETURN_IF_ERROR(impl->init(dtype, n, k));
    size_t compressed_size = 0, buffer_size = 0;
    ES_RETURN_IF_LT_ERROR(cusparseLtSpMMACompressedSize2(&impl->handle, &impl->mat_a, &compressed_size, &buffer_size));
    void* buffer = nullptr;
    if (buffer_size) ES_RETURN_IF_CUDA_ERROR(cudaMalloc(&buffer, buffer_size));
    cusparseStatus_t st = cusparseLtSpMMACompress2(
        &impl->handle, &impl->mat_a, 1, op_a(), d_weight, impl->compressed, buffer, stream);
    cudaError_t sync = cudaStreamSynchronize(stream);
    if (buffer) cudaFree(buffer);
    ES_RETURN_IF_LT_ERROR(st);
    ES_RETURN_IF_CUDA_ERROR(sync);
    out->reset(new SparseGemm24(std::move(impl)));
    return Status::Ok();
}

Status SparseGemm24::create_from_compressed(
    void const* blob, size_t bytes, cudaStream_t stream, std::unique_ptr<SparseGemm24>* out) {
    BlobHeader h{};
    if (bytes < sizeof(h)) return Status::Error("sparse gemm: serialized weight is truncated");
    std::memcpy(&h, blob, sizeof(h));
    if (h.magic != kBlobMagic || h.header_bytes != sizeof(h))
        return Status::Error("sparse gemm: serialized weight has an unknown header; rebuild the engine");
    if (h.layout != static_cast<int32_t>(kLayout))
        return Status::Error("sparse gemm: serialized weight was compressed for another cuSPARSELt layout; rebuild the engine");
    if (h.cusparselt_version != CUSPARSELT_VERSION)
        return Status::Error("sparse gemm: weight was compressed by cuSPARSELt " + std::to_string(h.cusparselt_version) +
                             ", this library is " + std::to_string(CUSPARSELT_VERSION) + "; rebuild the engine");
    int sm = 0;
    ES_RETURN_IF_ERROR(current_sm(&sm));
    if (h.sm != sm)
        return Status::Error("sparse gemm: weight was compressed on SM " + std::to_string(h.sm) + ", this GPU is SM " +
                             std::to_string(sm) + "; rebuild the engine on this GPU");
    auto impl = std::make_unique<Impl>();
    ES_RETURN_IF_ERROR(impl->init(static_cast<DType>(h.dtype), h.n, h.k));
    if (impl->compressed_size != h.compressed_bytes || bytes != sizeof(h) + h.compressed_bytes)
        return Status::Error("sparse gemm: serialized weight size does not match its shape; rebuild the engine");
    ES_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(impl->compressed, static_cast<char const*>(blob) + sizeof(h),
        h.compressed_bytes, cudaMemcpyHostToDevice, stream));
    ES_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream));
    out->reset(new SparseGemm24(std::move(impl)));
    return Status::Ok();
}

Status SparseGemm24::export_compressed(std::vector<uint8_t>* blob, cudaStream_t stream) const {
    BlobHeader h{};
    h.magic = kBlobMagic;
    h.header_bytes = sizeof(h);
    h.cusparselt_version = CUSPARSELT_VERSION;
    h.layout = static_cast<int32_t>(kLayout);
    ES_RETURN_IF_ERROR(current_sm(&h.sm));
    h.dtype = static_cast<int32_t>(impl_->dtype);
    h.n = impl_->n;
    h.k = impl_->k;
    h.compressed_bytes = impl_->compressed_size;
    blob->resize(sizeof(h) + impl_->compressed_size);
    std::memcpy(blob->data(), &h, sizeof(h));
    ES_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(
        blob->data() + sizeof(h), impl_->compressed, impl_->compressed_size, cudaMemcpyDeviceToHost, stream));
    ES_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream));
    return Status::Ok();
}

Status SparseGemm24::workspace_size(int64_t m, size_t* bytes, int config) {
    if (m <= 0) {
        *bytes = 0;
        return Status::Ok();
    }
    Plan* p = nullptr;
    ES_RETURN_IF_ERROR(impl_->plan_for(m, config, &p));
    *bytes = impl_->total_workspace(*p);
    return Status::Ok();
}

Status SparseGemm24::run(void const* x, void* y, int64_t m, void* ws, size_t ws_bytes, cudaStream_t stream, int config) {
    if (m <= 0) return Status::Ok();
    Impl::Bound b;
    ES_RETURN_IF_ERROR(impl_->prepare(m, config, x, y, ws, ws_bytes, stream, &b));
    const float alpha = 1.f, beta = 0.f;
    ES_RETURN_IF_LT_ERROR(cusparseLtMatmul(
        &impl_->handle, &b.plan->plan, &alpha, impl_->compressed, b.x, &beta, b.y, b.y, b.lt_ws, &stream, 1));
    return impl_->finish(*b.plan, b.y, y, m, stream);
}

Status SparseGemm24::algorithm_count(int64_t m, int* count) {
    if (m <= 0) return Status::Error("sparse gemm: M must be positive");
    Plan* p = nullptr;
    ES_RETURN_IF_ERROR(impl_->plan_for(m, -1, &p));
    std::lock_guard<std::mutex> lock(impl_->mutex);
    // CONFIG_MAX_ID is one past the last id: on an H100 (cuSPARSELt 0.8) it read 27 and id 27 was refused.
    ES_RETURN_IF_LT_ERROR(cusparseLtMatmulAlgGetAttribute(
        &impl_->handle, &p->alg, CUSPARSELT_MATMUL_ALG_CONFIG_MAX_ID, count, sizeof(*count)));
    return Status::Ok();
}

DType SparseGemm24::dtype() const { return impl_->dtype; }
int64_t SparseGemm24::n() const { return impl_->n; }
int64_t SparseGemm24::k() const { return impl_->k; }
size_t SparseGemm24::compressed_bytes() const { return impl_->compressed_size; }

#endif  // ENGINESMITH_WITH_CUSPARSELT

}  // namespace sparse_gemm
}  // namespace enginesmith
