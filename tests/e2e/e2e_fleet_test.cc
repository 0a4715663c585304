// A fleet of servers as one: three CPU servers on loopback ports, each advertising its own address, and one client
// whose target names all three (ipv4:a,b,c). Forwards and new sequences are spread by round robin, every call
// about a sequence reaches the server that holds it, and an open that one server refuses for room goes to the next.
#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "e2e_sequences_util.h"
#include "e2e_util.h"

namespace attnd::e2e {
namespace {

class Fleet : public ::testing::Test {
 protected:
  static constexpr int kServers = 3;

  // Starts the servers, each with `max_per_client` sequences per client (0: no limit), and the fleet client.
  void Start(uint32_t max_per_client = 0) {
    std::vector<std::string> addresses;
    for (int i = 0; i < kServers; ++i) {
      const int port = FreeLoopbackPort();
      ASSERT_GT(port, 0);
      const std::string address = absl::StrCat("127.0.0.1:", port);
      server::ServerOptions so;
      so.network.listen = address;
      so.sequences.advertise_address = address;
      so.sequences.max_per_client = max_per_client;
      server::BackendOptions bo;
      bo.threads = 2;
      ServeOnCpu(&servers_[i], so, bo, nullptr);
      if (HasFatalFailure()) return;
      direct_[i] = Connect(address);
      ASSERT_NE(direct_[i], nullptr);
      addresses.push_back(address);
      index_[address] = i;
    }
    target_ = absl::StrCat("ipv4:", absl::StrJoin(addresses, ","));
    fleet_ = Connect(target_);
    ASSERT_NE(fleet_, nullptr);
  }
  void TearDown() override {
    fleet_.reset();
    for (int i = 0; i < kServers; ++i) {
      direct_[i].reset();
      if (servers_[i].server != nullptr) servers_[i].server->Shutdown();
    }
  }

  // Forward calls served by server i so far.
  uint64_t Forwards(int i) {
    auto stats = direct_[i]->Stats();
    EXPECT_TRUE(stats.ok()) << stats.status();
    if (!stats.ok()) return 0;
    for (const v1::RpcStats& r : stats->rpcs()) {
      if (r.method() == "Forward") return r.count();
    }
    return 0;
  }
  // Round robin spreads calls over the servers it has connected to: until every one has served a call, the
  // first calls may all go to the first server up.
  void AwaitEveryServer(const Case& c) {
    for (int attempt = 0; attempt < 200; ++attempt) {
      bool all = true;
      for (int i = 0; i < kServers; ++i) all = all && Forwards(i) > 0;
      if (all) return;
      ASSERT_EQ(CheckReply(c, fleet_->Forward(*c.request)), "");
    }
    FAIL() << "round robin never reached every server";
  }

  // New sequences (a few per server) all land on servers other than `gone`.
  void ExpectNewOpensAvoid(const client::SequenceShape& shape, const std::string& gone) {
    for (int n = 0; n < 2 * kServers; ++n) {
      client::CallOptions call;
      call.deadline = absl::Seconds(5);
      auto opened = fleet_->OpenSequence(shape, 0, 1, call);
      ASSERT_TRUE(opened.ok()) << opened.status();
      EXPECT_NE(client::SequenceAddress(opened->ids[0]), gone);
    }
  }

  TestServer servers_[kServers];
  std::unique_ptr<client::Client> direct_[kServers];
  std::map<std::string, int> index_;  // advertised address -> server
  std::string target_;
  std::unique_ptr<client::Client> fleet_;
};

TEST_F(Fleet, ForwardsAndSequencesAreSpreadAndStepsFollowTheirSequence) {
  Start();
  ASSERT_FALSE(HasFatalFailure());
  const Case c = MakeCase(Spec(1, 16, 40, 4, 2, 64), 5);
  AwaitEveryServer(c);
  ASSERT_FALSE(HasFatalFailure());
  uint64_t before[kServers];
  for (int i = 0; i < kServers; ++i) before[i] = Forwards(i);
  constexpr int kCalls = 30;
  for (int n = 0; n < kCalls; ++n) ASSERT_EQ(CheckReply(c, fleet_->Forward(*c.request)), "");
  for (int i = 0; i < kServers; ++i) {
    const uint64_t served = Forwards(i) - before[i];
    EXPECT_GE(served, 9u) << "server " << i;
    EXPECT_LE(served, 11u) << "server " << i;
  }

  // Sequences opened one by one land round robin, and every call about one reaches its server.
  const client::SequenceShape shape = TestShape(1);
  std::vector<std::string> ids;
  int per_server[kServers] = {};
  for (int n = 0; n < kCalls; ++n) {
    auto opened = fleet_->OpenSequence(shape);
    ASSERT_TRUE(opened.ok()) << opened.status();
    const std::string address = client::SequenceAddress(opened->ids[0]);
    ASSERT_EQ(index_.count(address), 1u) << opened->ids[0];
    ++per_server[index_[address]];
    ids.push_back(opened->ids[0]);
  }
  for (int i = 0; i < kServers; ++i) {
    EXPECT_GE(per_server[i], 9) << "server " << i;
    EXPECT_LE(per_server[i], 11) << "server " << i;
    auto stats = direct_[i]->Stats();
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->sequences().open(), static_cast<uint64_t>(per_server[i]));
  }
  for (size_t n = 0; n < ids.size(); ++n) {
    SCOPED_TRACE(ids[n]);
    for (int step = 0; step < 2; ++step) {
      OneTokenStep s(shape, ids[n], 100 * n + 10 * step);
      auto r = fleet_->Step(s.spec);
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_EQ(r->lengths, std::vector<int64_t>({step + 1}));
    }
  }
  ASSERT_TRUE(fleet_->CloseSequence({ids[0]}).ok());
  auto gone = fleet_->GetSequence(ids[0]);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound) << gone.status();
  // A close names one server: the fleet's sequences go server by server.
  std::map<std::string, std::vector<std::string>> by_server;
  for (size_t n = 1; n < ids.size(); ++n) by_server[client::SequenceAddress(ids[n])].push_back(ids[n]);
  for (const auto& [address, of_server] : by_server) {
    ASSERT_TRUE(fleet_->CloseSequence(of_server).ok()) << address;
  }
  for (int i = 0; i < kServers; ++i) {
    auto stats = direct_[i]->Stats();
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->sequences().open(), 0u);
  }
}

// A server without room (here: its per-client limit reached) passes the open on; once every server has
// refused, the error names each one's reason.
TEST_F(Fleet, AnOpenAServerHasNoRoomForGoesToAnother) {
  Start(/*max_per_client=*/2);
  ASSERT_FALSE(HasFatalFailure());
  const client::SequenceShape shape = TestShape(1);
  int per_server[kServers] = {};
  std::vector<std::string> ids;
  for (int n = 0; n < 2 * kServers; ++n) {
    auto opened = fleet_->OpenSequence(shape);
    ASSERT_TRUE(opened.ok()) << "open " << n << ": " << opened.status();
    ++per_server[index_[client::SequenceAddress(opened->ids[0])]];
    ids.push_back(opened->ids[0]);
  }
  for (int i = 0; i < kServers; ++i) EXPECT_EQ(per_server[i], 2) << "server " << i;
  auto full = fleet_->OpenSequence(shape);
  ASSERT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted) << full.status();
  EXPECT_TRUE(absl::StrContains(full.status().message(), "every server of " + target_)) << full.status();
  for (int i = 0; i < kServers; ++i) {
    EXPECT_TRUE(absl::StrContains(full.status().message(), absl::StrCat("127.0.0.1:", servers_[i].port)))
        << full.status();
  }
  EXPECT_TRUE(absl::StrContains(full.status().message(), "--max_sequences_per_client")) << full.status();
  // Room on one server again: the next open finds it, wherever round robin starts.
  ASSERT_TRUE(fleet_->CloseSequence({ids[0]}).ok());
  auto again = fleet_->OpenSequence(shape);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(client::SequenceAddress(again->ids[0]), client::SequenceAddress(ids[0]));
}

// A server that goes away takes its sequences with it: their calls fail UNAVAILABLE naming it, the others' go
// on, and new sequences go to the servers left.
TEST_F(Fleet, AServerThatLeavesIsNamedAndAvoided) {
  Start();
  ASSERT_FALSE(HasFatalFailure());
  const client::SequenceShape shape = TestShape(1);
  std::vector<std::string> ids;
  for (int n = 0; n < 2 * kServers; ++n) {
    auto opened = fleet_->OpenSequence(shape);
    ASSERT_TRUE(opened.ok()) << opened.status();
    ids.push_back(opened->ids[0]);
  }
  const std::string gone_address = client::SequenceAddress(ids[0]);
  const int gone = index_[gone_address];
  direct_[gone].reset();
  servers_[gone].server->Shutdown();
  servers_[gone].server.reset();
  int elsewhere = 0, carried_on = 0;
  for (size_t n = 0; n < ids.size(); ++n) {
    elsewhere += client::SequenceAddress(ids[n]) != gone_address;
    OneTokenStep s(shape, ids[n], 7 * n);
    client::CallOptions call;
    call.deadline = absl::Seconds(5);
    auto r = fleet_->Step(s.spec, call);
    if (client::SequenceAddress(ids[n]) == gone_address) {
      EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
      EXPECT_TRUE(absl::StrContains(r.status().message(),
                                    absl::StrCat("the server holding the sequence (", gone_address, ")")))
          << r.status();
    } else {
      EXPECT_TRUE(r.ok()) << r.status();
      ++carried_on;
    }
  }
  EXPECT_EQ(carried_on, elsewhere);
  ExpectNewOpensAvoid(shape, gone_address);
}

// The same under load: callers step their sequences on every server, each step checked against the reference,
// when one server goes. Only that server's sequences fail (UNAVAILABLE naming it); every other sequence keeps
// stepping with right answers, and new sequences avoid the server that left.
TEST_F(Fleet, AServerThatLeavesUnderLoadTakesOnlyItsOwnSequences) {
  Start();
  ASSERT_FALSE(HasFatalFailure());
  const client::SequenceShape shape = TestShape(1);
  constexpr int kCallers = 3, kPerCaller = 3;
  struct Owned {
    std::string id, k, v;
    int ok_after_leave = 0;
    absl::Status failure;
  };
  std::vector<std::vector<Owned>> owned(kCallers);
  for (auto& mine : owned) {
    for (int n = 0; n < kPerCaller; ++n) {
      auto opened = fleet_->OpenSequence(shape);
      ASSERT_TRUE(opened.ok()) << opened.status();
      mine.push_back({opened->ids[0], "", "", 0, absl::OkStatus()});
    }
  }
  const std::string gone_address = client::SequenceAddress(owned[0][0].id);
  std::atomic<bool> stop{false}, left{false};
  std::atomic<int> wrong{0};
  const auto caller = [&](int c) {
    uint64_t seed = 1000 * (c + 1);
    while (!stop.load()) {
      for (Owned& o : owned[c]) {
        if (!o.failure.ok()) continue;
        const bool after = left.load();
        OneTokenStep s(shape, o.id, seed += 3);
        client::CallOptions call;
        call.deadline = absl::Seconds(5);
        auto r = fleet_->Step(s.spec, call);
        if (!r.ok()) {
          o.failure = r.status();
          continue;
        }
        o.k += s.k;
        o.v += s.v;
        if (!CheckRows(shape, kQHeads, s.q, o.k, o.v, r->o, "", false).empty()) ++wrong;
        if (after) ++o.ok_after_leave;
      }
    }
  };
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) callers.emplace_back(caller, c);
  absl::SleepFor(absl::Milliseconds(300));
  const int gone = index_[gone_address];
  direct_[gone].reset();
  servers_[gone].server->Shutdown();
  servers_[gone].server.reset();
  left = true;
  absl::SleepFor(absl::Milliseconds(500));
  stop = true;
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(wrong.load(), 0);
  int lost = 0;
  for (const auto& mine : owned) {
    for (const Owned& o : mine) {
      SCOPED_TRACE(o.id);
      if (client::SequenceAddress(o.id) == gone_address) {
        ++lost;
        EXPECT_EQ(o.failure.code(), absl::StatusCode::kUnavailable) << o.failure;
        EXPECT_TRUE(absl::StrContains(o.failure.message(), gone_address)) << o.failure;
      } else {
        EXPECT_TRUE(o.failure.ok()) << o.failure;
        EXPECT_GT(o.ok_after_leave, 0);
      }
    }
  }
  EXPECT_GT(lost, 0);
  EXPECT_LT(lost, kCallers * kPerCaller);
  ExpectNewOpensAvoid(shape, gone_address);
}

// A server on a free loopback port advertising it, with `drain` as its --sequence_drain_s.
void StartAdvertised(TestServer* out, absl::Duration drain, absl::Duration grace = absl::Seconds(30)) {
  const int port = FreeLoopbackPort();
  ASSERT_GT(port, 0);
  server::ServerOptions so;
  so.network.listen = absl::StrCat("127.0.0.1:", port);
  so.sequences.advertise_address = so.network.listen;
  so.timeouts.sequence_drain = drain;
  so.timeouts.shutdown_grace = grace;
  server::BackendOptions bo;
  bo.threads = 2;
  ServeOnCpu(out, so, bo, nullptr);
}

// A server asked to stop drains its sequences first: it serves them until their callers close them, while new
// ones go to the rest of the fleet; then it stops, without waiting out the drain.
TEST(FleetDrain, OpenSequencesAreServedUntilClosedAndNewOnesGoElsewhere) {
  TestServer leaving, staying;
  StartAdvertised(&leaving, absl::Seconds(20));
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  StartAdvertised(&staying, absl::ZeroDuration());
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  const std::string leaving_address = absl::StrCat("127.0.0.1:", leaving.port);
  auto fleet = Connect(absl::StrCat("ipv4:", leaving_address, ",127.0.0.1:", staying.port));
  auto direct = Connect(leaving_address);
  ASSERT_NE(fleet, nullptr);
  ASSERT_NE(direct, nullptr);
  const client::SequenceShape shape = TestShape(1);
  auto held = direct->OpenSequence(shape, 0, 2);
  ASSERT_TRUE(held.ok()) << held.status();

  const absl::Time asked = absl::Now();
  std::thread stop([&] { leaving.server->Shutdown(); });
  // The drain has begun once the server refuses new sequences (one opened before then is held like the rest).
  std::vector<std::string> ids = held->ids;
  absl::Status refusal;
  for (int i = 0; i < 200; ++i) {
    auto probe = direct->OpenSequence(shape);
    refusal = probe.status();
    if (!probe.ok()) break;
    ids.push_back(probe->ids[0]);
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(refusal.code(), absl::StatusCode::kUnavailable) << refusal;
  EXPECT_TRUE(absl::StrContains(refusal.message(), "draining")) << refusal;
  // Its health says NOT_SERVING, which the fleet client's balancer watches: no new call goes there.
  const auto forwards = [&](client::Client& c) -> uint64_t {
    auto stats = c.Stats();
    EXPECT_TRUE(stats.ok()) << stats.status();
    for (const v1::RpcStats& r : stats.ok() ? stats->rpcs() : decltype(stats->rpcs()){}) {
      if (r.method() == "Forward") return r.count();
    }
    return 0;
  };
  const uint64_t leaving_forwards = forwards(*direct);
  const Case c = MakeCase(Spec(1, 8, 24, 4, 2, 64), 9);
  for (int n = 0; n < 10; ++n) ASSERT_EQ(CheckReply(c, fleet->Forward(*c.request)), "");
  EXPECT_EQ(forwards(*direct), leaving_forwards);
  for (int n = 0; n < 4; ++n) {
    auto opened = fleet->OpenSequence(shape);
    ASSERT_TRUE(opened.ok()) << opened.status();
    EXPECT_EQ(client::SequenceAddress(opened->ids[0]), absl::StrCat("127.0.0.1:", staying.port));
  }
  for (size_t n = 0; n < ids.size(); ++n) {
    OneTokenStep s(shape, ids[n], 30 + 3 * n);
    auto r = fleet->Step(s.spec);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->lengths, std::vector<int64_t>({1}));
  }
  ASSERT_TRUE(fleet->CloseSequence(ids).ok());
  stop.join();
  EXPECT_LT(absl::Now() - asked, absl::Seconds(10)) << "the stop waited out the drain";
  staying.server->Shutdown();
}

// Sequences still open when the drain runs out are lost with the server, which then stops.
TEST(FleetDrain, TheDrainIsBounded) {
  TestServer srv;
  StartAdvertised(&srv, absl::Milliseconds(500));
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  auto c = Connect(absl::StrCat("127.0.0.1:", srv.port));
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->OpenSequence(TestShape(1)).ok());
  const absl::Time asked = absl::Now();
  srv.server->Shutdown();
  const absl::Duration took = absl::Now() - asked;
  EXPECT_GE(took, absl::Milliseconds(450));
  EXPECT_LT(took, absl::Seconds(10));
}

// One server's target is not a fleet: its refusal comes back as it is, after one call.
TEST(FleetClient, OneServerRefusalIsItsOwn) {
  server::SequenceOptions so;
  so.max_per_client = 1;
  TestServer srv;
  StartSequenceServer(&srv, so);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  auto c = Connect(srv.Target(Listener::kTcp));
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->OpenSequence(TestShape(1)).ok());
  auto refused = c->OpenSequence(TestShape(1));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_TRUE(absl::StartsWith(refused.status().message(), "count:")) << refused.status();
  srv.server->Shutdown();
}

}  // namespace
}  // namespace attnd::e2e
