// 2:4 pattern validation (host and device) and the shape check. Needs no cuSPARSELt.
#include <string>

#include "sparse_gemm.h"

namespace enginesmith {
namespace sparse_gemm {
namespace {

// Nonzero 16-bit float (fp16 or bf16): anything but +0 / -0.
__host__ __device__ inline int nonzero16(uint16_t bits) { return (bits & 0x7fffu) != 0; }

__global__ void check_24_kernel(uint2 const* w, int64_t groups, unsigned long long* bad, unsigned long long* first) {
    for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < groups;
         g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const uint2 v = w[g];  // 4 consecutive 16-bit elements of one row
        const int nz = nonzero16(v.x & 0xffffu) + nonzero16(v.x >> 16) + nonzero16(v.y & 0xffffu) + nonzero16(v.y >> 16);
        if (nz > 2) {
            atomicAdd(bad, 1ull);
            atomicMin(first, static_cast<unsigned long long>(g));
        }
    }
}

std::string describe_group(int64_t group, int64_t k, int64_t bad) {
    const int64_t row = group / (k / 4), col = (group % (k / 4)) * 4;
    return "weight is not 2:4 sparse: row " + std::to_string(row) + ", columns " + std::to_string(col) + ".." +
           std::to_string(col + 3) + " hold more than 2 nonzeros (" + std::to_string(bad) +
           " bad groups of 4 in all); prune it with the sparsify pass (magnitude or Wanda) first";
}

// out[c][r] = in[r][c] for 16-bit elements, in [rows, cols] with row stride ld_in; 32x32 tiles.
__global__ void transpose16_kernel(uint16_t const* in, uint16_t* out, int64_t rows, int64_t cols, int64_t ld_in) {
    __shared__ uint16_t tile[32][33];
    const int64_t r0 = static_cast<int64_t>(blockIdx.y) * 32, c0 = static_cast<int64_t>(blockIdx.x) * 32;
    for (int i = threadIdx.y; i < 32; i += blockDim.y) {
        const int64_t r = r0 + i, c = c0 + threadIdx.x;
        if (r < rows && c < cols) tile[i][threadIdx.x] = in[r * ld_in + c];
    }
    __syncthreads();
    for (int i = threadIdx.y; i < 32; i += blockDim.y) {
        const int64_t c = c0 + i, r = r0 + threadIdx.x;
        if (r < rows && c < cols) out[c * rows + r] = tile[threadIdx.x][i];
    }
}

// The same with 16-byte accesses on both sides, for rows % 8 == 0, ld_in % 8 == 0 and 16-byte aligned
// pointers: a 64x64 tile per 256 threads; each thread loads two 8-element row chunks and stores two
// 8-element chunks of output rows (gathered from a shared-memory column). The unvectorized kernel
// above moved 2 bytes per access and cost about a third of a sparse product's time at M = 2048.
constexpr int kVecTile = 64;
__global__ void __launch_bounds__(256) transpose16_vec_kernel(uint4 const* in, uint4* out, int64_t rows, int64_t cols,
    int64_t ld_in) {
    __shared__ uint16_t tile[kVecTile][kVecTile + 2];  // +2: column reads of one warp spread over banks
    const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kVecTile, c0 = static_cast<int64_t>(blockIdx.x) * kVecTile;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int idx = threadIdx.x + i * 256;
        const int r = idx / 8, c = (idx % 8) * 8;
        if (r0 + r < rows && c0 + c < cols) {
            const uint4 v = in[((r0 + r) * ld_in + c0 + c) / 8];
            const uint16_t* e = reinterpret_cast<uint16_t const*>(&v);
#pragma unroll
            for (int j = 0; j < 8; ++j) tile[r][c + j] = e[j];
        }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int idx = threadIdx.x + i * 256;
        const int c = idx / 8, r = (idx % 8) * 8;  // output row c0 + c, its columns r0 + r .. + 7
        if (c0 + c < cols && r0 + r < rows) {
            uint4 v;
            uint16_t* e = reinterpret_cast<uint16_t*>(&v);
#pragma unroll
            for (int j = 0; j < 8; ++j) e[j] = tile[r + j][c];
            out[((c0 + c) * rows + r0 + r) / 8] = v;
        }
    }
}

}  // namespace

Status launch_transpose16(void const* in, void* out, int64_t rows, int64_t cols, int64_t ld_in, cudaStream_t stream) {
    const bool aligned = reinterpret_cast<uintptr_t>(in) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
    if (aligned && rows % 8 == 0 && ld_in % 8 == 0) {
        const dim3 grid(static_cast<unsigned>((cols + kVecTile - 1) / kVecTile),
            static_cast<unsigned>((rows + kVecTile - 1) / kVecTile));
        if (grid.y > 65535) return Status::Error("transpose: too many rows");
        transpose16_vec_kernel<<<grid, 256, 0, stream>>>(static_cast<uint4 const*>(in), static_cast<uint4*>(out),
            rows, cols, ld_in);
        ES_RETURN_IF_CUDA_ERROR(cudaGetLastError());
        return Status::Ok();
    }
    const dim3 grid(static_cast<unsigned>((cols + 31) / 32), static_cast<unsigned>((rows + 31) / 32));
    if (grid.y > 65535) return Status::Error("transpose: too many rows");
    transpose16_kernel<<<grid, dim3(32, 8), 0, stream>>>(
        static_cast<uint16_t const*>(in), static_cast<uint16_t*>(out), rows, cols, ld_in);
    ES_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    return Status::Ok();
}

Status check_config(DType dtype, int64_t n, int64_t k) {
    if (dtype != DType::kFloat16 && dtype != DType::kBFloat16)
        return Status::Error("sparse gemm: dtype must be float16 or bfloat16");
    if (n <= 0 || k <= 0 || n % kDimAlign != 0 || k % kDimAlign != 0)
        return Status::Error("sparse gemm: out_features (" + std::to_string(n) + ") and in_features (" +
                             std::to_string(k) + ") must be positive multiples of " + std::to_string(kDimAlign) +
                             "; keep this layer dense");
    return Status::Ok();
}

Status check_24_host(uint16_t const* w, int64_t n, int64_t k) {
    if (k % 4 != 0) return Status::Error("sparse gemm: in_features must be a multiple of 4");
    const int64_t groups = n * (k / 4);
    int64_t bad = 0, first = -1;
    for (int64_t g = 0; g < groups; ++g) {
        uint16_t const* e = w + g * 4;
        if (nonzero16(e[0]) + nonzero16(e[1]) + nonzero16(e[2]) + nonzero16(e[3]) > 2) {
            if (first < 0) first = g;
            ++bad;
        }
    }
    if (bad) return Status::Error("sparse gemm: " + describe_group(first, k, bad));
    return Status::Ok();
}

Status check_24_device(void const* w, int64_t n, int64_t k, int64_t* bad_groups, int64_t* first_bad, cudaStream_t stream) {
    if (k % 4 != 0) return Status::Error("sparse gemm: in_features must be a multiple of 4");
    if (reinterpret_cast<uintptr_t>(w) % 8 != 0) return Status::Error("sparse gemm: weight must be 8-byte aligned");
    unsigned long long* d = nullptr;
    ES_RETURN_IF_CUDA_ERROR(cudaMallocAsync(&d, 2 * sizeof(unsigned long long), stream));
    const unsigned long long init[2] = {0ull, ~0ull};
    Status st = cudaStatus(cudaMemcpyAsync(d, init, sizeof(init), cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
    const int64_t groups = n * (k / 4);
    unsigned long long host[2] = {0, 0};
    if (st.ok) {
        const int blocks = static_cast<int>(std::min<int64_t>((groups + 255) / 256, 4096));
        check_24_kernel<<<blocks, 256, 0, stream>>>(static_cast<uint2 const*>(w), groups, d, d + 1);
        st = cudaStatus(cudaGetLastError(), "check_24_kernel");
    }
    if (st.ok) st = cudaStatus(cudaMemcpyAsync(host, d, sizeof(host), cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
    cudaFreeAsync(d, stream);
    if (st.ok) st = cudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    if (!st.ok) return st;
    if (bad_groups) *bad_groups = static_cast<int64_t>(host[0]);
    if (first_bad) *first_bad = host[0] ? static_cast<int64_t>(host[1]) : -1;
    if (host[0]) return Status::Error("sparse gemm: " + describe_group(static_cast<int64_t>(host[1]), k, host[0]));
    return Status::Ok();
}

}  // namespace sparse_gemm
}  // namespace enginesmith
