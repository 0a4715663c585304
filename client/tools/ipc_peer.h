// What the modes of ipc_peer (ipc_peer.cc) share: the flags every mode reads, the findings, and the buffers
// and calls of a Forward through CUDA IPC.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnd/client/client.h"
#include "attnd/client/tensors.h"

ABSL_DECLARE_FLAG(int, device);
ABSL_DECLARE_FLAG(std::string, transport);
ABSL_DECLARE_FLAG(std::string, shm_socket);

#define CUDA_OR_DIE(expr)                                                                         \
  do {                                                                                            \
    const cudaError_t _e = (expr);                                                                \
    if (_e != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "ipc_peer: %s: %s\n", #expr, cudaGetErrorString(_e));                \
      std::exit(3);                                                                               \
    }                                                                                             \
  } while (0)

namespace ipc_peer {

using attnd::DType;
using attnd::Mask;
using attnd::Shape;
namespace client = attnd::client;
namespace v1 = attnd::v1;

extern int failures;

void Fail(const std::string& what);
void Pass(const std::string& what);

uint64_t Align(uint64_t x);

// One exported allocation holding Q, K, V (one registration, "inputs") and `outs` O regions (one
// registration each): registrations share the handle, as a real engine's pool would.
struct Buffers {
  Shape shape;
  uint64_t q_bytes = 0, kv_bytes = 0, o_off = 0, o_stride = 0, total = 0;
  uint8_t* base = nullptr;
  std::string handle;
  std::string inputs_id;
  std::vector<std::string> out_ids;

  uint64_t k_off() const { return Align(q_bytes); }
  uint64_t v_off() const { return Align(q_bytes) + Align(kv_bytes); }
  uint8_t* out(int i) const { return base + o_off + o_stride * i; }
};

Buffers Allocate(const Shape& s, int outs);
absl::Status Register(client::Client& c, Buffers& b, int outs);
v1::ForwardRequest RefRequest(const client::RequestSpec& spec, const Buffers& b, int out);

struct Inputs {
  std::string q, k, v;
};

Inputs Upload(const client::RequestSpec& spec, const Buffers& b, uint64_t seed);

// Poisons O (all-ones bf16/fp16 is NaN), calls, reads O back and checks it.
using ForwardFn = std::function<absl::StatusOr<client::ForwardResult>(const v1::ForwardRequest&)>;

std::string CallAndCheck(const ForwardFn& forward, const v1::ForwardRequest& req, const Buffers& b, int out,
                         const client::Oracle& oracle);
std::string CallAndCheck(client::Client& c, const v1::ForwardRequest& req, const Buffers& b, int out,
                         const client::Oracle& oracle);

std::vector<int64_t> Ints(const std::string& list);

// Registers bytes [offset, offset + size) of the exported allocation `handle` (on --device) as `name`: its id.
absl::StatusOr<std::string> RegisterRegion(client::Client& c, const std::string& handle, uint64_t offset,
                                           uint64_t size, const std::string& name);

// Kernel-only times of one problem on this GPU (KernelOnlyUs, DecodeKernelOnlyUs say how each is measured).
struct KernelOnly {
  double burst_us = 0, sustained_us = 0, isolated_us = 0, flushed_us = 0;
};

// Times launches on one stream with events around them.
class LaunchTimer {
 public:
  LaunchTimer(cudaStream_t stream, std::function<void()> launch);
  ~LaunchTimer();
  LaunchTimer(const LaunchTimer&) = delete;
  LaunchTimer& operator=(const LaunchTimer&) = delete;

  // Microseconds `n` launches back to back take.
  double Time(int n);
  // The mean launch of a burst of `burst` (burst_us) and the median of `singles` launches timed one at a time
  // (isolated_us).
  void BurstAndSingles(int burst, int singles, KernelOnly* k);

 private:
  const cudaStream_t stream_;
  const std::function<void()> launch_;
  cudaEvent_t start_ = nullptr, end_ = nullptr;
};

// The median of `v` (reordered).
double Median(std::vector<double>& v);

// The modes; each returns the exit status.
int Check(client::Client& c);
int Bench(client::Client& c);
int Decode(client::Client& c);
int Tcp();

}  // namespace ipc_peer
