// ForwardStream against an in-process server, called with the generated stub: tensors beyond the unary limit,
// inputs handed to the backend's sink as they arrive, streams still receiving (in GetStats and in the queue), the
// idle and upload timeouts, each client's share of the uploads, and malformed, garbled and unusually encoded
// streams.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "forwarding_backend.h"
#include "gtest/gtest.h"
#include "server_raw_call.h"
#include "server_test_util.h"

namespace attnd {
namespace {

using testing::ExpectCorrect;
using testing::MakeRequest;
using testing::TestServer;

using Stream = grpc::ClientReaderWriter<v1::ForwardStreamRequest, v1::ForwardStreamResponse>;

v1::ForwardStreamRequest Header(const v1::ForwardRequest& r) {
  v1::ForwardStreamRequest m;
  *m.mutable_header() = r;
  m.mutable_header()->clear_q();
  m.mutable_header()->clear_k();
  m.mutable_header()->clear_v();
  return m;
}

v1::ForwardStreamRequest Chunk(v1::TensorName t, const std::string& bytes, uint64_t offset, uint64_t n) {
  v1::ForwardStreamRequest m;
  m.mutable_chunk()->set_tensor(t);
  m.mutable_chunk()->set_offset(offset);
  m.mutable_chunk()->set_data(bytes.substr(offset, n));
  return m;
}

// Chunks of the three tensors interleaved, `chunk` bytes each; each tensor's own chunks in order.
bool WriteInterleaved(Stream& stream, const v1::ForwardRequest& r, uint64_t chunk) {
  const std::string* bytes[3] = {&r.q().data(), &r.k().data(), &r.v().data()};
  const v1::TensorName names[3] = {v1::TENSOR_NAME_Q, v1::TENSOR_NAME_K, v1::TENSOR_NAME_V};
  uint64_t sent[3] = {0, 0, 0};
  for (bool more = true; more;) {
    more = false;
    for (int t = 0; t < 3; ++t) {
      if (sent[t] == bytes[t]->size()) continue;
      const uint64_t n = std::min<uint64_t>(chunk, bytes[t]->size() - sent[t]);
      if (!stream.Write(Chunk(names[t], *bytes[t], sent[t], n))) return false;
      sent[t] += n;
      more = true;
    }
  }
  return true;
}

TEST(ServerStream, TensorsLargerThanTheUnaryLimit) {
  server::ServerOptions opts;
  opts.limits.max_message_bytes = 256 * 1024;
  TestServer ts(opts);
  ASSERT_NE(ts.server, nullptr);
  auto stub = ts.Stub();
  // Q and O are 1 MiB each, four times the message limit; LSE is 32 KiB.
  const v1::ForwardRequest r = MakeRequest({1, 2048, 300, 4, 1, 64}, v1::MASK_TYPE_CAUSAL_BOTTOM_RIGHT, true, 77);
  {
    grpc::ClientContext ctx;
    v1::ForwardResponse resp;
    const grpc::Status s = stub->Forward(&ctx, r, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  }
  grpc::ClientContext ctx;
  std::unique_ptr<Stream> stream = stub->ForwardStream(&ctx);
  ASSERT_TRUE(stream->Write(Header(r)));
  ASSERT_TRUE(WriteInterleaved(*stream, r, 100 * 1000));  // not a divisor of any tensor size
  ASSERT_TRUE(stream->WritesDone());
  v1::ForwardStreamResponse m;
  ASSERT_TRUE(stream->Read(&m));
  ASSERT_TRUE(m.has_header());
  EXPECT_EQ(m.header().request_id(), r.request_id());
  EXPECT_EQ(m.header().backend(), "cpu");
  EXPECT_TRUE(m.header().o().empty());
  EXPECT_GT(m.header().timing().kernel_us(), 0);
  std::string o, lse;
  int chunks = 0;
  while (stream->Read(&m)) {
    ASSERT_TRUE(m.has_chunk());
    std::string& dst = m.chunk().tensor() == v1::TENSOR_NAME_O ? o : lse;
    ASSERT_TRUE(m.chunk().tensor() == v1::TENSOR_NAME_O || m.chunk().tensor() == v1::TENSOR_NAME_LSE);
    if (m.chunk().tensor() == v1::TENSOR_NAME_O) {
      ASSERT_TRUE(lse.empty()) << "O chunks must all come before LSE";
    }
    ASSERT_EQ(m.chunk().offset(), dst.size());
    ASSERT_LT(m.ByteSizeLong(), ts.max_message_bytes);
    dst += m.chunk().data();
    ++chunks;
  }
  const grpc::Status s = stream->Finish();
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_GT(chunks, 4);
  ExpectCorrect(r, o, lse);
}

// Sends `messages` then half-closes; returns the final status (replies are drained).
grpc::Status RunStream(v1::Attention::Stub* stub, const std::vector<v1::ForwardStreamRequest>& messages) {
  grpc::ClientContext ctx;
  std::unique_ptr<Stream> stream = stub->ForwardStream(&ctx);
  for (const auto& m : messages) {
    if (!stream->Write(m)) break;  // the server already answered
  }
  stream->WritesDone();
  v1::ForwardStreamResponse reply;
  while (stream->Read(&reply)) {
  }
  return stream->Finish();
}

// Watches how a stream hands its inputs to the backend: what it tells the sink (InputSink) as chunks
// arrive, and what the job carries at Submit. The bytes still land in the CPU backend's own sink.
class SinkProbe final : public testing::ForwardingBackend {
 public:
  struct Seen {
    uint64_t sizes[3] = {};
    std::vector<std::pair<int, uint64_t>> arrived;  // (tensor, bytes in place), in call order
    int submits = 0;
    bool inputs_are_the_sink = false;  // at Submit: job->inputs is the sink, q/k/v's bytes are in it
  };

  class Sink final : public server::InputSink {
   public:
    Sink(std::unique_ptr<server::InputSink> inner, SinkProbe* probe) : inner_(std::move(inner)), probe_(probe) {}
    uint8_t* data(int tensor) override { return inner_->data(tensor); }
    absl::Status Arrived(int tensor, uint64_t bytes_in_place) override {
      absl::MutexLock lock(&probe_->mu_);
      probe_->seen_.arrived.emplace_back(tensor, bytes_in_place);
      if (probe_->refuse_after_ > 0 && probe_->seen_.arrived.size() >= probe_->refuse_after_) {
        return absl::DataLossError("test sink: refused a chunk");
      }
      return inner_->Arrived(tensor, bytes_in_place);
    }

   private:
    std::unique_ptr<server::InputSink> inner_;
    SinkProbe* const probe_;
  };

  // refuse_open: OpenInputs answers RESOURCE_EXHAUSTED; refuse_after > 0: the sink fails that Arrived call.
  SinkProbe(std::unique_ptr<server::Backend> inner, bool refuse_open, size_t refuse_after)
      : ForwardingBackend(std::move(inner)), refuse_open_(refuse_open), refuse_after_(refuse_after) {}

  absl::StatusOr<std::unique_ptr<server::InputSink>> OpenInputs(
      const server::ForwardJob& job, const uint64_t (&sizes)[server::InputSink::kTensors]) override {
    if (refuse_open_) return absl::ResourceExhaustedError("test backend: no room for this stream's inputs");
    {
      absl::MutexLock lock(&mu_);
      std::copy(sizes, sizes + 3, seen_.sizes);
    }
    absl::StatusOr<std::unique_ptr<server::InputSink>> inner = ForwardingBackend::OpenInputs(job, sizes);
    if (!inner.ok()) return inner.status();
    return std::unique_ptr<server::InputSink>(std::make_unique<Sink>(*std::move(inner), this));
  }

  absl::Status Submit(std::unique_ptr<server::ForwardJob> job) override {
    {
      absl::MutexLock lock(&mu_);
      ++seen_.submits;
      server::InputSink* sink = job->inputs.get();
      seen_.inputs_are_the_sink = dynamic_cast<Sink*>(sink) != nullptr && job->q.host == sink->data(0) &&
                                  job->k.host == sink->data(1) && job->v.host == sink->data(2) &&
                                  job->q.host_bytes == seen_.sizes[0] && job->v.host_bytes == seen_.sizes[2];
    }
    return ForwardingBackend::Submit(std::move(job));
  }

  Seen seen() const {
    absl::MutexLock lock(&mu_);
    return seen_;
  }

 private:
  const bool refuse_open_;
  const size_t refuse_after_;
  mutable absl::Mutex mu_;
  Seen seen_ ABSL_GUARDED_BY(mu_);
};

TEST(ServerStream, InputsReachTheBackendsSinkChunkByChunkBeforeSubmit) {
  SinkProbe* probe = nullptr;
  TestServer ts({}, {}, {}, [&probe](std::unique_ptr<server::Backend> inner) {
    auto p = std::make_unique<SinkProbe>(std::move(inner), false, 0);
    probe = p.get();
    return p;
  });
  ASSERT_NE(ts.server, nullptr);
  auto stub = ts.Stub();
  const v1::ForwardRequest r = MakeRequest({1, 300, 200, 4, 2, 64}, v1::MASK_TYPE_CAUSAL_TOP_LEFT, true, 78);
  grpc::ClientContext ctx;
  std::unique_ptr<Stream> stream = stub->ForwardStream(&ctx);
  ASSERT_TRUE(stream->Write(Header(r)));
  const uint64_t chunk = 7000;
  ASSERT_TRUE(WriteInterleaved(*stream, r, chunk));
  ASSERT_TRUE(stream->WritesDone());
  std::string o, lse;
  v1::ForwardStreamResponse m;
  while (stream->Read(&m)) {
    if (!m.has_chunk()) continue;
    (m.chunk().tensor() == v1::TENSOR_NAME_O ? o : lse) += m.chunk().data();
  }
  const grpc::Status s = stream->Finish();
  ASSERT_TRUE(s.ok()) << s.error_message();
  ExpectCorrect(r, o, lse);

  const SinkProbe::Seen seen = probe->seen();
  const uint64_t sizes[3] = {r.q().data().size(), r.k().data().size(), r.v().data().size()};
  EXPECT_EQ(seen.submits, 1);
  EXPECT_TRUE(seen.inputs_are_the_sink);
  uint64_t last[3] = {0, 0, 0};
  size_t reports = 0;
  for (const auto& [tensor, in_place] : seen.arrived) {
    ASSERT_TRUE(tensor >= 0 && tensor < 3) << tensor;
    EXPECT_EQ(seen.sizes[tensor], sizes[tensor]);
    // One report per chunk, each adding that chunk's bytes.
    EXPECT_EQ(in_place, std::min(last[tensor] + chunk, sizes[tensor])) << "tensor " << tensor;
    last[tensor] = in_place;
    ++reports;
  }
  for (int t = 0; t < 3; ++t) EXPECT_EQ(last[t], sizes[t]) << "tensor " << t << " never reported complete";
  EXPECT_EQ(reports, (sizes[0] + chunk - 1) / chunk + 2 * ((sizes[1] + chunk - 1) / chunk));
}

uint32_t StreamsReceiving(v1::Attention::Stub* stub) {
  grpc::ClientContext ctx;
  v1::ServerStats stats;
  EXPECT_TRUE(stub->GetStats(&ctx, v1::GetStatsRequest(), &stats).ok());
  return stats.streams_receiving();
}

TEST(ServerStream, GetStatsCountsStreamsStillReceiving) {
  TestServer ts;
  ASSERT_NE(ts.server, nullptr);
  auto stub = ts.Stub();
  EXPECT_EQ(StreamsReceiving(stub.get()), 0u);
  const v1::ForwardRequest r = MakeRequest({1, 64, 64, 2, 2, 64}, v1::MASK_TYPE_NONE, false, 80);
  // Two streams past their header with part of Q sent: one is finished, the other cancelled.
  grpc::ClientContext finished_ctx, cancelled_ctx;
  std::unique_ptr<Stream> finished = stub->ForwardStream(&finished_ctx);
  std::unique_ptr<Stream> cancelled = stub->ForwardStream(&cancelled_ctx);
  for (Stream* s : {finished.get(), cancelled.get()}) {
    ASSERT_TRUE(s->Write(Header(r)));
    ASSERT_TRUE(s->Write(Chunk(v1::TENSOR_NAME_Q, r.q().data(), 0, 1000)));
  }
  EXPECT_TRUE(testing::WaitFor([&] { return StreamsReceiving(stub.get()) == 2; }));
  cancelled_ctx.TryCancel();
  EXPECT_FALSE(cancelled->Finish().ok());
  EXPECT_TRUE(testing::WaitFor([&] { return StreamsReceiving(stub.get()) == 1; }));
  ASSERT_TRUE(finished->Write(Chunk(v1::TENSOR_NAME_Q, r.q().data(), 1000, r.q().data().size())));
  ASSERT_TRUE(finished->Write(Chunk(v1::TENSOR_NAME_K, r.k().data(), 0, r.k().data().size())));
  ASSERT_TRUE(finished->Write(Chunk(v1::TENSOR_NAME_V, r.v().data(), 0, r.v().data().size())));
  ASSERT_TRUE(finished->WritesDone());
  std::string o, lse;
  v1::ForwardStreamResponse m;
  while (finished->Read(&m)) {
    if (m.has_chunk()) (m.chunk().tensor() == v1::TENSOR_NAME_O ? o : lse) += m.chunk().data();
  }
  ASSERT_TRUE(finished->Finish().ok());
  ExpectCorrect(r, o, lse);
  EXPECT_EQ(StreamsReceiving(stub.get()), 0u);
}

TEST(ServerStream, AStalledStreamIsEndedAfterTheIdleTimeout) {
  server::ServerOptions opts;
  opts.timeouts.stream_idle_timeout = absl::Milliseconds(300);
  TestServer ts(opts);
  ASSERT_NE(ts.server, nullptr);
  auto stub = ts.Stub();
  std::mt19937_64 rng(81);
  const v1::ForwardRequest r = MakeRequest({1, 64, 64, 2, 2, 64}, v1::MASK_TYPE_NONE, false, rng());
  // One stream stalls after part of Q, one after opening without a header; a third keeps sending chunks
  // spaced closer than the timeout and is answered although it lasts longer than the timeout.
  grpc::ClientContext stalled_ctx, silent_ctx, slow_ctx;
  for (grpc::ClientContext* c : {&stalled_ctx, &silent_ctx}) {  // a failure ends in time, not in a hang
    c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  }
  std::unique_ptr<Stream> stalled = stub->ForwardStream(&stalled_ctx);
  std::unique_ptr<Stream> silent = stub->ForwardStream(&silent_ctx);
  std::unique_ptr<Stream> slow = stub->ForwardStream(&slow_ctx);
  const absl::Time start = absl::Now();
  ASSERT_TRUE(stalled->Write(Header(r)));
  ASSERT_TRUE(stalled->Write(Chunk(v1::TENSOR_NAME_Q, r.q().data(), 0, 1000)));
  ASSERT_TRUE(slow->Write(Header(r)));
  EXPECT_TRUE(testing::WaitFor([&] { return StreamsReceiving(stub.get()) == 2; }));
  // Each stalled stream's end as its client sees it, from when the streams opened.
  grpc::Status ended_status[2];
  absl::Duration ended_after[2];
  std::vector<std::thread> enders;
  Stream* stalled_streams[2] = {stalled.get(), silent.get()};
  for (int i = 0; i < 2; ++i) {
    enders.emplace_back([&, i] {
      v1::ForwardStreamResponse ignored;
      while (stalled_streams[i]->Read(&ignored)) {
      }
      ended_status[i] = stalled_streams[i]->Finish();
      ended_after[i] = absl::Now() - start;
    });
  }
  std::vector<v1::ForwardStreamRequest> chunks;
  for (const auto& [name, bytes] : {std::pair{v1::TENSOR_NAME_Q, &r.q().data()}, std::pair{v1::TENSOR_NAME_K, &r.k().data()},
                                    std::pair{v1::TENSOR_NAME_V, &r.v().data()}}) {
    for (uint64_t at = 0; at < bytes->size(); at += bytes->size() / 2) chunks.push_back(Chunk(name, *bytes, at, bytes->size() / 2));
  }
  for (const v1::ForwardStreamRequest& c : chunks) {
    absl::SleepFor(absl::Milliseconds(100));  // the client's pace, well inside the timeout
    ASSERT_TRUE(slow->Write(c));
  }
  ASSERT_TRUE(slow->WritesDone());
  std::string o, lse;
  v1::ForwardStreamResponse m;
  while (slow->Read(&m)) {
    if (m.has_chunk()) (m.chunk().tensor() == v1::TENSOR_NAME_O ? o : lse) += m.chunk().data();
  }
  const grpc::Status slow_status = slow->Finish();
  ASSERT_TRUE(slow_status.ok()) << slow_status.error_message();
  ExpectCorrect(r, o, lse);
  EXPECT_GT(absl::Now() - start, absl::Milliseconds(500));
  for (std::thread& t : enders) t.join();
  for (int i = 0; i < 2; ++i) {
    const grpc::Status& status = ended_status[i];
    EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << status.error_message();
    EXPECT_TRUE(absl::StrContains(status.error_message(), "stream_idle_timeout_s")) << status.error_message();
    std::printf("%s stream ended after %.0f ms (timeout 300 ms)\n", i == 0 ? "stalled" : "silent",
                absl::ToDoubleMilliseconds(ended_after[i]));
    EXPECT_GE(ended_after[i], absl::Milliseconds(290));
    EXPECT_LT(ended_after[i], absl::Seconds(2));
  }
  EXPECT_EQ(StreamsReceiving(stub.get()), 0u);
}

TEST(ServerStream, AnUploadSlowerThanItsTimeoutIsEnded) {
  // Chunks every 100 ms keep the stream clear of the idle timeout (300 ms), but the whole upload takes longer
  // than --upload_timeout_s (700 ms here): the stream is ended then, and its slot freed.
  server::ServerOptions opts;
  opts.timeouts.stream_idle_timeout = absl::Milliseconds(300);
  opts.timeouts.upload_timeout = absl::Milliseconds(700);
  TestServer ts(opts);
  ASSERT_NE(ts.server, nullptr);
  auto stub = ts.Stub();
  std::mt19937_64 rng(83);
  const v1::ForwardRequest r = MakeRequest({1, 64, 64, 2, 2, 64}, v1::MASK_TYPE_NONE, false, rng());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  std::unique_ptr<Stream> trickle = stub->ForwardStream(&ctx);
  const absl::Time start = absl::Now();
  ASSERT_TRUE(trickle->Write(Header(r)));
  const std::string& q = r.q().data();
  // 64 bytes at a time: the whole request would take far longer than the timeout.
  for (uint64_t at = 0; at < q.size() && absl::Now() - start < absl::Seconds(5); at += 64) {
    absl::SleepFor(absl::Milliseconds(100));
    if (!trickle->Write(Chunk(v1::TENSOR_NAME_Q, q, at, 64))) break;
  }
  v1::ForwardStreamResponse ignored;
  while (trickle->Read(&ignored)) {
  }
  const grpc::Status status = trickle->Finish();
  const absl::Duration took = absl::Now() - start;
  std::printf("trickled stream ended after %.0f ms (upload timeout 700 ms)\n", absl::ToDoubleMilliseconds(took));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << status.error_message();
  EXPECT_TRUE(absl::StrContains(status.error_message(), "upload_timeout_s")) << status.error_message();
  EXPECT_GE(took, absl::Milliseconds(690));
  EXPECT_LT(took, absl::Seconds(3));
  EXPECT_TRUE(testing::WaitFor([&] { return StreamsReceiving(stub.get()) == 0; }));
}

TEST(ServerStream, OneClientHoldsAtMostItsShareOfTheUploads) {
  // --max_queue=8: by default a client may hold a quarter of it (2) in uploads. On the unix socket each
  // connection is a client: the first holds two stalled uploads and its third is refused, naming the limit;
  // the second client's upload still gets a place and is answered.
  const std::string sock = "/tmp/attnd_uploads_" + std::to_string(::getpid()) + ".sock";
  server::ServerOptions opts;
  opts.network.unix_socket = sock;
  server::BackendOptions bo;
  bo.max_queue = 8;
  TestServer ts(opts, bo);
  ASSERT_NE(ts.server, nullptr);
  auto connect = [&] {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection of its own
    return v1::Attention::NewStub(grpc::CreateCustomChannel("unix:" + sock, grpc::InsecureChannelCredentials(), args));
  };
  auto greedy = connect(), other = connect();
  std::mt19937_64 rng(84);
  const v1::ForwardRequest r = MakeRequest({1, 32, 48, 2, 1, 64}, v1::MASK_TYPE_NONE, true, rng());
  grpc::ClientContext held_ctx[2];
  std::unique_ptr<Stream> held[2];
  for (int i = 0; i < 2; ++i) {
    held_ctx[i].set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    held[i] = greedy->ForwardStream(&held_ctx[i]);
    ASSERT_TRUE(held[i]->Write(Header(r)));
  }
  ASSERT_TRUE(testing::WaitFor([&] { return StreamsReceiving(greedy.get()) == 2; }));
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    std::unique_ptr<Stream> third = greedy->ForwardStream(&ctx);
    ASSERT_TRUE(third->Write(Header(r)));
    v1::ForwardStreamResponse m;
    EXPECT_FALSE(third->Read(&m));
    const grpc::Status refused = third->Finish();
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
    EXPECT_TRUE(absl::StrContains(refused.error_message(), "max_uploads_per_client")) << refused.error_message();
  }
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    std::unique_ptr<Stream> s = other->ForwardStream(&ctx);
    ASSERT_TRUE(s->Write(Header(r)));
    for (const auto& [name, bytes] : {std::pair{v1::TENSOR_NAME_Q, &r.q().data()}, std::pair{v1::TENSOR_NAME_K, &r.k().data()},
                                      std::pair{v1::TENSOR_NAME_V, &r.v().data()}}) {
      ASSERT_TRUE(s->Write(Chunk(name, *bytes, 0, bytes->size())));
    }
    ASSERT_TRUE(s->WritesDone());
    std::string o, lse;
    v1::ForwardStreamResponse m;
    while (s->Read(&m)) {
      if (m.has_chunk()) (m.chunk().tensor() == v1::TENSOR_NAME_O ? o : lse) += m.chunk().data();
    }
    const grpc::Status answered = s->Finish();
    ASSERT_TRUE(answered.ok()) << answered.error_message();
    ExpectCorrect(r, o, lse);
  }
  for (int i = 0; i < 2; ++i) held_ctx[i].TryCancel();
  for (int i = 0; i < 2; ++i) held[i]->Finish();
  EXPECT_TRUE(testing::WaitFor([&] { return StreamsReceiving(other.get()) == 0; }));
}

TEST(ServerStream, StreamsReceivingCountAgainstTheQueue) {
  server::BackendOptions bo;
  bo.threads = 1;
  bo.max_queue = 2;
  server::ServerOptions opts;
  opts.limits.max_uploads_per_client = 2;  // one client fills the queue here
  TestServer ts(opts, bo);
  ASSERT_NE(ts.server, nullptr);
  auto stub = ts.Stub();
  std::mt19937_64 rng(82);
  const v1::ForwardRequest r = MakeRequest({1, 32, 48, 2, 1, 64}, v1::MASK_TYPE_NONE, true, rng());
  // Two uploads in progress fill --max_queue=2: a third stream's header and a unary call are refused.
  grpc::ClientContext ctx[3];
  std::unique_ptr<Stream> streams[3];
  for (int i = 0; i < 2; ++i) {
    streams[i] = stub->ForwardStream(&ctx[i]);
    ASSERT_TRUE(streams[i]->Write(Header(r)));
  }
  ASSERT_TRUE(testing::WaitFor([&] { return StreamsReceiving(stub.get()) == 2; }));
  ctx[2].set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));  // a failure, not a hang
  streams[2] = stub->ForwardStream(&ctx[2]);
  ASSERT_TRUE(streams[2]->Write(Header(r)));
  v1::ForwardStreamResponse m;
  EXPECT_FALSE(streams[2]->Read(&m));
  const grpc::Status refused = streams[2]->Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  EXPECT_TRUE(absl::StrContains(refused.error_message(), "max_queue")) << refused.error_message();
  {
    grpc::ClientContext uctx;
    v1::ForwardResponse resp;
    const grpc::Status s = stub->Forward(&uctx, r, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  }
  // Both admitted uploads complete and are answered: their places were held.
  for (int i = 0; i < 2; ++i) {
    for (const auto& [name, bytes] : {std::pair{v1::TENSOR_NAME_Q, &r.q().data()}, std::pair{v1::TENSOR_NAME_K, &r.k().data()},
                                      std::pair{v1::TENSOR_NAME_V, &r.v().data()}}) {
      ASSERT_TRUE(streams[i]->Write(Chunk(name, *bytes, 0, bytes->size())));
    }
    ASSERT_TRUE(streams[i]->WritesDone());
  }
  for (int i = 0; i < 2; ++i) {
    std::string o, lse;
    while (streams[i]->Read(&m)) {
      if (m.has_chunk()) (m.chunk().tensor() == v1::TENSOR_NAME_O ? o : lse) += m.chunk().data();
    }
    const grpc::Status s = streams[i]->Finish();
    ASSERT_TRUE(s.ok()) << s.error_message();
    ExpectCorrect(r, o, lse);
  }
  grpc::ClientContext uctx;
  v1::ForwardResponse resp;
  ASSERT_TRUE(stub->Forward(&uctx, r, &resp).ok());
}

TEST(ServerStream, ASinkThatRefusesEndsTheStreamWithItsStatus) {
  const v1::ForwardRequest r = MakeRequest({1, 64, 64, 2, 2, 64}, v1::MASK_TYPE_NONE, false, 79);
  std::vector<v1::ForwardStreamRequest> messages = {Header(r)};
  const std::pair<v1::TensorName, const std::string*> inputs[3] = {
      {v1::TENSOR_NAME_Q, &r.q().data()}, {v1::TENSOR_NAME_K, &r.k().data()}, {v1::TENSOR_NAME_V, &r.v().data()}};
  for (const auto& [name, bytes] : inputs) {
    for (uint64_t at = 0; at < bytes->size(); at += 4096) messages.push_back(Chunk(name, *bytes, at, 4096));
  }
  for (const bool refuse_open : {true, false}) {
    SinkProbe* probe = nullptr;
    TestServer ts({}, {}, {}, [&](std::unique_ptr<server::Backend> inner) {
      auto p = std::make_unique<SinkProbe>(std::move(inner), refuse_open, refuse_open ? 0 : 3);
      probe = p.get();
      return p;
    });
    ASSERT_NE(ts.server, nullptr);
    auto stub = ts.Stub();
    const grpc::Status s = RunStream(stub.get(), messages);
    EXPECT_EQ(s.error_code(), refuse_open ? grpc::StatusCode::RESOURCE_EXHAUSTED : grpc::StatusCode::DATA_LOSS)
        << s.error_message();
    EXPECT_TRUE(absl::StrContains(s.error_message(), "test ")) << s.error_message();
    EXPECT_EQ(probe->seen().submits, 0);
    // The server carries on: the same request without the probe's refusal is answered.
    grpc::ClientContext ctx;
    v1::ForwardResponse resp;
    ASSERT_TRUE(stub->Forward(&ctx, r, &resp).ok());
    ExpectCorrect(r, resp.o(), resp.lse());
  }
}

TEST(ServerStream, MalformedStreamsNameTheTensor) {
  TestServer ts;
  ASSERT_NE(ts.server, nullptr);
  auto stub = ts.Stub();
  const v1::ForwardRequest r = MakeRequest({1, 8, 8, 2, 1, 64}, v1::MASK_TYPE_NONE, false, 3);
  const std::string& q = r.q().data();
  const std::string& k = r.k().data();
  const std::string& v = r.v().data();
  const uint64_t qn = q.size(), kn = k.size(), vn = v.size();
  auto full = [&](int skip = -1) {
    std::vector<v1::ForwardStreamRequest> m;
    if (skip != 0) m.push_back(Chunk(v1::TENSOR_NAME_Q, q, 0, qn));
    if (skip != 1) m.push_back(Chunk(v1::TENSOR_NAME_K, k, 0, kn));
    if (skip != 2) m.push_back(Chunk(v1::TENSOR_NAME_V, v, 0, vn));
    return m;
  };
  struct Bad {
    const char* name;
    std::vector<v1::ForwardStreamRequest> messages;
    std::string prefix;
  };
  std::vector<Bad> bad;
  bad.push_back({"chunk_before_header", {Chunk(v1::TENSOR_NAME_Q, q, 0, qn)}, "header:"});
  bad.push_back({"no_messages", {}, "header:"});
  {
    auto m = full();
    m.insert(m.begin(), Header(r));
    m.insert(m.begin() + 1, Header(r));
    bad.push_back({"two_headers", m, "header:"});
  }
  {
    std::vector<v1::ForwardStreamRequest> m = {Header(r), Chunk(v1::TENSOR_NAME_Q, q, 0, 100),
                                               Chunk(v1::TENSOR_NAME_Q, q, 200, 100)};
    bad.push_back({"gap", m, "q chunk.offset:"});
  }
  {
    std::vector<v1::ForwardStreamRequest> m = {Header(r), Chunk(v1::TENSOR_NAME_K, k, 0, 100),
                                               Chunk(v1::TENSOR_NAME_K, k, 50, 100)};
    bad.push_back({"overlap", m, "k chunk.offset:"});
  }
  {
    std::vector<v1::ForwardStreamRequest> m = {Header(r), Chunk(v1::TENSOR_NAME_V, v, 0, vn)};
    m.push_back(Chunk(v1::TENSOR_NAME_V, v, 0, 10));
    m.back().mutable_chunk()->set_offset(vn);
    bad.push_back({"duplicate_past_end", m, "v chunk.data:"});
  }
  {
    std::vector<v1::ForwardStreamRequest> m = {Header(r), Chunk(v1::TENSOR_NAME_Q, q, 0, qn)};
    m.back().mutable_chunk()->mutable_data()->append("extra");
    bad.push_back({"too_long", m, "q chunk.data:"});
  }
  {
    auto m = full(/*skip=*/1);
    m.insert(m.begin(), Header(r));
    bad.push_back({"k_missing", m, "k:"});
  }
  {
    auto m = full();
    m.insert(m.begin(), Header(r));
    m.back() = Chunk(v1::TENSOR_NAME_V, v, 0, vn - 2);
    bad.push_back({"v_short_at_end", m, "v:"});
  }
  {
    auto m = full();
    m.insert(m.begin(), Header(r));
    m.push_back(Chunk(v1::TENSOR_NAME_O, q, 0, 16));
    bad.push_back({"output_tensor", m, "chunk.tensor:"});
  }
  {
    auto m = full();
    m.insert(m.begin(), Header(r));
    m.push_back(Chunk(static_cast<v1::TensorName>(42), q, 0, 16));
    bad.push_back({"unknown_tensor", m, "chunk.tensor:"});
  }
  {
    auto m = full();
    v1::ForwardStreamRequest h = Header(r);
    *h.mutable_header()->mutable_q() = r.q();
    m.insert(m.begin(), h);
    bad.push_back({"inline_in_header", m, "q.data:"});
  }
  {
    v1::ForwardStreamRequest h = Header(r);
    h.mutable_header()->mutable_shape()->set_head_dim(80);
    bad.push_back({"bad_header_shape", {h}, "shape.head_dim:"});
  }
  {
    // Enums have no default: a header that leaves one unset (as a JSON client's misspelled name arrives) is refused.
    v1::ForwardStreamRequest h = Header(r);
    h.mutable_header()->clear_dtype();
    auto m = full();
    m.insert(m.begin(), h);
    bad.push_back({"header_dtype_unset", m, "dtype: DTYPE_UNSPECIFIED"});
    h = Header(r);
    h.mutable_header()->clear_mask();
    m = full();
    m.insert(m.begin(), h);
    bad.push_back({"header_mask_unset", m, "mask: MASK_TYPE_UNSPECIFIED"});
  }
  {
    auto m = full();
    m.insert(m.begin(), Header(r));
    m.push_back(Chunk(v1::TENSOR_NAME_UNSPECIFIED, q, 0, 16));
    bad.push_back({"unspecified_tensor", m, "chunk.tensor:"});
  }
  bad.push_back({"empty_message", {Header(r), v1::ForwardStreamRequest()}, "message:"});
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.name);
    const grpc::Status s = RunStream(stub.get(), b.messages);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_TRUE(absl::StartsWith(s.error_message(), b.prefix)) << s.error_message();
  }
  EXPECT_EQ(ts.cpu->jobs_computed(), 0u);
  // And the well-formed stream of the same request works, with empty chunks tolerated.
  auto good = full();
  good.insert(good.begin(), Header(r));
  good.insert(good.begin() + 1, Chunk(v1::TENSOR_NAME_Q, q, 0, 0));
  EXPECT_TRUE(RunStream(stub.get(), good).ok());
}

TEST(ServerStream, EveryProtobufEncodingOfAChunkIsAccepted) {
  // The server reads chunks written the canonical way straight from gRPC's slices and leaves any other
  // valid encoding to protobuf: both must give the same answer.
  TestServer ts;
  ASSERT_NE(ts.server, nullptr);
  const v1::ForwardRequest r = MakeRequest({1, 40, 40, 2, 2, 64}, v1::MASK_TYPE_CAUSAL_TOP_LEFT, true, 21);
  const std::string& q = r.q().data();
  const uint64_t half = q.size() / 2;
  // Q's first half with the fields in reverse order, its second half with `offset` given twice (protobuf:
  // the last one counts).
  std::string reversed;
  {
    v1::TensorChunk data_only, head_only;
    data_only.set_data(q.substr(0, half));
    head_only.set_tensor(v1::TENSOR_NAME_Q);
    const std::string inner = data_only.SerializeAsString() + head_only.SerializeAsString();
    google::protobuf::io::StringOutputStream sink(&reversed);
    google::protobuf::io::CodedOutputStream out(&sink);
    out.WriteVarint32(2 << 3 | 2);
    out.WriteVarint32(static_cast<uint32_t>(inner.size()));
    out.WriteString(inner);
  }
  v1::ForwardStreamRequest second = Chunk(v1::TENSOR_NAME_Q, q, half, q.size() - half);
  v1::TensorChunk wrong_offset;
  wrong_offset.set_offset(12345);
  const std::string twice = [&] {
    // chunk{offset: 12345} then chunk{tensor, offset: half, data}: the two chunk fields merge, the later
    // offset wins.
    v1::ForwardStreamRequest first;
    *first.mutable_chunk() = wrong_offset;
    return first.SerializeAsString() + second.SerializeAsString();
  }();
  const std::vector<std::string> messages = {Header(r).SerializeAsString(), reversed, twice,
                                             Chunk(v1::TENSOR_NAME_K, r.k().data(), 0, r.k().data().size()).SerializeAsString(),
                                             Chunk(v1::TENSOR_NAME_V, r.v().data(), 0, r.v().data().size()).SerializeAsString()};
  const testing::RawResult res = testing::RawCall(ts.Channel(), "/attnd.v1.Attention/ForwardStream", messages);
  ASSERT_TRUE(res.status.ok()) << res.status.error_message();
  std::string o, lse;
  ASSERT_GE(res.messages.size(), 2u);
  for (size_t i = 1; i < res.messages.size(); ++i) {
    v1::ForwardStreamResponse m;
    ASSERT_TRUE(m.ParseFromString(res.messages[i]));
    (m.chunk().tensor() == v1::TENSOR_NAME_O ? o : lse) += m.chunk().data();
  }
  ExpectCorrect(r, o, lse);
}

TEST(ServerStream, GarbledChunksAreRefusedAndTheServerCarriesOn) {
  // Random bytes, and valid chunks with bits flipped, after a valid header: each stream ends with an error
  // status (never OK: the tensors are never complete) and the server keeps serving.
  TestServer ts;
  ASSERT_NE(ts.server, nullptr);
  const v1::ForwardRequest r = MakeRequest({1, 8, 8, 2, 1, 64}, v1::MASK_TYPE_NONE, false, 22);
  const std::string header = Header(r).SerializeAsString();
  const std::string chunk = Chunk(v1::TENSOR_NAME_Q, r.q().data(), 0, 64).SerializeAsString();
  std::mt19937 rng(7);
  for (int i = 0; i < 60; ++i) {
    std::string garbled;
    if (i % 2 == 0) {
      garbled.resize(rng() % 80);
      for (char& c : garbled) c = static_cast<char>(rng());
    } else {
      garbled = chunk;
      for (int flips = 1 + static_cast<int>(rng() % 3); flips > 0; --flips) {
        garbled[rng() % garbled.size()] ^= static_cast<char>(1u << (rng() % 8));
      }
    }
    const testing::RawResult res =
        testing::RawCall(ts.Channel(), "/attnd.v1.Attention/ForwardStream", {header, garbled});
    EXPECT_FALSE(res.status.ok()) << "message " << i;
    EXPECT_NE(res.status.error_code(), grpc::StatusCode::UNKNOWN) << "message " << i << ": " << res.status.error_message();
  }
  auto stub = ts.Stub();
  grpc::ClientContext ctx;
  v1::ForwardResponse resp;
  ASSERT_TRUE(stub->Forward(&ctx, r, &resp).ok());
  ExpectCorrect(r, resp.o(), resp.lse());
}

}  // namespace
}  // namespace attnd
