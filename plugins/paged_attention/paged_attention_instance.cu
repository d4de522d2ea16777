// One group of paged attention's split kernel (paged_attention_table.h): compute dtype ES_INSTANCE_T,
// KV format ES_INSTANCE_KV, head size ES_INSTANCE_D, block size ES_INSTANCE_BS. CMakeLists.txt
// compiles this file once per group.
#include <type_traits>

#include "../common/plain_variants.h"
#include "paged_attention_kernels.cuh"
#include "paged_attention_table.h"

#if !defined(ES_INSTANCE_T) || !defined(ES_INSTANCE_KV) || !defined(ES_INSTANCE_D) || !defined(ES_INSTANCE_BS)
#error "ES_INSTANCE_T, ES_INSTANCE_KV, ES_INSTANCE_D and ES_INSTANCE_BS name the group: build with plugins/CMakeLists.txt"
#endif

namespace enginesmith {
namespace paged_attention {
namespace {

template <typename T, int D, int BS, KvFormat KV, int kMT, bool kExt>
Variant make_variant() {
    static std::atomic<bool> configured{false};
    return Variant{&detail::paged_attention_kernel<T, D, BS, kMT, KV, kExt>, detail::smem_bytes<T, D, kMT, KV>(),
        &configured};
}

// The options variants (kExt: soft-capping, windows, read at run time) serve every call; with
// ES_PAGED_PLAIN_VARIANTS (common/plain_variants.h) calls without options take the plain ones.
template <typename T, int D, int BS, KvFormat KV>
Entry make_entry() {
    static std::atomic<int> slots{0};
    constexpr DType dtype = std::is_same<T, __half>::value ? DType::kFloat16 : DType::kBFloat16;
    const Variant single_ext = make_variant<T, D, BS, KV, 1, true>();
    const Variant multi_ext = make_variant<T, D, BS, KV, kMultiTiles, true>();
#if ES_PAGED_PLAIN_VARIANTS
    return Entry{dtype, KV, D, BS, make_variant<T, D, BS, KV, 1, false>(),
        make_variant<T, D, BS, KV, kMultiTiles, false>(), single_ext, multi_ext, &slots};
#else
    return Entry{dtype, KV, D, BS, single_ext, multi_ext, single_ext, multi_ext, &slots};
#endif
}

}  // namespace

template <typename T, KvFormat KV, int D, int BS>
Entry const* entry() {
    static Entry const kEntry = make_entry<T, D, BS, KV>();
    return &kEntry;
}

template Entry const* entry<ES_INSTANCE_T, KvFormat::ES_INSTANCE_KV, ES_INSTANCE_D, ES_INSTANCE_BS>();

}  // namespace paged_attention
}  // namespace enginesmith
