// Calls a gRPC method by name with hand-encoded protobuf bytes, for the standard services (health,
// reflection) whose generated C++ code Debian does not ship.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"

namespace attnd::testing {

struct RawResult {
  grpc::Status status;
  std::vector<std::string> messages;
};

inline std::string ToString(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!buffer.Dump(&slices).ok()) return out;
  for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

// Sends `requests` (serialized protobuf, in order) to `method` ("/pkg.Service/Method"), half-closes, and
// reads up to `max_messages` replies; stops early (cancelling the call) once that many have arrived.
inline RawResult RawCall(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                         const std::vector<std::string>& requests, size_t max_messages = 16,
                         std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  RawResult result;
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(&ctx, method, &cq);
  void* tag;
  bool ok;
  auto step = [&](int id) { return cq.Next(&tag, &ok) && tag == reinterpret_cast<void*>(static_cast<intptr_t>(id)) && ok; };
  call->StartCall(reinterpret_cast<void*>(1));
  if (step(1)) {
    bool written = true;
    for (const std::string& request : requests) {
      grpc::Slice slice(request);
      grpc::ByteBuffer req(&slice, 1);
      call->Write(req, reinterpret_cast<void*>(2));
      if (!(written = step(2))) break;
    }
    if (written) {
      call->WritesDone(reinterpret_cast<void*>(3));
      step(3);
    }
    while (result.messages.size() < max_messages) {
      grpc::ByteBuffer resp;
      call->Read(&resp, reinterpret_cast<void*>(4));
      if (!step(4)) break;
      result.messages.push_back(ToString(resp));
    }
  }
  if (result.messages.size() >= max_messages) ctx.TryCancel();
  call->Finish(&result.status, reinterpret_cast<void*>(5));
  while (cq.Next(&tag, &ok) && tag != reinterpret_cast<void*>(5)) {
  }
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return result;
}

inline RawResult RawCall(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                         const std::string& request, size_t max_messages = 16,
                         std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  return RawCall(channel, method, std::vector<std::string>{request}, max_messages, timeout);
}

// grpc.health.v1.HealthCheckRequest{service} encoded by hand: field 1, length-delimited.
inline std::string HealthRequest(const std::string& service) {
  std::string out;
  if (!service.empty()) {
    out.push_back(0x0a);
    out.push_back(static_cast<char>(service.size()));
    out += service;
  }
  return out;
}

// HealthCheckResponse.status (field 1, varint): 1 SERVING, 2 NOT_SERVING, 3 SERVICE_UNKNOWN; 0 when absent.
inline int HealthStatus(const std::string& response) {
  return response.size() == 2 && response[0] == 0x08 ? response[1] : 0;
}

}  // namespace attnd::testing
