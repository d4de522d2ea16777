// One instantiation group of the dense attention op's decode kernel (attention_decode.h): KV format
// ES_INSTANCE_KV, head size ES_INSTANCE_D. CMakeLists.txt compiles this file once per group.
#include "attention_decode.cuh"

#if !defined(ES_INSTANCE_KV) || !defined(ES_INSTANCE_D)
#error "ES_INSTANCE_KV and ES_INSTANCE_D name the group: build with plugins/CMakeLists.txt"
#endif

namespace enginesmith {
namespace attention_decode {

template cudaError_t launch<KvFormat::ES_INSTANCE_KV, ES_INSTANCE_D>(const AttentionProblem&, const AttentionPlan&,
                                                                      float*, int32_t*, cudaStream_t);

}  // namespace attention_decode
}  // namespace enginesmith
