// Attention kernels and their options (soft-capping, sliding windows): one compiled variant reads the
// options at run time (uniform branches, skipped when off), so every kernel group compiles once.
//
// ES_PLAIN_VARIANTS=1 (CMake option ENGINESMITH_PLAIN_VARIANTS, default OFF) also compiles each
// kernel's plain variant, the options compiled away, and uses it for calls without options: twice the
// kernels and the compile time. It exists to measure what the run-time options cost: in such a build,
// ES_OPTIONS_KERNEL=1 in the environment sends every call to the options variant, so one process
// times both (benchmarks/device/verify.sh).
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
