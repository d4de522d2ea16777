// 2:4 semi-structured sparse weight x dense activation through cuSPARSELt.
//
//   Y[M, N] = X[M, K] · Wᵀ        X, Y row-major fp16 | bf16;  W [N, K] row-major (a Linear's weight)
//
// W must be 2:4 sparse along K: in every aligned group of 4 consecutive elements of a row, at most
// 2 are nonzero (+0 and -0 both count as zero). The pattern is validated before compression
// (check_24_host / check_24_device) and a violation is an error naming the first bad group; a dense
// weight is never silently pruned here (pruning is the sparsify pass's job).
//
// We describe Yᵀ[N, M] = W[N, K] · Xᵀ[K, M] to cuSPARSELt with
//   A = W   structured N x K, row-major (ld = K), op = N   (2:4 along K)
//   B = X   dense      M x K, row-major (ld = K), op = T
//   C = Yᵀ  dense      N x M, row-major (ld = M), in the workspace; a transpose kernel writes Y.
// (C as column-major N x M would be Y itself, but cuSPARSELt ran it slower on most shapes on an
// H200: 4-5x at M <= 16, median 1.4x at M >= 256; see sparse_gemm.cpp.)
// W is compressed once (create_*); a matmul plan is made per distinct M and cached. If cuSPARSELt
// rejects a plan for some M, M is padded to a multiple of 16 through the workspace.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "../common/status.h"

namespace enginesmith {
namespace sparse_gemm {

// cuSPARSELt's shape rules for 16-bit types: N and K multiples of 16 (we also need K % 4 == 0 for the
// 2:4 groups, implied). Defined once in plugins/limits.json (sparse_gemm.dim_align), which
// CMakeLists.txt compiles in as ES_SPARSE_DIM_ALIGN and Python reads (plugins/limits.py).
#ifndef ES_SPARSE_DIM_ALIGN
#error "ES_SPARSE_DIM_ALIGN comes from plugins/limits.json: build with plugins/CMakeLists.txt"
#endif
constexpr int kDimAlign = ES_SPARSE_DIM_ALIGN;
static_assert(kDimAlign % 4 == 0, "the 2:4 groups need K % 4 == 0");

// Shape/type check shared by the binding and the TensorRT wrapper.
Status check_config(DType dtype, int64_t n, int64_t k);

// Validate the 2:4 pattern of W [N, K] (16-bit elements) on the host. The error names the first
// offending row and column group and how many groups are bad.
Status check_24_host(uint16_t const* w, int64_t n, int64_t k);

// The same on the device; writes the number of bad groups to *bad_groups (synchronizes `stream`).
Status check_24_device(void const* w, int64_t n, int64_t k, int64_t* bad_groups, int64_t* first_bad, cudaStream_t stream);

// out [cols, rows] = transpose of in [rows, cols] (row stride ld_in), 16-bit elements: returns Y
// row-major when cuSPARSELt writes Yᵀ row-major.
Status launch_transpose16(void const* in, void* out, int64_t rows, int64_t cols, int64_t ld_in, cudaStream_t stream);

// Whether this build has cuSPARSELt (the kernels above do not need it; the GEMM does).
bool available();

class SparseGemm24 {
public:
    // Validate (on the device) and compress a 2:4 weight W [N, K] that lives on the device.
    static Status create_from_dense(
        DType dtype, int64_t n, int64_t k, void const* d_weight, cudaStream_t stream, std::unique_ptr<SparseGemm24>* out);
    // Rebuild from export_compressed()'s bytes (host memory): same cuSPARSELt version and SM required.
    static Status create_from_compressed(
        void const* blob, size_t bytes, cudaStream_t stream, std::unique_ptr<SparseGemm24>* out);

    ~SparseGemm24();
    SparseGemm24(SparseGemm24 const&) = delete;
    SparseGemm24& operator=(SparseGemm24 const&) = delete;

    // Serialized compressed weight (a small header + cuSPARSELt's compressed matrix), host bytes.
    Status export_compressed(std::vector<uint8_t>* blob, cudaStream_t stream) const;

    // `config`: cuSPARSELt's kernel configuration, -1 for its default selection, else an id in
    // [0, algorithm_count). Plans are cached per (M, config). Who picks one times the choices: the
    // TensorRT plugin offers them as tactics (TensorRT times them at build), the benchmark tries each
    // in a child process first. (cusparseLtMatmulSearch broke the CUDA context on an H200; split-K
    // was refused with CUSPARSE_STATUS_INVALID_VALUE on an H100, so neither is used.)
    // Workspace bytes run() needs for this M (plan workspace, plus staging when M must be padded).
    Status workspace_size(int64_t m, size_t* bytes, int config = -1);
    // Y[M, N] = X[M, K] · Wᵀ on `stream`.
    Status run(void const* x, void* y, int64_t m, void* workspace, size_t workspace_bytes, cudaStream_t stream,
        int config = -1);
    // How many kernel configurations cuSPARSELt has for this M's product (ids 0 .. count - 1).
    Status algorithm_count(int64_t m, int* count);

    DType dtype() const;
    int64_t n() const;
    int64_t k() const;
    size_t compressed_bytes() const;

    struct Impl;

private:
    explicit SparseGemm24(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
};

}  // namespace sparse_gemm
}  // namespace enginesmith
