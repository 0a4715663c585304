// The one name of each way a request reaches the server, as code, logs and docs use it. (The wire keeps its
// own spellings: the gRPC method names, and the "ForwardShm" method label GetStats and metrics count shm calls
// under.)
#pragma once

namespace attnd::server {

inline constexpr char kGrpcTcp[] = "grpc-tcp";    // the gRPC service on --listen (TLS optional)
inline constexpr char kGrpcUnix[] = "grpc-unix";  // the gRPC service on --unix_socket
inline constexpr char kShm[] = "shm";             // same-host shared-memory channels, --shm_socket
inline constexpr char kCudaIpc[] = "cuda-ipc";    // registered CUDA buffers named by reference

}  // namespace attnd::server
