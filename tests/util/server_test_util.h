// Helpers shared by the validation and server tests: random requests, the expected answer from the CPU
// reference, and an in-process server on a loopback port.
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "attnd/half.h"
#include "attnd/problem.h"
#include "attnd/reference.h"
#include "fp8_attention_util.h"
#include "attnd/server/cpu_backend.h"
#include "attnd/server/server.h"
#include "attnd/v1/attention.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace attnd::testing {

inline std::string RandomTensor(int64_t elems, DType t, std::mt19937_64& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::string out(static_cast<size_t>(elems) * 2, '\0');
  for (int64_t i = 0; i < elems; ++i) {
    const uint16_t h = FloatToHalf(t, dist(rng));
    std::memcpy(&out[i * 2], &h, 2);
  }
  return out;
}

// The request's shape fields from s.
inline void SetShape(const Shape& s, v1::AttentionShape* sh) {
  sh->set_batch(s.batch);
  sh->set_q_len(s.q_len);
  sh->set_kv_len(s.kv_len);
  sh->set_q_heads(s.q_heads);
  sh->set_kv_heads(s.kv_heads);
  sh->set_head_dim(s.head_dim);
}

inline v1::ForwardRequest MakeRequest(const Shape& s, v1::MaskType mask = v1::MASK_TYPE_NONE, bool lse = false,
                                      uint64_t seed = 1, v1::Dtype dtype = v1::DTYPE_BF16) {
  std::mt19937_64 rng(seed);
  v1::ForwardRequest r;
  r.set_request_id("req-" + std::to_string(seed));
  SetShape(s, r.mutable_shape());
  r.set_dtype(dtype);
  r.set_mask(mask);
  r.set_return_lse(lse);
  const DType t = dtype == v1::DTYPE_FP16 ? DType::kFP16 : DType::kBF16;
  r.mutable_q()->set_data(RandomTensor(QElems(s), t, rng));
  r.mutable_k()->set_data(RandomTensor(KVElems(s), t, rng));
  r.mutable_v()->set_data(RandomTensor(KVElems(s), t, rng));
  return r;
}

// A float8 request (inline e4m3 codes, one descale per head) over test_util::RandomFp8Tensors' data.
inline v1::ForwardRequest MakeFp8Request(const Shape& s, v1::MaskType mask = v1::MASK_TYPE_NONE, bool lse = false,
                                         uint64_t seed = 1, test_util::Fp8Data data = test_util::Fp8Data::kPlain) {
  v1::ForwardRequest r;
  r.set_request_id("req-fp8-" + std::to_string(seed));
  SetShape(s, r.mutable_shape());
  r.set_dtype(v1::DTYPE_FP8_E4M3);
  r.set_mask(mask);
  r.set_return_lse(lse);
  const test_util::Fp8Tensors t = test_util::RandomFp8Tensors(s, data, seed);
  r.mutable_q()->set_data(t.q_bytes());
  r.mutable_k()->set_data(t.k_bytes());
  r.mutable_v()->set_data(t.v_bytes());
  r.mutable_q_descale()->Add(t.q_descale.begin(), t.q_descale.end());
  r.mutable_k_descale()->Add(t.k_descale.begin(), t.k_descale.end());
  r.mutable_v_descale()->Add(t.v_descale.begin(), t.v_descale.end());
  return r;
}

inline Problem ProblemOf(const v1::ForwardRequest& r) {
  Problem p;
  const auto& sh = r.shape();
  p.shape = Shape{sh.batch(), sh.q_len(), sh.kv_len(), sh.q_heads(), sh.kv_heads(), sh.head_dim()};
  p.dtype = r.dtype() == v1::DTYPE_FP16       ? DType::kFP16
            : r.dtype() == v1::DTYPE_FP8_E4M3 ? DType::kFP8E4M3
                                              : DType::kBF16;
  p.mask = r.mask() == v1::MASK_TYPE_CAUSAL_TOP_LEFT       ? Mask::kCausalTopLeft
           : r.mask() == v1::MASK_TYPE_CAUSAL_BOTTOM_RIGHT ? Mask::kCausalBottomRight
                                                           : Mask::kNone;
  p.scale = r.has_softmax_scale() ? r.softmax_scale() : DefaultScale(sh.head_dim());
  p.want_lse = r.return_lse();
  return p;
}

// Checks O (and LSE) bytes returned by the server against the double-precision reference with bf16-fit
// bounds (one rounding of the output plus fp32 accumulation), and bit-for-bit against the fp32 reference
// the CPU backend runs.
// A float8 request's inputs as the reference takes them: its codes, and its descales one per head.
inline test_util::Fp8Tensors Fp8TensorsOf(const v1::ForwardRequest& r) {
  test_util::Fp8Tensors t;
  t.q.assign(r.q().data().begin(), r.q().data().end());
  t.k.assign(r.k().data().begin(), r.k().data().end());
  t.v.assign(r.v().data().begin(), r.v().data().end());
  const auto per_head = [](const google::protobuf::RepeatedField<float>& given, int64_t heads) {
    return given.size() == 1 ? std::vector<float>(static_cast<size_t>(heads), given[0])
                             : std::vector<float>(given.begin(), given.end());
  };
  t.q_descale = per_head(r.q_descale(), r.shape().q_heads());
  t.k_descale = per_head(r.k_descale(), r.shape().kv_heads());
  t.v_descale = per_head(r.v_descale(), r.shape().kv_heads());
  return t;
}

// A float8 request's O (bf16) and LSE against the float64 attention over its dequantized inputs, and bit for bit
// against the fp32 reference the CPU backend runs.
inline void ExpectCorrectFp8(const v1::ForwardRequest& r, const std::string& o, const std::string& lse) {
  const Problem p = ProblemOf(r);
  const test_util::Fp8Tensors t = Fp8TensorsOf(r);
  test_util::ExpectMatchesNaiveFp8(p, t, o, lse);
  std::string o32(o.size(), '\x5a');  // poisoned
  ReferenceAttentionFp8(p, ContiguousLayout(p.shape), t.q.data(), t.k.data(), t.v.data(),
                        {t.q_descale.data(), t.k_descale.data(), t.v_descale.data()},
                        reinterpret_cast<uint16_t*>(o32.data()), nullptr);
  ASSERT_TRUE(o32 == o) << "O differs from the fp32 reference";
}

inline void ExpectCorrect(const v1::ForwardRequest& r, const std::string& o, const std::string& lse) {
  if (r.dtype() == v1::DTYPE_FP8_E4M3) return ExpectCorrectFp8(r, o, lse);
  const Problem p = ProblemOf(r);
  const Shape& s = p.shape;
  ASSERT_EQ(o.size(), static_cast<size_t>(QElems(s)) * 2);
  ASSERT_EQ(lse.size(), p.want_lse ? static_cast<size_t>(LseElems(s)) * 4 : 0u);
  const auto* q = reinterpret_cast<const uint16_t*>(r.q().data().data());
  const auto* k = reinterpret_cast<const uint16_t*>(r.k().data().data());
  const auto* v = reinterpret_cast<const uint16_t*>(r.v().data().data());
  std::vector<double> o64(QElems(s)), lse64(LseElems(s));
  ReferenceAttentionF64(p, ContiguousLayout(s), q, k, v, o64.data(), lse64.data());
  double max_abs = 0;
  for (double x : o64) max_abs = std::max(max_abs, std::fabs(x));
  const double rel = p.dtype == DType::kBF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -10);
  for (size_t i = 0; i < o64.size(); ++i) {
    uint16_t h;
    std::memcpy(&h, &o[i * 2], 2);
    const double got = HalfToFloat(p.dtype, h);
    ASSERT_LE(std::fabs(got - o64[i]), rel * std::fabs(o64[i]) + 1e-5 * max_abs + 1e-7)
        << "O element " << i << ": " << got << " vs " << o64[i];
  }
  for (size_t i = 0; p.want_lse && i < lse64.size(); ++i) {
    float got;
    std::memcpy(&got, &lse[i * 4], 4);
    if (std::isinf(lse64[i])) {
      ASSERT_TRUE(std::isinf(got) && got < 0) << "LSE row " << i;
    } else {
      ASSERT_NEAR(got, lse64[i], 2e-5 * std::max(1.0, std::fabs(lse64[i]))) << "LSE row " << i;
    }
  }
  std::string o32(o.size(), '\x5a');  // poisoned
  ReferenceAttention(p, ContiguousLayout(s), q, k, v, reinterpret_cast<uint16_t*>(o32.data()), nullptr);
  ASSERT_TRUE(o32 == o) << "O differs from the fp32 reference";
}

// An in-process server over a CpuBackend on 127.0.0.1:<free port> (and optionally a unix socket).
struct TestServer {
  // `wrap`, when set, gets the CpuBackend and returns the backend the server uses (a test's probe around it).
  using Wrap = std::function<std::unique_ptr<server::Backend>(std::unique_ptr<server::Backend>)>;
  explicit TestServer(server::ServerOptions options = {}, server::BackendOptions backend_options = {},
                      server::CpuBackendHooks hooks = {}, const Wrap& wrap = nullptr) {
    if (options.network.listen == "127.0.0.1:50051") options.network.listen = "127.0.0.1:0";
    if (backend_options.threads == 0) backend_options.threads = 2;
    auto cpu_backend = std::make_unique<server::CpuBackend>(backend_options, std::move(hooks));
    cpu = cpu_backend.get();
    std::unique_ptr<server::Backend> backend = std::move(cpu_backend);
    if (wrap) backend = wrap(std::move(backend));
    auto created = server::Server::Create(options, std::move(backend));
    EXPECT_TRUE(created.ok()) << created.status();
    if (created.ok()) server = std::move(*created);
    max_message_bytes = options.limits.max_message_bytes;
  }

  std::shared_ptr<grpc::Channel> Channel(const std::string& target = "") const {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    return grpc::CreateCustomChannel(target.empty() ? "127.0.0.1:" + std::to_string(server->tcp_port()) : target,
                                     grpc::InsecureChannelCredentials(), args);
  }
  std::unique_ptr<v1::Attention::Stub> Stub(const std::string& target = "") const {
    return v1::Attention::NewStub(Channel(target));
  }

  std::unique_ptr<server::Server> server;
  server::CpuBackend* cpu = nullptr;  // owned by the server
  uint64_t max_message_bytes = 0;
};

// Blocks the backend's worker inside before_compute until Open().
class Gate {
 public:
  server::CpuBackendHooks Hooks() {
    server::CpuBackendHooks h;
    h.before_compute = [this](const server::ForwardJob&) {
      entered_.fetch_add(1);
      open_.WaitForNotification();
    };
    return h;
  }
  void Open() {
    if (!open_.HasBeenNotified()) open_.Notify();
  }
  int entered() const { return entered_.load(); }

 private:
  absl::Notification open_;
  std::atomic<int> entered_{0};
};

// Polls `cond` for up to 10 s.
inline bool WaitFor(const std::function<bool()>& cond) {
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (!cond()) {
    if (absl::Now() > end) return false;
    absl::SleepFor(absl::Milliseconds(2));
  }
  return true;
}

}  // namespace attnd::testing
