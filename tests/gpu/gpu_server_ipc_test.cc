// CUDA IPC from a second process (client/tools/ipc_peer.cc allocates, exports and registers its own buffers):
// zero-copy correctness for every mask/GQA/head_dim, bad handles and out-of-range references rejected,
// and 32 concurrent clients mixed across transports (the peer's IPC callers next to inline unary and
// streaming callers in this process); with two GPUs, inline work spread over both and IPC work on the device
// of its buffers. Skipped without a usable GPU (the two-GPU case without a second one).
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnd/client/client.h"
#include "gpu_server_util.h"
#include "gtest/gtest.h"

namespace attnd::gpu {
namespace {

using client::Transport;

// $ATTND_IPC_PEER, else ipc_peer next to this test binary (binaries are carried together to a GPU host),
// else the build tree's.
std::string PeerBinary() {
  if (const char* env = std::getenv("ATTND_IPC_PEER")) return env;
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (n > 0) {
    std::string dir(self, static_cast<size_t>(n));
    dir = dir.substr(0, dir.rfind('/'));
    const std::string sibling = dir + "/ipc_peer";
    if (::access(sibling.c_str(), X_OK) == 0) return sibling;
  }
  return IPC_PEER_BINARY;
}

// Runs the peer to completion; returns its exit status and fills `output`.
int RunPeer(const std::string& args, std::string* output) {
  const std::string cmd = absl::StrCat(PeerBinary(), " ", args, " 2>&1");
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return -1;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) output->append(buf, n);
  const int st = ::pclose(p);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

TEST(GpuServerIpcTest, ZeroCopyFromAnotherProcessWithInlineClientsAlongside) {
  TestServer s;
  CudaServerOptions o;
  o.enable_ipc = true;
  o.shm = true;
  ATTND_START_CUDA_SERVER(s, o);
  // 8 IPC callers in the peer + 24 inline callers here = 32 concurrent clients across the transports; the peer
  // also runs every correctness case over the shared-memory channel.
  std::string peer_output;
  int peer_rc = -1;
  std::thread peer([&] {
    peer_rc = RunPeer(absl::StrCat("check --target=unix:", s.unix_path, " --shm_socket=", s.unix_path,
                                   ".shm --clients=8 --requests=6"),
                      &peer_output);
  });
  const int kInline = 24;
  std::vector<std::thread> threads;
  std::vector<std::string> failures(kInline);
  for (int t = 0; t < kInline; ++t) {
    threads.emplace_back([&, t] {
      auto c = Connect(s.Target(t % 2 ? Listener::kUnix : Listener::kTcp), t % 3 ? Transport::kUnary : Transport::kStream,
                       64 * 1024, true);
      for (int i = 0; i < 4; ++i) {
        const Case k = MakeCase(Spec(1, 128 + 64 * (t % 4), 256, 8, t % 2 ? 8 : 2, 128, static_cast<Mask>(i % 3)),
                                3000 + t * 10 + i);
        const std::string why = CheckReply(k, c->Forward(*k.request));
        if (!why.empty() && failures[t].empty()) failures[t] = absl::StrCat("inline client ", t, ": ", why);
      }
    });
  }
  for (auto& th : threads) th.join();
  peer.join();
  for (const std::string& f : failures) EXPECT_EQ(f, "");
  EXPECT_EQ(peer_rc, 0) << peer_output;
  EXPECT_NE(peer_output.find("PASS: 0 failures"), std::string::npos) << peer_output;
  std::printf("%s", peer_output.c_str());  // the peer's findings, kept in the test log

  // After the peer exited and unregistered, nothing is left registered or in use.
  auto c = Connect(s.Target(Listener::kUnix));
  auto list = c->ListCudaBuffers();
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_TRUE(list->empty()) << list->size() << " buffers still registered";
}

// Multi-GPU (--devices): inline requests go to the least-loaded device, IPC requests to the device that owns
// their buffers (the peer checks every reply's device against its own, on each transport). Skipped with one GPU.
TEST(GpuServerIpcTest, TwoDevicesInlineSpreadsAndIpcRunsWhereItsBuffersLive) {
  TestServer s;
  CudaServerOptions o;
  o.enable_ipc = true;
  o.shm = true;
  ATTND_START_CUDA_SERVER(s, o);
  {
    auto info = Connect(s.Target(Listener::kUnix))->ServerInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    if (info->devices_size() < 2) GTEST_SKIP() << "needs two GPUs; the server found " << info->devices_size();
  }
  std::string out[2];
  int rc[2] = {-1, -1};
  std::vector<std::thread> peers;
  for (int d = 0; d < 2; ++d) {
    peers.emplace_back([&, d] {
      rc[d] = RunPeer(absl::StrCat("check --target=unix:", s.unix_path, " --shm_socket=", s.unix_path, ".shm --device=",
                                   d, " --clients=4 --requests=4"),
                      &out[d]);
    });
  }
  const int kInline = 16;
  std::vector<std::thread> threads;
  std::vector<std::string> failures(kInline);
  std::atomic<int> on_device[2] = {0, 0};
  for (int t = 0; t < kInline; ++t) {
    threads.emplace_back([&, t] {
      auto c = Connect(s.Target(t % 2 ? Listener::kUnix : Listener::kTcp), Transport::kUnary, 64 * 1024, true);
      for (int i = 0; i < 6; ++i) {
        const Case k = MakeCase(Spec(2, 512, 512, 8, 2, 128, static_cast<Mask>(i % 3)), 7000 + t * 10 + i);
        auto r = c->Forward(*k.request);
        const std::string why = CheckReply(k, r);
        if (!why.empty() && failures[t].empty()) failures[t] = absl::StrCat("inline client ", t, ": ", why);
        if (r.ok() && r->device >= 0 && r->device < 2) ++on_device[r->device];
      }
    });
  }
  for (auto& th : threads) th.join();
  for (auto& th : peers) th.join();
  for (const std::string& f : failures) EXPECT_EQ(f, "");
  for (int d = 0; d < 2; ++d) {
    EXPECT_EQ(rc[d], 0) << out[d];
    EXPECT_NE(out[d].find("PASS: 0 failures"), std::string::npos) << out[d];
    std::printf("peer on device %d:\n%s", d, out[d].c_str());
  }
  // 16 callers at once, ties between idle devices broken in turn: each device takes a fair share.
  EXPECT_GE(on_device[0].load(), kInline * 6 / 4);
  EXPECT_GE(on_device[1].load(), kInline * 6 / 4);
  std::printf("inline requests by device: %d / %d\n", on_device[0].load(), on_device[1].load());
}

TEST(GpuServerIpcTest, RegistrationOverTcpIsRefusedByDefault) {
  TestServer s;
  CudaServerOptions o;
  o.enable_ipc = true;
  ATTND_START_CUDA_SERVER(s, o);
  auto c = Connect(s.Target(Listener::kTcp));
  v1::RegisterCudaBufferRequest reg;
  reg.set_ipc_handle(std::string(64, 'x'));
  reg.set_byte_size(1024);
  auto r = c->RegisterCudaBuffer(reg);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_NE(r.status().message().find("unix socket"), std::string::npos) << r.status();
}

TEST(GpuServerIpcTest, AZeroHandleIsRejectedNotCrashed) {
  TestServer s;
  CudaServerOptions o;
  o.enable_ipc = true;
  ATTND_START_CUDA_SERVER(s, o);
  // The driver refuses a handle that names no exported allocation: INVALID_ARGUMENT, and the server keeps
  // serving.
  auto c = Connect(s.Target(Listener::kUnix), Transport::kUnary);
  v1::RegisterCudaBufferRequest reg;
  std::string zeros(64, '\0');
  reg.set_ipc_handle(zeros);
  reg.set_byte_size(4096);
  auto r = c->RegisterCudaBuffer(reg);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  const Case k = MakeCase(Spec(1, 64, 64, 2, 2, 64), 8);
  EXPECT_EQ(CheckReply(k, c->Forward(*k.request)), "");
}

}  // namespace
}  // namespace attnd::gpu
