// A program run as a child of the test (the attnd binary as users run it): started, waited for, and never left
// running past the test.
#pragma once

#include <signal.h>
#include <sys/resource.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace attnd::testing {

// `max_fds` > 0: the child's descriptor limit, soft and hard (so that attnd cannot raise it).
inline pid_t Spawn(const std::vector<std::string>& args, rlim_t max_fds = 0) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (max_fds > 0) {
      const rlimit rl{max_fds, max_fds};
      if (::setrlimit(RLIMIT_NOFILE, &rl) != 0) ::_exit(126);
    }
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
inline int WaitExit(pid_t pid, absl::Duration timeout) {
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

}  // namespace attnd::testing
