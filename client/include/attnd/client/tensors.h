// Host-side tensor helpers of the CLI and the tests: seeded random inputs (16-bit, and float8 with their descales),
// raw files, and the oracle that checks a server's answer against a double-precision reference with a bf16-fit
// error bound.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnd/problem.h"

namespace attnd::client {

struct SequenceShape;  // attnd/client/client.h
struct RequestSpec;    // attnd/client/client.h

// `elems` elements of `dtype` drawn from N(0, 1) with `seed` (deterministic for a given seed), as raw
// little-endian bytes. Random, never constant: a kernel that ignores part of its input must show up.
std::string RandomTensor(DType dtype, int64_t elems, uint64_t seed);

// `elems` elements of a [.., heads, head_dim] tensor drawn from N(0, 1) with `seed`, as float8 e4m3 codes of
// x / descale[h] (ForwardRequest.q_descale's meaning). `descale` holds 1 value or one per head; when empty it is set
// to one value, the drawn values' amax / 448, so that the largest lands on the largest code. Any other count is the
// caller's error (DescalesPerHead checks one).
std::string RandomFp8Tensor(int64_t elems, int64_t heads, int64_t head_dim, uint64_t seed, std::vector<float>* descale);

// Descales as a request gives them (1 value or one per head) spread to one per head; INVALID_ARGUMENT naming
// `field` for any other count.
absl::StatusOr<std::vector<float>> DescalesPerHead(const std::string& field, const std::vector<float>& given,
                                                   int64_t heads);

// K or V rows as a sequence's cache gives them back to every step's attention: the history a client that verifies
// the steps keeps. `rows` ([n, kv_heads, head_dim] of shape.dtype, appended at `layer`) come back unchanged from a
// 16-bit cache; from a float8 one each element x of kv head h comes back as Fp8E4M3ToFloat(FloatToFp8E4M3(x / d))
// x d rounded to the dtype, d = shape.DescaleAt(descale, layer, h), as the server stores and reads it. `descale`:
// shape.k_descale for K rows, shape.v_descale for V rows.
std::string CachedRows(const SequenceShape& shape, const std::vector<float>& descale, int64_t layer,
                       std::string rows);

// The whole file, which must hold exactly `expected_bytes` bytes (the shape's size).
absl::StatusOr<std::string> ReadTensorFile(const std::string& path, uint64_t expected_bytes);
absl::Status WriteFile(const std::string& path, const std::string& bytes);

// The result of checking one answer.
struct VerifyReport {
  double max_abs_err = 0;      // max |O - O_f64| over all elements
  double rel_l2_err = 0;       // ||O - O_f64||_2 / ||O_f64||_2
  double lse_max_abs_err = 0;  // max |LSE - LSE_f64| over finite rows (when LSE was asked for)
  // The same measures for the plain reference (fp32 accumulation, O rounded once to the dtype): the error
  // any correct 16-bit implementation is expected to be within a small factor of.
  double ref_max_abs_err = 0, ref_rel_l2_err = 0, ref_lse_max_abs_err = 0;
  double bound_max_abs = 0, bound_rel_l2 = 0, bound_lse = 0;
  int64_t bad_values = 0;  // NaN/inf in O, or LSE finite where it must be -inf (or the reverse)
  bool pass = false;
  std::string detail;  // why it failed
};

// The reference answer of one problem and its inputs, computed once and then used to check any number of
// replies (a load test verifies many responses to the same inputs).
class Oracle {
 public:
  // q, k, v: contiguous inline bytes of p's shape. Runs the double-precision and the fp32 reference. A float8
  // problem needs its descales: INVALID_ARGUMENT here, use the RequestSpec overload.
  static absl::StatusOr<Oracle> Compute(const Problem& p, const std::string& q, const std::string& k,
                                        const std::string& v, int num_threads = 0);
  // The request's problem, with its descales when its dtype is float8 (the references then read the dequantized
  // inputs, and O is bf16).
  static absl::StatusOr<Oracle> Compute(const RequestSpec& spec, const std::string& q, const std::string& k,
                                        const std::string& v, int num_threads = 0);

  // Error bound: FA3's rule, |err| <= 2 x (error of the plain reference) + atol, with atol twice the dtype's
  // rounding step near 0.3 (the magnitude of typical outputs).
  VerifyReport Check(std::string_view o, std::string_view lse) const;

  const Problem& problem() const { return problem_; }

 private:
  // Float8 problems: the descales one per head (q_heads, kv_heads, kv_heads); empty for 16-bit ones.
  struct Descales {
    std::vector<float> q, k, v;
  };
  static absl::StatusOr<Oracle> Run(const Problem& p, const std::string& q, const std::string& k,
                                    const std::string& v, const Descales& descales, int num_threads);

  Problem problem_;
  std::vector<double> o64_, lse64_;
  double ref_max_abs_ = 0, ref_rel_l2_ = 0, ref_lse_ = 0;
  // Float8 inputs: what the GPU kernel adds to the reference's error (P rounded to e4m3 before P V, the float8
  // accumulation of S); 0 for 16-bit inputs. See Fp8Slack in tensors.cc.
  double fp8_o_slack_ = 0, fp8_rel_l2_slack_ = 0, fp8_lse_slack_ = 0;
};

}  // namespace attnd::client
