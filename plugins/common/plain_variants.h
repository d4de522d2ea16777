// Attention kernels and their options (soft-capping, sliding windows). Each kernel group compiles a
// variant that reads the options at run time (uniform branches, skipped when off) and, with
// ES_PLAIN_VARIANTS=1 (CMake option ENGINESMITH_PLAIN_VARIANTS, default ON), a plain one, the options
// compiled away, that serves every call without options.
//
// Why both, measured on an H200 (benchmarks/device/options_cost.sh, 2026-11-27, two rounds, GPU time per
// call): the options variant costs the dense op's decode kernel 7-15 % at batch 1 (7.6 -> 8.8 us at 300
// past tokens, 13.2 -> 14.1 at 3000, 14.0 -> 15.3 at 7000) and the paged kernel 3-5 % at batch 1 (1k:
// 6.1 -> 6.3 us, 8k: 11.2 -> 11.5), under 0.5 % at batch 16. The plain variants double the kernels and
// the compile time: OFF is for test builds on machines without a GPU (nothing runs the kernels there).
// In a build with them, ES_OPTIONS_KERNEL=1 in the environment sends every call to the options variant,
// so one process times both.
#pragma once

#include <cstdlib>
#include <cstring>

#ifndef ES_PLAIN_VARIANTS
#define ES_PLAIN_VARIANTS 0
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
