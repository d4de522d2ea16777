// Attention kernels and their options (soft-capping, sliding windows). Each kernel group compiles a
// variant that reads the options at run time (uniform branches, skipped when off); where that was
// measured slower, also a plain one, the options compiled away, for every call without options.
//
// Measured on an H200 (benchmarks/device/options_cost.sh, 2026-11-27, two rounds, GPU time per call):
//   the dense op's decode kernel (batch-1 decode): options variant 7-15 % slower (7.6 -> 8.8 us at 300
//     past tokens, 13.2 -> 14.1 at 3000, 14.0 -> 15.3 at 7000): its plain variants are compiled
//     (ES_PLAIN_VARIANTS, CMake ENGINESMITH_PLAIN_VARIANTS=dense, the default);
//   the paged kernel (serving, batched): 0.3 us at batch 1 (1k: 6.1 -> 6.3 us, 8k: 11.2 -> 11.5), under
//     0.5 % at batch 16: the options variant serves every call (its plain variants, twice the paged
//     kernels, only with ENGINESMITH_PLAIN_VARIANTS=all: ES_PAGED_PLAIN_VARIANTS).
// ENGINESMITH_PLAIN_VARIANTS=none compiles no plain variant: test builds on machines without a GPU.
// In a build with plain variants, ES_OPTIONS_KERNEL=1 in the environment sends every call to the options
// variant, so one process times both.
#pragma once

#include <cstdlib>
#include <cstring>

#ifndef ES_PLAIN_VARIANTS
#define ES_PLAIN_VARIANTS 0
#endif
#ifndef ES_PAGED_PLAIN_VARIANTS
#define ES_PAGED_PLAIN_VARIANTS 0
#endif

namespace enginesmith {

// ES_OPTIONS_KERNEL=1: calls without options still take the options variant (read once per process).
inline bool options_kernel_forced() {
    static const bool forced = [] {
        const char* env = std::getenv("ES_OPTIONS_KERNEL");
        return env != nullptr && std::strcmp(env, "1") == 0;
    }();
    return forced;
}

}  // namespace enginesmith
