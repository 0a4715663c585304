// Keeps gRPC's listening sockets accepting when the process runs out of descriptors, and caps the connections
// they take.
//
// gRPC 1.51's TCP server (src/core/lib/iomgr/tcp_server_posix.cc, used for the TCP and the unix listener) stops
// accepting on a listening socket for good the first time accept4 fails with anything but EAGAIN, ECONNABORTED or
// EINTR: one EMFILE at the descriptor limit leaves the port deaf while everything else keeps answering. attnd
// therefore defines accept4 itself (an executable's definition comes before the C library's for every shared
// library it loads, libgrpc included) and, on the listening sockets a ListenerGuard registered:
//  - accepts at most max_connections connections at once; a connection beyond that is accepted and closed at
//    once (the client sees the connection end and answers UNAVAILABLE), and counted;
//  - on EMFILE or ENFILE closes a descriptor kept in reserve, accepts and closes every pending connection, takes
//    the reserve again and answers EAGAIN, so gRPC waits for the next connection instead of giving up;
//  - on ENOBUFS or ENOMEM answers EAGAIN (the pending connection is taken with the next one);
//  - on any other error reports the listener lost (gRPC will not accept on it again).
// Every other socket (the shared-memory listener's) gets the plain system call.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace attnd::server {

struct ListenerGuardOptions {
  uint32_t max_connections = 0;                  // connections accepted at once; 0: no cap
  std::function<void()> on_refused;              // a connection refused at the cap or shed at the limit
  std::function<void(int error)> on_lost;        // a listener gRPC will not accept on again (errno)
};

class ListenerGuard {
 public:
  // Guards every listening socket of this process bound to `tcp_port` (0: none) or to the unix socket
  // `unix_path` (empty: none). FAILED_PRECONDITION when none is found.
  static absl::StatusOr<std::unique_ptr<ListenerGuard>> Install(int tcp_port, const std::string& unix_path,
                                                                ListenerGuardOptions options);
  ~ListenerGuard();
  ListenerGuard(const ListenerGuard&) = delete;
  ListenerGuard& operator=(const ListenerGuard&) = delete;

  // The guarded listening descriptors (for tests and the start-up log).
  const std::vector<int>& listeners() const { return fds_; }
  // Connections refused or shed since Install.
  uint64_t refused() const;

  struct State;

 private:
  explicit ListenerGuard(std::vector<int> fds, std::shared_ptr<State> state);
  std::vector<int> fds_;
  std::shared_ptr<State> state_;
};

// The soft RLIMIT_NOFILE in force.
uint64_t DescriptorLimit();
// The connection cap used when none is configured: seven eighths of the descriptor limit, leaving the rest to
// the process's own descriptors (shared-memory channels, the metrics endpoint, files, gRPC's own).
uint32_t DefaultMaxConnections(uint64_t descriptor_limit);

}  // namespace attnd::server
