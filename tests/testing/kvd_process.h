// KvdProcess: a real kvd child process on the host backend, in a temporary directory of its own, for
// tests that talk to it through its real sockets (libkvd, kvctl). SIGTERMed and reaped when destroyed.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

extern char** environ;

namespace kvd::testing {

class KvdProcess {
 public:
  KvdProcess() = default;
  KvdProcess(const KvdProcess&) = delete;
  KvdProcess& operator=(const KvdProcess&) = delete;
  ~KvdProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      int status = 0;
      waitpid(pid_, &status, 0);
    }
    std::error_code ec;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
  }

  // Starts `binary` as device `device` with a socket gpu<device>.sock in a new temporary directory, or
  // in `dir` when given (several daemons of one "node" share it), plus `extra` flags (where "${dir}"
  // stands for that directory); returns once it logged " ready: ".
  absl::Status Start(const std::string& binary, int device = 0, std::vector<std::string> extra = {},
                     const std::string& dir = "") {
    if (dir.empty()) {
      char tmpl[] = "/tmp/kvd-test-XXXXXX";
      if (mkdtemp(tmpl) == nullptr) return absl::InternalError(absl::StrCat("mkdtemp: ", std::strerror(errno)));
      dir_ = tmpl;
    }
    const std::string where = dir.empty() ? dir_ : dir;
    socket_ = absl::StrCat(where, "/gpu", device, ".sock");
    log_ = absl::StrCat(where, "/kvd", device, ".log");
    std::vector<std::string> argv = {binary, "--backend=host", absl::StrCat("--device=", device),
                                     "--socket=" + socket_};
    // Defaults that `extra` may replace.
    for (const char* flag : {"--host-capacity=1GiB", "--budget=512MiB", "--host-granularity=2MiB"}) {
      const absl::string_view name = absl::string_view(flag).substr(0, absl::string_view(flag).find('=') + 1);
      bool given = false;
      for (const std::string& e : extra) given |= absl::StartsWith(e, name);
      if (!given) argv.emplace_back(flag);
    }
    for (std::string& e : extra) {
      for (size_t at; (at = e.find("${dir}")) != std::string::npos;) e.replace(at, 6, where);
    }
    argv.insert(argv.end(), extra.begin(), extra.end());
    argv_ = std::move(argv);
    return Spawn();
  }

  // After Terminate() or Kill(): waits for the daemon to exit, then starts it again with the same flags
  // and sockets (a restart); returns once the new process logged " ready: ".
  absl::Status Restart() {
    if (pid_ > 0) {
      int status = 0;
      waitpid(pid_, &status, 0);
      pid_ = -1;
    }
    return Spawn();
  }

  pid_t pid() const { return pid_; }

  // SIGTERM; kvd then tells every watcher DAEMON_STOPPING (or DAEMON_RESTARTING where it keeps its pools).
  // The destructor (or Restart) reaps it.
  void Terminate() const { kill(pid_, SIGTERM); }
  // SIGKILL and reap: the daemon dies without a word, as on a crash.
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
  }

  const std::string& socket() const { return socket_; }
  const std::string& dir() const { return dir_; }
  std::string log() const {
    std::ifstream in(log_);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }

 private:
  static size_t Count(const std::string& text, const std::string& needle) {
    size_t n = 0;
    for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
    return n;
  }

  absl::Status Spawn() {
    const size_t ready_before = Count(log(), " ready: ");
    std::vector<std::string> argv = argv_;
    std::vector<char*> cargv;
    for (std::string& a : argv) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, log_.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    const int rc = posix_spawn(&pid_, argv[0].c_str(), &actions, nullptr, cargv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) {
      pid_ = -1;
      return absl::InternalError(absl::StrCat("posix_spawn ", argv[0], ": ", std::strerror(rc)));
    }
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (absl::Now() < deadline) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return absl::UnavailableError(absl::StrCat("kvd exited: ", log()));
      }
      if (Count(log(), " ready: ") > ready_before) return absl::OkStatus();
      absl::SleepFor(absl::Milliseconds(20));
    }
    return absl::DeadlineExceededError(absl::StrCat("kvd did not become ready: ", log()));
  }

  std::string dir_, socket_, log_;
  std::vector<std::string> argv_;
  pid_t pid_ = -1;
};

}  // namespace kvd::testing
