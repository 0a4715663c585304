// The CPU reference attention: exact semantics of every mask, GQA, any length, strides and LSE.
// It is the CPU backend's compute and the oracle of every test.
#pragma once

#include <cstdint>

#include "attnd/problem.h"

namespace attnd {

struct ReferenceOptions {
  int num_threads = 0;  // 0: std::thread::hardware_concurrency()
};

// Inputs and O are 16-bit elements of p.dtype laid out as `layout` says; lse (if p.want_lse) is fp32
// [batch, q_heads, q_len], natural log. Scores, softmax and P.V accumulate in fp32; O is rounded once.
// The caller validates the problem (shape > 0, q_heads % kv_heads == 0); nothing is checked here.
void ReferenceAttention(const Problem& p, const Layout& layout, const uint16_t* q, const uint16_t* k,
                        const uint16_t* v, uint16_t* o, float* lse, const ReferenceOptions& opts = {});

// Float8 problems (p.dtype DType::kFP8E4M3): q, k and v hold e4m3 codes (attnd/fp8.h) and element x of head h is
// read as Fp8E4M3ToFloat(x) * that tensor's descale[h], with q_heads values in `q` and kv_heads in `k` and `v`. O is
// bf16 (OutputDType), the accumulation fp32 and the rounding of O once, as ReferenceAttention's.
struct Fp8Descales {
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
};
void ReferenceAttentionFp8(const Problem& p, const Layout& layout, const uint8_t* q, const uint8_t* k,
                           const uint8_t* v, const Fp8Descales& descales, uint16_t* o, float* lse,
                           const ReferenceOptions& opts = {});

// ReferenceAttention computed entirely in double, O unrounded and contiguous [batch, q_len, q_heads, head_dim];
// for measuring the error of the fp32 reference and of the GPU kernels.
void ReferenceAttentionF64(const Problem& p, const Layout& layout, const uint16_t* q, const uint16_t* k,
                           const uint16_t* v, double* o, double* lse, const ReferenceOptions& opts = {});

// ReferenceAttentionFp8 computed entirely in double (the descaled inputs exact), O unrounded and contiguous.
void ReferenceAttentionFp8F64(const Problem& p, const Layout& layout, const uint8_t* q, const uint8_t* k,
                              const uint8_t* v, const Fp8Descales& descales, double* o, double* lse,
                              const ReferenceOptions& opts = {});

}  // namespace attnd
