// Paged attention's dispatch table (layer 3 of 4), shared by the dispatch (paged_attention.cu) and
// the kernel groups (paged_attention_instance.cu).
//
// The split kernel is compiled in groups, one translation unit per (compute dtype, KV format, head
// size, block size): CMakeLists.txt compiles paged_attention_instance.cu once per group with
// ES_INSTANCE_T / ES_INSTANCE_KV / ES_INSTANCE_D / ES_INSTANCE_BS, so a build uses every core. Each
// group holds one Entry; the dispatch (paged_attention.cu, groups()) lists the (dtype, KV format) pairs
// that CMakeLists.txt compiles, for every head and block size of limits.json.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <cstddef>

#include "../common/plain_variants.h"
#include "paged_attention.h"

namespace enginesmith {
namespace paged_attention {

using KernelFn = void (*)(Params, int);

// One split kernel variant: rows per block (block_rows) and its dynamic shared memory.
struct Variant {
    KernelFn kernel;
    size_t smem;
    std::atomic<bool>* smem_configured;
};

struct Entry {
    DType dtype;
    KvFormat kv_format;
    int head_size;
    int block_size;
    Variant single_tile;  // G * Sq <= kRowsPerCta, without options (ES_PAGED_PLAIN_VARIANTS; else = single_ext)
    Variant multi_tile;   // G * Sq > kRowsPerCta: kMultiTiles row tiles per block (likewise)
    Variant single_ext;   // the same reading soft-capping / a window at run time (kExt)
    Variant multi_ext;
    std::atomic<int>* slots;  // cached resident_slots (0 = not yet asked)

    Variant const& variant(int rows, bool ext = false) const {
        const bool multi = block_rows(rows) > kRowsPerCta;
        ext = ext || options_kernel_forced();
        return ext ? (multi ? multi_ext : single_ext) : (multi ? multi_tile : single_tile);
    }
};

// The entry of group (T, KV, D, BS): defined in paged_attention_instance.cu, instantiated once per group.
template <typename T, KvFormat KV, int D, int BS>
Entry const* entry();

}  // namespace paged_attention
}  // namespace enginesmith
