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

// The same function computed entirely in double, O unrounded and contiguous [batch, q_len, q_heads, head_dim];
// for measuring the error of the fp32 reference and of the GPU kernels.
void ReferenceAttentionF64(const Problem& p, const Layout& layout, const uint16_t* q, const uint16_t* k,
                           const uint16_t* v, double* o, double* lse, const ReferenceOptions& opts = {});

}  // namespace attnd
