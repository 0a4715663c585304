// What the C ABI's sources (client_c.cc, client_c_sequences.cc) share: the client handle behind attnd_client,
// and the helpers that fill the caller's error, strings and JSON.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attnd/client/bench.h"
#include "attnd/client/client.h"
#include "attnd/client/cuda_steps.h"
#include "attnd/client/shm_channel.h"
#include "attnd_client_c.h"
#include "google/protobuf/util/json_util.h"

#define ATTND_C_EXPORT extern "C" __attribute__((visibility("default")))

namespace attnd::c_abi {

using attnd::DType;
using attnd::Mask;
using attnd::client::ForwardResult;
using attnd::client::Transport;
namespace v1 = attnd::v1;

// A shared-memory channel's areas are at least this large, so that one channel serves calls of many sizes.
constexpr uint64_t kShmMinAreaBytes = 1ull << 20;

inline void Copy(char* dst, size_t cap, const std::string& s) {
  if (cap == 0) return;
  const size_t n = std::min(cap - 1, s.size());
  std::memcpy(dst, s.data(), n);
  dst[n] = '\0';
}

inline int32_t Fail(attnd_error* err, const absl::Status& s, const std::string& request_id = "") {
  if (err != nullptr) {
    err->code = static_cast<int32_t>(s.code());
    Copy(err->message, sizeof(err->message), std::string(s.message()));
    Copy(err->request_id, sizeof(err->request_id), request_id);
  }
  return static_cast<int32_t>(s.code());
}

inline void Ok(attnd_error* err) {
  if (err != nullptr) {
    err->code = 0;
    err->message[0] = '\0';
    err->request_id[0] = '\0';
  }
}

inline std::string Str(const char* s) { return s == nullptr ? std::string() : std::string(s); }

inline char* Dup(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out == nullptr) return nullptr;
  std::memcpy(out, s.data(), s.size());
  out[s.size()] = '\0';
  return out;
}

inline absl::StatusOr<std::string> ToJson(const google::protobuf::Message& m) {
  google::protobuf::util::JsonPrintOptions o;
  o.always_print_primitive_fields = true;
  o.preserve_proto_field_names = true;
  std::string out;
  auto s = google::protobuf::util::MessageToJsonString(m, &out, o);
  if (!s.ok()) return absl::InternalError(absl::StrCat("JSON of ", m.GetTypeName(), ": ", s.ToString()));
  return out;
}

// One shared-memory channel and the request/reply sizes it was opened for.
struct ShmSlot {
  std::unique_ptr<attnd::client::ShmChannel> channel;
  uint64_t request_capacity = 0, reply_capacity = 0;
};

}  // namespace attnd::c_abi

struct attnd_client {
  std::unique_ptr<attnd::client::Client> client;
  attnd::client::Transport transport = attnd::client::Transport::kAuto;
  std::string shm_socket, auth_token;
  uint64_t shm_max_bytes = 64ull << 20;
  absl::Duration default_timeout = absl::Seconds(120);
  std::string id_prefix;
  std::atomic<uint64_t> next_id{0};

  // Made on the first CUDA step, on that thread's context; destroyed before `client`.
  absl::Mutex cuda_mu;
  std::unique_ptr<attnd::client::CudaSteps> cuda ABSL_GUARDED_BY(cuda_mu);

  absl::Mutex mu;
  int64_t in_flight ABSL_GUARDED_BY(mu) = 0;
  // Idle channels: a channel carries one request at a time, so each call in flight over shm holds one.
  std::vector<attnd::c_abi::ShmSlot> shm_idle ABSL_GUARDED_BY(mu);

  // The caller's request id, or one this library makes (so that errors can name it).
  std::string RequestId(const char* given) {
    if (given != nullptr && given[0] != '\0') return given;
    return absl::StrCat(id_prefix, next_id.fetch_add(1, std::memory_order_relaxed));
  }

  void Begin() {
    absl::MutexLock l(&mu);
    ++in_flight;
  }
  void End() {
    absl::MutexLock l(&mu);
    --in_flight;
  }

  absl::StatusOr<attnd::c_abi::ShmSlot> TakeShm(const attnd::v1::ForwardRequest& request) {
    auto need = attnd::client::ShmChannelOptionsFor(request, shm_socket, shm_max_bytes);
    if (!need.ok()) return need.status();
    {
      absl::MutexLock l(&mu);
      for (size_t i = 0; i < shm_idle.size(); ++i) {
        if (shm_idle[i].request_capacity >= need->request_capacity &&
            shm_idle[i].reply_capacity >= need->reply_capacity) {
          attnd::c_abi::ShmSlot slot = std::move(shm_idle[i]);
          shm_idle.erase(shm_idle.begin() + static_cast<std::ptrdiff_t>(i));
          return slot;
        }
      }
    }
    attnd::client::ShmChannelOptions o = *need;
    o.request_capacity = std::min(shm_max_bytes, std::max(o.request_capacity, attnd::c_abi::kShmMinAreaBytes));
    o.reply_capacity = std::min(shm_max_bytes, std::max(o.reply_capacity, attnd::c_abi::kShmMinAreaBytes));
    o.auth_token = auth_token;
    auto channel = attnd::client::ShmChannel::Connect(o);
    if (!channel.ok()) return channel.status();
    return attnd::c_abi::ShmSlot{*std::move(channel), o.request_capacity, o.reply_capacity};
  }
  void ReturnShm(attnd::c_abi::ShmSlot slot) {
    absl::MutexLock l(&mu);
    shm_idle.push_back(std::move(slot));
  }
};
