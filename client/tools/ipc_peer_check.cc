// ipc_peer check (the modes: ipc_peer.cc).
#include "ipc_peer.h"

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "attnd/client/client.h"
#include "attnd/client/shm_channel.h"
#include "attnd/client/tensors.h"

ABSL_FLAG(int, clients, 8, "check: concurrent IPC callers");
ABSL_FLAG(int, requests, 8, "check: requests per concurrent caller");

namespace ipc_peer {
namespace {

void ExpectCode(const std::string& what, const absl::Status& s, absl::StatusCode code, const std::string& field) {
  if (s.code() != code) {
    return Fail(absl::StrCat(what, ": expected ", absl::StatusCodeToString(code), ", got ", s.ToString()));
  }
  if (!field.empty() && s.message().find(field) == absl::string_view::npos) {
    return Fail(absl::StrCat(what, ": the message does not name ", field, ": ", s.message()));
  }
  Pass(absl::StrCat(what, " -> ", absl::StatusCodeToString(code), " (", s.message(), ")"));
}

// Correctness over every mask, GQA ratio and head_dim, with lengths that are not tile multiples; with
// --shm_socket (shm not null) every case again over the shared-memory channel. 1: the run cannot go on.
int CheckCases(client::Client& c, client::ShmChannel* shm) {
  int cases = 0;
  for (int64_t hd : attnd::kHeadDims) {
    const Shape s{2, 200, 333, 8, 8, hd};
    Buffers b = Allocate(s, 1);
    if (absl::Status st = Register(c, b, 1); !st.ok()) {
      Fail(absl::StrCat("register: ", st.ToString()));
      return 1;
    }
    for (Mask m : {Mask::kNone, Mask::kCausalTopLeft, Mask::kCausalBottomRight}) {
      for (int64_t kvh : {8, 2, 1}) {
        client::RequestSpec spec;
        spec.shape = s;
        spec.shape.kv_heads = kvh;
        spec.mask = m;
        spec.want_lse = (cases % 2) == 0;
        spec.dtype = (cases % 5 == 4) ? DType::kFP16 : DType::kBF16;
        Inputs in = Upload(spec, b, 100 + cases);
        auto oracle = client::Oracle::Compute(spec.ToProblem(), in.q, in.k, in.v);
        if (!oracle.ok()) return Fail(oracle.status().ToString()), 1;
        const std::string why = CallAndCheck(c, RefRequest(spec, b, 0), b, 0, *oracle);
        const std::string what = absl::StrFormat("ipc d%d %s kv_heads %d %s%s", hd, attnd::MaskName(m), kvh,
                                                 attnd::DTypeName(spec.dtype), spec.want_lse ? " +lse" : "");
        why.empty() ? Pass(what) : Fail(absl::StrCat(what, ": ", why));
        if (shm != nullptr) {
          const std::string why_shm = CallAndCheck(
              [&](const v1::ForwardRequest& r) { return client::ForwardOverShm(*shm, r); }, RefRequest(spec, b, 0), b, 0, *oracle);
          why_shm.empty() ? Pass(what + " (shm)") : Fail(absl::StrCat(what, " (shm): ", why_shm));
        }
        ++cases;
      }
    }
    for (const std::string& id : b.out_ids) (void)c.UnregisterCudaBuffer(id);
    (void)c.UnregisterCudaBuffer(b.inputs_id);
    CUDA_OR_DIE(cudaFree(b.base));
  }
  return 0;
}

// Registrations the server refuses, each naming its field.
void CheckBadRegistrations(client::Client& c, const Buffers& b) {
  v1::RegisterCudaBufferRequest r;
  std::string junk(64, '\0');
  for (int i = 0; i < 64; ++i) junk[i] = static_cast<char>(i * 37 + 11);
  r.set_ipc_handle(junk);
  r.set_device(absl::GetFlag(FLAGS_device));
  r.set_byte_size(4096);
  ExpectCode("register a forged handle", c.RegisterCudaBuffer(r).status(), absl::StatusCode::kInvalidArgument,
             "ipc_handle");
  r.set_ipc_handle(b.handle);
  r.set_offset(0);
  r.set_byte_size(b.total + 4096);
  ExpectCode("register past the allocation's end", c.RegisterCudaBuffer(r).status(),
             absl::StatusCode::kInvalidArgument, "byte_size");
  r.set_offset(b.total - 16);
  r.set_byte_size(32);
  ExpectCode("register a region straddling the end", c.RegisterCudaBuffer(r).status(),
             absl::StatusCode::kInvalidArgument, "byte_size");
  r.set_offset(0);
  r.set_byte_size(4096);
  r.set_device(999);
  ExpectCode("register on a device the server does not serve", c.RegisterCudaBuffer(r).status(),
             absl::StatusCode::kInvalidArgument, "device");
}

// References the server refuses, each naming its field.
void CheckBadReferences(client::Client& c, const Buffers& b, const client::RequestSpec& spec,
                        client::ShmChannel* shm) {
  const Shape& s = spec.shape;
  v1::ForwardRequest req = RefRequest(spec, b, 0);
  req.mutable_v()->mutable_ref()->set_offset(b.o_off - 1024);  // V would run past the inputs region
  ExpectCode("V reference past its region", c.Forward(req).status(), absl::StatusCode::kInvalidArgument, "v.ref");
  req = RefRequest(spec, b, 0);
  req.mutable_o_ref()->set_offset(16);
  ExpectCode("O reference past its region", c.Forward(req).status(), absl::StatusCode::kInvalidArgument, "o_ref");
  req = RefRequest(spec, b, 0);
  req.mutable_q()->mutable_ref()->set_offset(~uint64_t{0} - 15);
  ExpectCode("offset near 2^64 (overflow)", c.Forward(req).status(), absl::StatusCode::kInvalidArgument, "q.ref");
  req = RefRequest(spec, b, 0);
  req.mutable_k()->mutable_ref()->set_buffer_id("cuda-1-0000000000000000");
  ExpectCode("unknown buffer id", c.Forward(req).status(), absl::StatusCode::kInvalidArgument, "k.ref");
  if (shm != nullptr) {
    ExpectCode("unknown buffer id (shm)", client::ForwardOverShm(*shm, req).status(), absl::StatusCode::kInvalidArgument, "k.ref");
  }
  req = RefRequest(spec, b, 0);
  // Valid strides (multiples of 16 bytes) whose span, 8x the contiguous one, runs past the region.
  const int64_t row = s.q_heads * s.head_dim;
  for (int64_t st : {8 * row * s.q_len, 8 * row, s.head_dim}) req.mutable_q()->mutable_ref()->add_strides(st);
  ExpectCode("strides reaching outside the region", c.Forward(req).status(), absl::StatusCode::kInvalidArgument,
             "q.ref");
  req = RefRequest(spec, b, 0);
  for (int i = 0; i < 3; ++i) req.mutable_k()->mutable_ref()->add_strides(i == 0 ? 1ll << 60 : 64);
  ExpectCode("strides the kernel cannot address", c.Forward(req).status(), absl::StatusCode::kInvalidArgument,
             "layout.k");
}

// Bad input is rejected with the field named, and the server keeps serving. 1: the run cannot go on.
int CheckRejections(client::Client& c, client::ShmChannel* shm) {
  const Shape s{1, 128, 128, 4, 4, 64};
  Buffers b = Allocate(s, 1);
  if (absl::Status st = Register(c, b, 1); !st.ok()) return Fail(st.ToString()), 1;
  client::RequestSpec spec;
  spec.shape = s;
  Inputs in = Upload(spec, b, 7);
  auto oracle = client::Oracle::Compute(spec.ToProblem(), in.q, in.k, in.v);
  if (!oracle.ok()) return Fail(oracle.status().ToString()), 1;
  CheckBadRegistrations(c, b);
  CheckBadReferences(c, b, spec, shm);
  const std::string why = CallAndCheck(c, RefRequest(spec, b, 0), b, 0, *oracle);
  why.empty() ? Pass("still correct after the rejected calls") : Fail(absl::StrCat("after rejections: ", why));
  auto list = c.ListCudaBuffers();
  if (!list.ok()) {
    Fail(list.status().ToString());
  } else {
    bool idle = true;
    for (const auto& info : *list) idle = idle && info.requests_in_flight() == 0;
    idle && list->size() >= 2 ? Pass(absl::StrCat("ListCudaBuffers: ", list->size(), " buffers, none in use"))
                              : Fail("ListCudaBuffers: buffers missing or still in use after the replies");
  }
  ExpectCode("unregister", c.UnregisterCudaBuffer(b.out_ids[0]), absl::StatusCode::kOk, "");
  ExpectCode("use after unregister", c.Forward(RefRequest(spec, b, 0)).status(), absl::StatusCode::kInvalidArgument,
             "o_ref");
  ExpectCode("unregister twice", c.UnregisterCudaBuffer(b.out_ids[0]), absl::StatusCode::kNotFound, "buffer_id");
  (void)c.UnregisterCudaBuffer(b.inputs_id);
  CUDA_OR_DIE(cudaFree(b.base));
  return 0;
}

// Concurrent callers, each with its own O region of one shared allocation and distinct inputs per request.
void CheckConcurrent(client::Client& c) {
  const int clients = absl::GetFlag(FLAGS_clients), requests = absl::GetFlag(FLAGS_requests);
  if (clients > 0) {
    const Shape cs{1, 256, 256, 8, 2, 128};
    std::atomic<int> ok{0}, bad{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < clients; ++t) {
      threads.emplace_back([&, t] {
        cudaSetDevice(absl::GetFlag(FLAGS_device));
        Buffers mine = Allocate(cs, 1);
        if (!Register(c, mine, 1).ok()) {
          ++bad;
          return;
        }
        for (int i = 0; i < requests; ++i) {
          client::RequestSpec sp;
          sp.shape = cs;
          sp.mask = i % 2 ? Mask::kCausalTopLeft : Mask::kNone;
          Inputs in2 = Upload(sp, mine, 1000 + t * 100 + i);
          auto o2 = client::Oracle::Compute(sp.ToProblem(), in2.q, in2.k, in2.v, 1);
          const std::string why = o2.ok() ? CallAndCheck(c, RefRequest(sp, mine, 0), mine, 0, *o2) : "no oracle";
          if (why.empty()) {
            ++ok;
          } else {
            ++bad;
            Fail(absl::StrCat("concurrent caller ", t, " request ", i, ": ", why));
          }
        }
        (void)c.UnregisterCudaBuffer(mine.out_ids[0]);
        (void)c.UnregisterCudaBuffer(mine.inputs_id);
        cudaFree(mine.base);
      });
    }
    for (auto& th : threads) th.join();
    bad == 0 ? Pass(absl::StrCat(clients, " concurrent IPC callers: ", ok.load(), " correct replies"))
             : Fail(absl::StrCat(clients, " concurrent IPC callers: ", bad.load(), " failures"));
  }
}

}  // namespace

int Check(client::Client& c) {
  std::unique_ptr<client::ShmChannel> shm;
  if (!absl::GetFlag(FLAGS_shm_socket).empty()) {
    client::ShmChannelOptions so;
    so.socket_path = absl::GetFlag(FLAGS_shm_socket);
    absl::StatusOr<std::unique_ptr<client::ShmChannel>> opened = client::ShmChannel::Connect(so);
    if (!opened.ok()) return Fail(absl::StrCat("shm channel: ", opened.status().ToString())), 1;
    shm = *std::move(opened);
  }
  if (CheckCases(c, shm.get()) != 0) return 1;
  if (CheckRejections(c, shm.get()) != 0) return 1;
  CheckConcurrent(c);
  std::printf("%s: %d failures\n", failures == 0 ? "PASS" : "FAIL", failures);
  return failures == 0 ? 0 : 1;
}

}  // namespace ipc_peer
