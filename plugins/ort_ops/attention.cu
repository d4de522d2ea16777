// The dense attention op's host side: argument checks, the launch plan, the dispatch to the decode
// kernel's instantiation groups (attention_decode.h) or the tensor-core prompt path
// (attention_prefill.h), and the CPU reference.
#include "attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "../common/plain_variants.h"
#include "attention_decode.h"
#include "attention_prefill.h"
#include "rotary.cuh"

namespace enginesmith {
namespace {

using attention_decode::kMaxSplits;
using attention_decode::max_rows;
using attention_decode::min_keys_per_split;

// The plain variant unless the call has options (or ES_OPTIONS_KERNEL=1; common/plain_variants.h).
template <KvFormat KV, int D>
cudaError_t launch_group(const AttentionProblem& p, const AttentionPlan& plan, float* partials, int32_t* counters,
                         cudaStream_t stream) {
#if ES_PLAIN_VARIANTS
  if (p.softcap <= 0.f && p.window <= 0 && !options_kernel_forced())
    return attention_decode::launch<KV, D, false>(p, plan, partials, counters, stream);
#endif
  return attention_decode::launch<KV, D, true>(p, plan, partials, counters, stream);
}

template <KvFormat KV>
cudaError_t launch_format(const AttentionProblem& p, const AttentionPlan& plan, float* partials, int32_t* counters,
                          cudaStream_t stream) {
  switch (p.D) {  // attention_check: 64, 128 or 256
    case 64: return launch_group<KV, 64>(p, plan, partials, counters, stream);
    case 128: return launch_group<KV, 128>(p, plan, partials, counters, stream);
    default: return launch_group<KV, 256>(p, plan, partials, counters, stream);
  }
}

}  // namespace

const char* attention_check(const AttentionProblem& p) {
  if (p.B <= 0 || p.S <= 0 || p.H <= 0 || p.Hkv <= 0 || p.C <= 0 || p.P <= 0) return "empty or negative dimension";
  if (p.D != 64 && p.D != 128 && p.D != 256) return "head size must be 64, 128 or 256";
  if (p.H % p.Hkv != 0) return "num_heads must be a multiple of kv_num_heads";
  if (p.H / p.Hkv > 16) return "at most 16 query heads per KV head";
  if (p.D == 256 && p.H / p.Hkv > max_rows(256)) return "at most 8 query heads per KV head at head size 256";
  if (!(p.softcap >= 0.f) || !std::isfinite(p.softcap)) return "softcap must be >= 0 (0: off)";
  if (p.window == 0 || p.window < -1) return "local_window_size must be positive, or -1 (off)";
  if (!(p.scale > 0.f) || !std::isfinite(p.scale)) return "scale must be positive";
  if (p.max_total < 1 || p.max_total > p.C) return "total_sequence_length must be in [1, the cache capacity]";
  if (kv_quantized(p.kv) && p.kv_scale == nullptr) return "quantized caches need kv_scale [2, kv_num_heads, head_size]";
  for (const void* ptr : {static_cast<const void*>(p.qkv), static_cast<const void*>(p.k_cache),
                          static_cast<const void*>(p.v_cache), static_cast<const void*>(p.cos),
                          static_cast<const void*>(p.sin)})
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return "qkv, caches and rotary tables must be 16-byte aligned";
  return "";
}

AttentionPlan attention_plan(const AttentionProblem& p, int sms) {
  AttentionPlan plan;
  if (prefill_applies(p)) {
    plan.prefill = true;
    return plan;
  }
  const int G = p.H / p.Hkv;
  // the fewest rows that hold the group; for prompts more (several tokens share each K/V read), as
  // registers allow (head size 128 spills at 16)
  const int fit = G <= 4 ? 4 : G <= 8 ? 8 : 16;
  plan.rows_max = p.S == 1 ? fit : std::max(fit, p.D == 64 ? 16 : 8);
  plan.tile_tokens = std::max(1, std::min(plan.rows_max / G, p.S));
  plan.tiles = (p.S + plan.tile_tokens - 1) / plan.tile_tokens;
  const long triples = long(p.B) * plan.tiles * p.Hkv;
  if (triples < sms) {  // too few blocks to fill the GPU: split the keys
    const int min_keys = min_keys_per_split(p.D, plan.rows_max);
    // a block reads at most its tile's window of keys
    const int keys = p.window > 0 ? std::min(p.max_total, p.window + plan.tile_tokens - 1) : p.max_total;
    const int by_keys = (keys + min_keys - 1) / min_keys;
    const int by_gpu = int((2L * sms + triples - 1) / triples);
    plan.splits = std::max(1, std::min({kMaxSplits, by_keys, by_gpu}));
  }
  if (plan.splits > 1) {
    plan.partial_floats = size_t(triples) * plan.splits * plan.rows_max * (p.D + 2);
    plan.counters = size_t(triples);
  }
  return plan;
}

cudaError_t attention_launch(const AttentionProblem& p, const AttentionPlan& plan, float* partials,
                             int32_t* counters, cudaStream_t stream) {
  if (plan.prefill) return attention_prefill_launch(p, plan.dependent, stream);
  switch (p.kv) {
    case KvFormat::kInt8: return launch_format<KvFormat::kInt8>(p, plan, partials, counters, stream);
    case KvFormat::kFp8E4M3: return launch_format<KvFormat::kFp8E4M3>(p, plan, partials, counters, stream);
    default: return launch_format<KvFormat::kNative>(p, plan, partials, counters, stream);
  }
}

void attention_reference(const AttentionProblem& p) {
  const int G = p.H / p.Hkv, D = p.D, HALF = D / 2, stride = (p.H + 2 * p.Hkv) * D;
  auto f = [](const __half& h) { return __half2float(h); };
  std::vector<float> q(D), score;
  // The caches' element `at` (KV head g, dimension d): stored from an fp16-exact value (fp16 caches: it,
  // quantized: its code, kv_quant.h) and read back as a value (code * scale). `which` 0: K, 1: V.
  auto put = [&](void* cache, size_t at, int which, int g, int d, float value) {
    const float s = kv_quantized(p.kv) ? p.kv_scale[(size_t(which) * p.Hkv + g) * D + d] : 0.f;
    if (p.kv == KvFormat::kInt8)
      static_cast<uint8_t*>(cache)[at] = kv_encode<KvFormat::kInt8>(value, s);
    else if (p.kv == KvFormat::kFp8E4M3)
      static_cast<uint8_t*>(cache)[at] = kv_encode<KvFormat::kFp8E4M3>(value, s);
    else
      static_cast<__half*>(cache)[at] = __float2half_rn(value);
  };
  auto get = [&](const void* cache, size_t at, int which, int g, int d) {
    if (p.kv == KvFormat::kNative) return f(static_cast<const __half*>(cache)[at]);
    const float s = p.kv_scale[(size_t(which) * p.Hkv + g) * D + d];
    const uint8_t code = static_cast<const uint8_t*>(cache)[at];
    return (p.kv == KvFormat::kInt8 ? kv_decode<KvFormat::kInt8>(code) : kv_decode<KvFormat::kFp8E4M3>(code)) * s;
  };
  for (int b = 0; b < p.B; ++b) {
    const int total = p.seqlens[b] + 1, past = total - p.S;
    const __half* tok = p.qkv + size_t(b) * p.S * stride;
    __half* out = p.out + size_t(b) * p.S * p.H * D;
    if (past < 0 || total > p.C || total > p.P) {
      std::fill(out, out + size_t(p.S) * p.H * D, __float2half(NAN));
      continue;
    }
    for (int s = 0; s < p.S; ++s) {  // the new keys (rotated) and values into the cache
      const int pos = past + s;
      for (int g = 0; g < p.Hkv; ++g) {
        const __half* k = tok + size_t(s) * stride + (p.H + g) * D;
        const __half* v = k + p.Hkv * D;
        const size_t at = ((size_t(b) * p.Hkv + g) * p.C + pos) * D;
        for (int d = 0; d < HALF; ++d) {
          float y1, y2;
          rotate(f(k[d]), f(k[d + HALF]), f(p.cos[size_t(pos) * HALF + d]), f(p.sin[size_t(pos) * HALF + d]), y1, y2);
          put(p.k_cache, at + d, 0, g, d, y1);  // y1, y2 are fp16-exact (rotate rounds)
          put(p.k_cache, at + d + HALF, 0, g, d + HALF, y2);
          put(p.v_cache, at + d, 1, g, d, f(v[d]));
          put(p.v_cache, at + d + HALF, 1, g, d + HALF, f(v[d + HALF]));
        }
      }
    }
    for (int s = 0; s < p.S; ++s) {
      const int pos = past + s;
      for (int h = 0; h < p.H; ++h) {
        const int g = h / G;
        const __half* qh = tok + size_t(s) * stride + h * D;
        for (int d = 0; d < HALF; ++d)
          rotate(f(qh[d]), f(qh[d + HALF]), f(p.cos[size_t(pos) * HALF + d]), f(p.sin[size_t(pos) * HALF + d]), q[d],
                 q[d + HALF]);
        const size_t c0 = (size_t(b) * p.Hkv + g) * p.C * D;
        const int first = p.window > 0 ? std::max(0, pos - p.window + 1) : 0;  // keys first .. pos
        score.assign(pos + 1 - first, 0.f);
        float mx = -INFINITY;
        for (int j = first; j <= pos; ++j) {
          float dot = 0.f;
          for (int d = 0; d < D; ++d) dot += q[d] * get(p.k_cache, c0 + size_t(j) * D + d, 0, g, d);
          float sj = dot * p.scale;
          if (p.softcap > 0.f) sj = p.softcap * std::tanh(sj / p.softcap);
          score[j - first] = sj;
          mx = std::max(mx, sj);
        }
        float sum = 0.f;
        for (float& sj : score) sum += (sj = std::exp(sj - mx));
        for (int d = 0; d < D; ++d) {
          float acc = 0.f;
          for (int j = first; j <= pos; ++j) acc += score[j - first] * get(p.v_cache, c0 + size_t(j) * D + d, 1, g, d);
          out[(size_t(s) * p.H + h) * D + d] = __float2half_rn(acc / sum);
        }
      }
    }
  }
}

}  // namespace enginesmith
