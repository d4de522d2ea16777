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

}  // namespace

Status launch_transpose16(void const* in, void* out, int64_t rows, int64_t cols, int64_t ld_in, cudaStream_t stream) {
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
