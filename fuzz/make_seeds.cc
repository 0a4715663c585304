// Writes the seed corpus of every fuzz target under the given folder (fuzz/corpus/<target>/): real messages
// (what the client library and protobuf write) followed or preceded by the bytes each target reads as its
// parameters (FuzzedDataProvider takes integers from the end of the input, byte strings from the front).
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>

#include "attnd/transport/shm_channel.h"
#include "attnd/transport/zero_copy.h"
#include "attnd/v1/attention.pb.h"

namespace fs = std::filesystem;
using attnd::v1::ForwardRequest;

namespace {

fs::path root;

void Write(const std::string& target, const std::string& name, const std::string& bytes) {
  fs::create_directories(root / target);
  std::ofstream(root / target / name, std::ios::binary) << bytes;
}

std::string Dump(const grpc::ByteBuffer& b) {
  grpc::Slice s;
  if (!b.DumpToSingleSlice(&s).ok()) return {};
  return std::string(reinterpret_cast<const char*>(s.begin()), s.size());
}

std::string Le(uint64_t v, int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s.push_back(static_cast<char>(v >> (8 * i)));
  return s;
}

ForwardRequest Request(int64_t head_dim, bool inline_tensors) {
  ForwardRequest r;
  r.set_request_id("seed-1");
  auto* sh = r.mutable_shape();
  sh->set_batch(1);
  sh->set_q_len(2);
  sh->set_kv_len(3);
  sh->set_q_heads(2);
  sh->set_kv_heads(1);
  sh->set_head_dim(head_dim);
  r.set_dtype(attnd::v1::DTYPE_BF16);
  r.set_mask(attnd::v1::MASK_TYPE_CAUSAL_BOTTOM_RIGHT);
  r.set_return_lse(true);
  if (inline_tensors) {
    r.mutable_q()->set_data(std::string(1 * 2 * 2 * head_dim * 2, '\x3f'));
    r.mutable_k()->set_data(std::string(1 * 3 * 1 * head_dim * 2, '\x40'));
    r.mutable_v()->set_data(std::string(1 * 3 * 1 * head_dim * 2, '\x41'));
  } else {
    for (auto* t : {r.mutable_q(), r.mutable_k(), r.mutable_v()}) {
      t->mutable_ref()->set_buffer_id("buf-0");
      t->mutable_ref()->set_offset(256);
    }
    r.mutable_o_ref()->set_buffer_id("buf-0");
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: fuzz_make_seeds DIR\n";
    return 2;
  }
  root = argv[1];
  const ForwardRequest inline_req = Request(64, true);
  const ForwardRequest ref_req = Request(128, false);
  attnd::v1::ForwardResponse reply;
  reply.set_request_id("seed-1");
  reply.set_o(std::string(256, '\x01'));
  reply.set_lse(std::string(16, '\x02'));
  reply.mutable_timing()->set_kernel_us(12.5);
  reply.set_backend("cpu");
  reply.set_device(-1);
  // The zero-copy writer's bytes for the inline request (tensors after the header, as the client sends them).
  ForwardRequest header = inline_req;
  header.clear_q();
  header.clear_k();
  header.clear_v();
  const std::optional<std::string_view> tensors[3] = {inline_req.q().data(), inline_req.k().data(),
                                                      inline_req.v().data()};
  const std::string written = Dump(attnd::SerializeForwardRequest(header, tensors, nullptr));

  // fuzz_forward_request: [cuts] message [cut count][lse cap x2][o cap x2].
  const std::string caps = Le(0x1000, 2) + Le(0x0400, 2);
  const std::string trailer = std::string(1, '\0') + caps;
  Write("fuzz_forward_request", "request_inline", inline_req.SerializeAsString() + trailer);
  Write("fuzz_forward_request", "request_written", written + trailer);
  Write("fuzz_forward_request", "request_refs", ref_req.SerializeAsString() + trailer);
  Write("fuzz_forward_request", "response", reply.SerializeAsString() + trailer);
  Write("fuzz_forward_request", "request_cut", std::string("\x05\x20\x01\x80", 4) + written + "\x04" + caps);

  // fuzz_stream_chunk: [cuts] message [cut count][refuse_above x3].
  const std::string data(300, '\x55');
  const std::string chunk = Dump(attnd::SerializeStreamChunk(attnd::v1::TENSOR_NAME_K, 600, data.data(), data.size(), nullptr));
  attnd::v1::ForwardStreamRequest head;
  *head.mutable_header() = ref_req;
  const std::string refuse = Le(0x10000, 3);
  Write("fuzz_stream_chunk", "chunk", chunk + "\x00" + refuse);
  Write("fuzz_stream_chunk", "chunk_cut", std::string("\x02\x07", 2) + chunk + "\x02" + refuse);
  Write("fuzz_stream_chunk", "chunk_refused", chunk + "\x00" + Le(16, 3));
  Write("fuzz_stream_chunk", "header", head.SerializeAsString() + "\x00" + refuse);

  // fuzz_validation: message [max_heads][max_kv_len x3][max_q_len x3][max_batch][pick][max_message x4][max_request x5].
  const std::string limits = std::string("\x00", 1) + Le(0, 3) + Le(0, 3) + std::string("\x00", 1) + "\x8f" +
                             Le(256u << 20, 4) + Le(uint64_t{1} << 32, 5);
  Write("fuzz_validation", "inline", inline_req.SerializeAsString() + limits);
  Write("fuzz_validation", "written", written + limits);
  Write("fuzz_validation", "refs", ref_req.SerializeAsString() + limits);
  Write("fuzz_validation", "limited", inline_req.SerializeAsString() + "\x01" + Le(2, 3) + Le(1, 3) + "\x01\x8f" +
                                          Le(4096, 4) + Le(100, 5));

  // fuzz_shm_channel: header page + request area [size pick x2][request_bytes x8][max_area x3][flags].
  std::string page(attnd::shm::kHeaderBytes, '\0');
  const uint64_t cap = 1024;
  std::memcpy(&page[0], &attnd::shm::kMagic, 4);
  std::memcpy(&page[4], &attnd::shm::kVersion, 4);
  std::memcpy(&page[8], &cap, 8);
  std::memcpy(&page[16], &cap, 8);
  const std::string small = ref_req.SerializeAsString();
  Write("fuzz_shm_channel", "request", page + small + Le(0, 2) + Le(small.size(), 8) + Le(0x10000, 3) + "\x00");
  Write("fuzz_shm_channel", "request_too_long", page + small + Le(0, 2) + Le(cap + 1, 8) + Le(0x10000, 3) + "\x00");
  Write("fuzz_shm_channel", "unsealed", page + Le(0, 2) + Le(0, 8) + Le(0x10000, 3) + "\x03");

  // fuzz_shm_hello: hello bytes [byte count][messages][descriptor count].
  attnd::shm::Hello hello{attnd::shm::kMagic, attnd::shm::kVersion, 0, 0};
  const std::string h(reinterpret_cast<const char*>(&hello), sizeof(hello));
  Write("fuzz_shm_hello", "hello_fd", h + "\x10\x00\x01");
  Write("fuzz_shm_hello", "hello_no_fd", h + std::string("\x10\x00\x00", 3));
  Write("fuzz_shm_hello", "hello_short", h.substr(0, 8) + std::string("\x08\x00\x01", 3));

  // fuzz_auth: header values (strings from the front), choices (from the end), then a token file.
  Write("fuzz_auth", "bearer", std::string("x\\\n# tokens\n  tok  \n\ns3cret-token-0123456789\n", 43) +
                                   std::string("\x00\x01\x01\x01\x02", 5));
  Write("fuzz_auth", "health", std::string("abc\\", 4) + std::string("\x01\x00\x04\x00\x01", 5));
  std::cout << "seeds written under " << root << "\n";
  return 0;
}
