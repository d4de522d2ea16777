// One group of paged attention's split kernel (paged_attention_table.h): compute dtype ES_INSTANCE_T,
// KV format ES_INSTANCE_KV, head size ES_INSTANCE_D, every supported block size. CMakeLists.txt
// compiles this file once per group.
#include <iterator>
#include <type_traits>
#include <utility>

#include "../common/plain_variants.h"
#include "paged_attention_kernels.cuh"
#include "paged_attention_table.h"

#if !defined(ES_INSTANCE_T) || !defined(ES_INSTANCE_KV) || !defined(ES_INSTANCE_D)
#error "ES_INSTANCE_T, ES_INSTANCE_KV and ES_INSTANCE_D name the group: build with plugins/CMakeLists.txt"
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
// ES_PLAIN_VARIANTS (common/plain_variants.h) calls without options take the plain ones.
template <typename T, int D, int BS, KvFormat KV>
Entry make_entry() {
    static std::atomic<int> slots{0};
    constexpr DType dtype = std::is_same<T, __half>::value ? DType::kFloat16 : DType::kBFloat16;
    const Variant single_ext = make_variant<T, D, BS, KV, 1, true>();
    const Variant multi_ext = make_variant<T, D, BS, KV, kMultiTiles, true>();
#if ES_PLAIN_VARIANTS
    return Entry{dtype, KV, D, BS, make_variant<T, D, BS, KV, 1, false>(),
        make_variant<T, D, BS, KV, kMultiTiles, false>(), single_ext, multi_ext, &slots};
#else
    return Entry{dtype, KV, D, BS, single_ext, multi_ext, single_ext, multi_ext, &slots};
#endif
}

template <typename T, KvFormat KV, int D, size_t... I>
Group make_group(std::index_sequence<I...>) {
    static Entry const kEntries[] = {make_entry<T, D, kSupportedBlockSizes[I], KV>()...};
    return Group{kEntries, static_cast<int>(sizeof...(I))};
}

}  // namespace

template <typename T, KvFormat KV, int D>
Group group() {
    return make_group<T, KV, D>(std::make_index_sequence<std::size(kSupportedBlockSizes)>{});
}

template Group group<ES_INSTANCE_T, KvFormat::ES_INSTANCE_KV, ES_INSTANCE_D>();

}  // namespace paged_attention
}  // namespace enginesmith
