// A server that drains by moving its own sequences (--sequence_drain_to): the attnd binary, SIGTERMed under load
// in a fleet of three, moves every sequence it holds to the others as each one's owner (--peer_secret_file); the
// callers' steps follow the moved ids without seeing an error, every step checked against the double reference over
// the sequence's whole history, and the server exits well within its drain time.
#include <signal.h>

#include <atomic>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "child_process.h"
#include "e2e_sequences_util.h"
#include "e2e_util.h"

#ifndef ATTND_BINARY
#error "ATTND_BINARY must name the attnd executable"
#endif

namespace attnd::e2e {
namespace {

using testing::ChildGuard;
using testing::Spawn;
using testing::WaitExit;

TEST(SequenceDrainTo, ASigtermedServerMovesItsSequencesAndTheCallersFollowThem) {
  constexpr int kCallers = 3, kPerCaller = 3;
  constexpr absl::Duration kDrain = absl::Seconds(20);
  const std::string secret = absl::StrCat("/tmp/attnd_drain_secret_", ::getpid());
  std::ofstream(secret) << "fleet-secret-for-the-drain-test\n";
  // B and C in process, A the binary; every one advertises its address and shares the secret.
  TestServer staying[2];
  std::vector<std::string> addresses(3);
  const int port_a = FreeLoopbackPort();
  ASSERT_GT(port_a, 0);
  addresses[0] = absl::StrCat("127.0.0.1:", port_a);
  server::BackendOptions bo;
  bo.threads = 2;
  for (int i = 0; i < 2; ++i) {
    const int port = FreeLoopbackPort();
    ASSERT_GT(port, 0);
    server::ServerOptions so;
    so.network.listen = absl::StrCat("127.0.0.1:", port);
    so.sequences.advertise_address = so.network.listen;
    so.security.peer_secret_file = secret;
    ServeOnCpu(&staying[i], so, bo, nullptr);
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
    addresses[i + 1] = so.network.listen;
  }
  // The fleet's shared target, the draining server in it: its balancer skips A once A is NOT_SERVING.
  const std::string fleet_target = absl::StrCat("ipv4:", absl::StrJoin(addresses, ","));
  const pid_t pid = Spawn({ATTND_BINARY, "--listen=" + addresses[0], "--advertise_address=" + addresses[0],
                           "--backend=cpu", "--threads=2", "--access_log=false", "--log_level=info",
                           absl::StrCat("--sequence_drain_s=", absl::ToInt64Seconds(kDrain)),
                           "--sequence_drain_to=" + fleet_target, "--peer_secret_file=" + secret});
  ASSERT_GT(pid, 0);
  ChildGuard guard{pid};
  auto on_a = Connect(addresses[0]);
  ASSERT_NE(on_a, nullptr);
  for (int n = 0; n < 500 && !on_a->CheckHealth("attnd.v1.Attention").ok(); ++n) absl::SleepFor(absl::Milliseconds(10));
  ASSERT_TRUE(on_a->CheckHealth("attnd.v1.Attention").ok());
  auto fleet = Connect(fleet_target);
  ASSERT_NE(fleet, nullptr);

  // Each caller holds sequences on A (the one that leaves) and one wherever the fleet puts it.
  const client::SequenceShape shape = TestShape(1);
  VerifiedCallers load(fleet.get(), shape, kCallers);
  for (auto& mine : load.owned) {
    for (int n = 0; n < kPerCaller; ++n) {
      auto opened = (n + 1 < kPerCaller ? on_a : fleet)->OpenSequence(shape);
      ASSERT_TRUE(opened.ok()) << opened.status();
      mine.push_back({opened->ids[0], "", ""});  // named as opened: the client follows it where it goes
    }
  }
  load.Start();
  absl::SleepFor(absl::Milliseconds(300));
  const int before = load.steps.load();
  const absl::Time asked = absl::Now();
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  EXPECT_EQ(WaitExit(pid, kDrain + absl::Seconds(10)), 0);
  guard.reaped = true;
  const absl::Duration took = absl::Now() - asked;
  EXPECT_LT(took, kDrain) << "the server waited out its drain";
  absl::SleepFor(absl::Milliseconds(300));
  load.Stop();
  ::unlink(secret.c_str());
  EXPECT_EQ(load.failed.load(), 0) << load.first_problem();
  EXPECT_EQ(load.wrong.load(), 0) << load.first_problem();
  EXPECT_GT(before, 0);
  EXPECT_GT(load.steps.load(), before + 10) << "the callers carried on after the drain";

  // No sequence was lost: each lives on B or C now, with every token its caller sent.
  // Every caller here is one owner (loopback): its sequences follow its first one to one server.
  int moved = 0;
  std::set<std::string> landed;
  for (const auto& mine : load.owned) {
    for (const VerifiedCallers::Owned& o : mine) {
      const std::string now = fleet->CurrentSequenceId(o.id);
      EXPECT_NE(client::SequenceAddress(now), addresses[0]) << o.id;
      moved += now != o.id;
      if (now != o.id) landed.insert(client::SequenceAddress(now));
      auto info = fleet->GetSequence(o.id);
      ASSERT_TRUE(info.ok()) << info.status();
      EXPECT_EQ(info->sequence_id(), now);
      EXPECT_EQ(info->lengths(0), static_cast<int64_t>(o.k.size() / (shape.kv_heads * shape.head_dim * 2)));
      EXPECT_TRUE(fleet->CloseSequence({o.id}).ok());
    }
  }
  EXPECT_GE(moved, kCallers * (kPerCaller - 1));
  EXPECT_EQ(landed.size(), 1u) << "one caller's sequences were spread over several servers";
  EXPECT_EQ(fleet->moves_followed(), static_cast<uint64_t>(moved));
  for (TestServer& srv : staying) srv.server->Shutdown();
}

}  // namespace
}  // namespace attnd::e2e
