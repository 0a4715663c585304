// Many clients at once, and a shutdown with requests in flight: every call accepted before Shutdown must be
// answered OK and correctly.
#include <atomic>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "e2e_util.h"

namespace attnd::e2e {
namespace {

TEST(E2eConcurrency, SixteenClientsAllCorrect) {
  TestServer srv;
  StartServer(&srv);
  ASSERT_NE(srv.server, nullptr);
  constexpr int kClients = 16, kCallsEach = 3;
  std::vector<std::string> failures(kClients);
  std::vector<int> ok(kClients, 0);
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      // Half over TCP, half over the unix socket; each client has its own connection.
      auto client = Connect(srv.Target(i % 2 ? Listener::kUnix : Listener::kTcp), client::Transport::kAuto, 0,
                            /*own_connection=*/true);
      if (client == nullptr) {
        failures[i] = "no client";
        return;
      }
      for (int j = 0; j < kCallsEach; ++j) {
        const Case c = MakeCase(Spec(1, 24 + i, 40 + j, 4, i % 4 == 0 ? 1 : 4, j % 2 ? 64 : 128,
                                     static_cast<Mask>((i + j) % 3), j == 0),
                                1000 + i * 10 + j);
        const std::string why = CheckReply(c, client->Forward(*c.request));
        if (!why.empty()) {
          failures[i] = why;
          return;
        }
        ++ok[i];
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kClients; ++i) {
    EXPECT_EQ(failures[i], "") << "client " << i;
    EXPECT_EQ(ok[i], kCallsEach) << "client " << i;
  }
  srv.server->Shutdown();
}

TEST(E2eConcurrency, ShutdownWithRequestsInFlightLosesNone) {
  TestServer srv;
  // One worker, so most requests are still queued when Shutdown begins.
  StartServer(&srv, 64ull << 20, /*threads=*/1);
  ASSERT_NE(srv.server, nullptr);
  auto client = Connect(srv.Target(Listener::kTcp));
  ASSERT_NE(client, nullptr);
  constexpr int kCalls = 12;
  std::vector<Case> cases;
  for (int i = 0; i < kCalls; ++i) cases.push_back(MakeCase(Spec(1, 192, 192, 4, 2, 128, Mask::kNone, i % 2), 50 + i));

  absl::Mutex mu;
  int finished = 0;
  std::vector<std::string> verdicts(kCalls, "not answered");
  for (int i = 0; i < kCalls; ++i) {
    // Streaming for every other call: an accepted stream must survive shutdown too.
    client::CallOptions call;
    call.transport = i % 2 ? client::Transport::kStream : client::Transport::kUnary;
    client->ForwardAsync(
        cases[i].request,
        [&, i](absl::StatusOr<client::ForwardResult> r) {
          const std::string why = CheckReply(cases[i], r);
          absl::MutexLock lock(&mu);
          verdicts[i] = why;
          ++finished;
        },
        call);
  }
  // Shut down once the server has accepted every call (those not yet answered are in flight there).
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  for (;;) {
    auto stats = client->Stats();
    ASSERT_TRUE(stats.ok()) << stats.status();
    int done;
    {
      absl::MutexLock lock(&mu);
      done = finished;
    }
    if (static_cast<int>(stats->in_flight()) + done >= kCalls) {
      ASSERT_LT(done, kCalls) << "every call finished before shutdown: the test proves nothing; make them slower";
      break;
    }
    ASSERT_LT(absl::Now(), give_up) << "the server never accepted all calls";
    absl::SleepFor(absl::Milliseconds(2));
  }
  int before;
  {
    absl::MutexLock lock(&mu);
    before = finished;
  }
  srv.server->Shutdown();  // returns after every accepted request got its reply
  srv.server->Wait();
  {
    absl::MutexLock lock(&mu);
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(+[](int* f) { return *f == kCalls; }, &finished), absl::Seconds(30)))
        << finished << " of " << kCalls << " answered";
  }
  for (int i = 0; i < kCalls; ++i) EXPECT_EQ(verdicts[i], "") << "call " << i;
  EXPECT_LT(before, kCalls);
  // After shutdown new calls are refused, not hung.
  client::CallOptions quick;
  quick.deadline = absl::Seconds(5);
  auto late = client->Forward(*cases[0].request, quick);
  EXPECT_FALSE(late.ok());
}

}  // namespace
}  // namespace attnd::e2e
