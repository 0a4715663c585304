// The attnd binary as users run it: it serves on a unix socket, answers SIGTERM (and SIGINT) by finishing
// every accepted request and exiting 0, refuses bad flags with exit status 2, and lists its flags on --help.
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "server_raw_call.h"
#include "server_test_util.h"

#ifndef ATTND_BINARY
#error "ATTND_BINARY must name the attnd executable"
#endif

namespace attnd {
namespace {

pid_t Spawn(const std::vector<std::string>& args) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  return pid;
}

// Kills the child if the test leaves early (a failed ASSERT), so no server outlives the test.
struct ChildGuard {
  pid_t pid;
  bool reaped = false;
  ~ChildGuard() {
    if (!reaped && pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
};

// Exit status of `pid`, or -1 if it has not exited within `timeout`.
int WaitExit(pid_t pid, absl::Duration timeout) {
  const absl::Time end = absl::Now() + timeout;
  int status = 0;
  while (absl::Now() < end) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    absl::SleepFor(absl::Milliseconds(10));
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  return -1;
}

bool Serving(const std::shared_ptr<grpc::Channel>& channel) {
  const testing::RawResult r = testing::RawCall(channel, "/grpc.health.v1.Health/Check", testing::HealthRequest(""),
                                                16, std::chrono::milliseconds(500));
  return r.status.ok() && r.messages.size() == 1 && testing::HealthStatus(r.messages[0]) == 1;
}

class Binary : public ::testing::TestWithParam<int> {};

TEST_P(Binary, SignalFinishesAcceptedRequestsAndExitsZero) {
  const int sig = GetParam();
  const std::string sock = "/tmp/attnd_bin_" + std::to_string(::getpid()) + "_" + std::to_string(sig) + ".sock";
  const pid_t pid = Spawn({ATTND_BINARY, "--listen=", "--unix_socket=" + sock, "--backend=cpu", "--threads=1",
                           "--log_level=warn"});
  ASSERT_GT(pid, 0);
  ChildGuard guard{pid};
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  auto channel = grpc::CreateCustomChannel("unix:" + sock, grpc::InsecureChannelCredentials(), args);
  const absl::Time end = absl::Now() + absl::Seconds(20);
  while (!Serving(channel) && absl::Now() < end) absl::SleepFor(absl::Milliseconds(20));
  ASSERT_TRUE(Serving(channel)) << "attnd did not start";
  auto stub = v1::Attention::NewStub(channel);

  // Several requests queue on the single worker; the signal arrives while they are in flight.
  constexpr int kCalls = 6;
  std::vector<v1::ForwardRequest> requests;
  for (int i = 0; i < kCalls; ++i) {
    requests.push_back(testing::MakeRequest({1, 256, 256, 4, 1, 128}, v1::MASK_TYPE_NONE, true, 40 + i));
  }
  std::vector<v1::ForwardResponse> responses(kCalls);
  std::vector<grpc::Status> statuses(kCalls);
  std::vector<std::thread> threads;
  struct JoinAll {  // on an early return too: the server is alive until `guard` goes, so the calls end
    std::vector<std::thread>& t;
    ~JoinAll() {
      for (auto& x : t) {
        if (x.joinable()) x.join();
      }
    }
  } join_all{threads};
  for (int i = 0; i < kCalls; ++i) {
    threads.emplace_back([&, i] {
      grpc::ClientContext ctx;
      statuses[i] = stub->Forward(&ctx, requests[i], &responses[i]);
    });
  }
  // Wait until the server has accepted all of them (finished + in flight) with some still in flight.
  bool all_in = false;
  uint32_t in_flight = 0;
  for (const absl::Time until = absl::Now() + absl::Seconds(20); !all_in && absl::Now() < until;) {
    grpc::ClientContext ctx;
    v1::ServerStats stats;
    if (stub->GetStats(&ctx, v1::GetStatsRequest(), &stats).ok()) {
      uint64_t finished = 0;
      for (const auto& r : stats.rpcs()) {
        if (r.method() == "Forward") finished = r.count();
      }
      in_flight = stats.in_flight();
      all_in = finished + in_flight == kCalls;
    }
    if (!all_in) absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_TRUE(all_in);
  ASSERT_EQ(::kill(pid, sig), 0);
  EXPECT_GT(in_flight, 0u) << "every call finished before the signal: the test proved nothing";
  for (auto& t : threads) t.join();
  EXPECT_EQ(WaitExit(pid, absl::Seconds(60)), 0);
  guard.reaped = true;
  for (int i = 0; i < kCalls; ++i) {
    ASSERT_TRUE(statuses[i].ok()) << i << ": " << statuses[i].error_message();
    testing::ExpectCorrect(requests[i], responses[i].o(), responses[i].lse());
  }
  struct stat st;
  EXPECT_NE(::stat(sock.c_str(), &st), 0) << "socket file left behind";
}

INSTANTIATE_TEST_SUITE_P(Signals, Binary, ::testing::Values(SIGTERM, SIGINT),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::string(info.param == SIGTERM ? "SIGTERM" : "SIGINT");
                         });

TEST(BinaryFlags, BadFlagsExitTwo) {
  const std::vector<std::vector<std::string>> bad = {
      {ATTND_BINARY, "--backend=tpu"},
      {ATTND_BINARY, "--log_level=loud"},
      {ATTND_BINARY, "--devices=0,x"},
      {ATTND_BINARY, "--listen=", "--unix_socket="},
      {ATTND_BINARY, "--max_queue=0"},
      {ATTND_BINARY, "--grpc_arg=not-a-pair"},
  };
  for (const auto& args : bad) {
    SCOPED_TRACE(args.back());
    const pid_t pid = Spawn(args);
    ASSERT_GT(pid, 0);
    EXPECT_EQ(WaitExit(pid, absl::Seconds(20)), 2);
  }
}

TEST(BinaryFlags, HelpListsTheFlagsAndExitsZero) {
  for (const char* flag : {"--help", "--helpshort", "-h"}) {
    SCOPED_TRACE(flag);
    FILE* p = ::popen((std::string(ATTND_BINARY) + " " + flag + " 2>&1").c_str(), "r");
    ASSERT_NE(p, nullptr);
    std::string out;
    char buf[4096];
    for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
    const int st = ::pclose(p);
    ASSERT_TRUE(WIFEXITED(st));
    EXPECT_EQ(WEXITSTATUS(st), 0) << out;
    EXPECT_NE(out.find("attnd --listen="), std::string::npos) << out;  // the usage message
    EXPECT_NE(out.find("--listen (TCP listener"), std::string::npos) << out;
    EXPECT_NE(out.find("--max_calls_per_client ("), std::string::npos) << out;
    EXPECT_NE(out.find("default: 256"), std::string::npos) << out;  // --max_queue
    EXPECT_EQ(out.find("No flags matched"), std::string::npos) << out;
  }
}

}  // namespace
}  // namespace attnd
