// One instantiation group of the dense attention op's decode kernel (attention_decode.h): KV format
// ES_INSTANCE_KV, head size ES_INSTANCE_D, the options variant or the plain one (ES_INSTANCE_OPTIONS 1 / 0).
// CMakeLists.txt compiles this file once per group.
#include "attention_decode.cuh"

#if !defined(ES_INSTANCE_KV) || !defined(ES_INSTANCE_D) || !defined(ES_INSTANCE_OPTIONS)
#error "ES_INSTANCE_KV, ES_INSTANCE_D and ES_INSTANCE_OPTIONS name the group: build with plugins/CMakeLists.txt"
#endif

namespace enginesmith {
namespace attention_decode {

template cudaError_t launch<KvFormat::ES_INSTANCE_KV, ES_INSTANCE_D, bool(ES_INSTANCE_OPTIONS)>(
    const AttentionProblem&, const AttentionPlan&, float*, int32_t*, cudaStream_t);

}  // namespace attention_decode
}  // namespace enginesmith
