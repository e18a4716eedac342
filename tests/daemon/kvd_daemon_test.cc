// Integration tests of the real kvd daemon on the host backend. Each test starts its own `kvd` process
// on sockets in a fresh temporary directory and talks to it only through those sockets: the generated
// gRPC stubs on the control socket and HandleSession (client/handle_client.h) on the handle channel.
// Chunk FDs are memfds, so a test maps them into a PROT_NONE reservation of geometry.reserved_bytes and
// sees the pool's bytes exactly where an engine would.
//
// A second, real client process is this test binary itself, exec'd as `kvd_daemon_test --kvd-peer ...`
// (see PeerMain): it attaches, maps, prints every event it handles and obeys one-line commands on stdin.
//
// Every wait is bounded (kWait) and waits for a condition; no test asserts on wall-clock time.
#include <fcntl.h>
#include <grp.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/client_unary_call.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/handle_client.h"
#include "gmock/gmock.h"
#include "google/protobuf/unknown_field_set.h"
#include "gtest/gtest.h"
#include "kvd/status.h"
#include "kvd/v1/kvd.grpc.pb.h"
#include "kvd/v1/kvd.pb.h"
#include "tests/testing/status_matchers.h"

extern char** environ;

#ifndef KVD_BINARY
#define KVD_BINARY ""
#endif

namespace kvd::daemon {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kKiB = uint64_t{1} << 10;
constexpr uint64_t kMiB = uint64_t{1} << 20;
// The bound of every wait. Reaching it is a failure, never an expectation.
constexpr absl::Duration kWait = absl::Seconds(30);

std::chrono::system_clock::time_point DeadlineIn(absl::Duration d) {
  return std::chrono::system_clock::now() + absl::ToChronoMilliseconds(d);
}

// Polls `done` every few milliseconds until it holds or `timeout` passed; returns its last value.
bool WaitFor(const std::function<bool()>& done, absl::Duration timeout = kWait) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!done()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

std::string SelfExe() {
  std::error_code ec;
  return std::filesystem::read_symlink("/proc/self/exe", ec).string();
}

// The kvd under test: $KVD_BINARY, the build's (compile definition), or a kvd next to this test.
std::string KvdBinary() {
  if (const char* env = std::getenv("KVD_BINARY"); env != nullptr && *env != '\0') return env;
  if (std::string(KVD_BINARY).size() > 0 && access(KVD_BINARY, X_OK) == 0) return KVD_BINARY;
  const std::filesystem::path dir = std::filesystem::path(SelfExe()).parent_path();
  for (const std::filesystem::path& p :
       {dir / "kvd", dir / ".." / "daemon" / "kvd", dir / ".." / ".." / "daemon" / "kvd"}) {
    if (access(p.c_str(), X_OK) == 0) return p.string();
  }
  return "kvd";
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

bool Exists(const std::string& path) {
  struct stat st {};
  return lstat(path.c_str(), &st) == 0;
}

// ---------------------------------------------------------------------------------------------
// gRPC status matching

MATCHER_P2(GrpcIs, code, substring, "") {
  *result_listener << "status " << arg.error_code() << " \"" << arg.error_message() << "\"";
  return arg.error_code() == code && absl::StrContains(arg.error_message(), substring);
}

MATCHER(GrpcOk, "") {
  *result_listener << "status " << arg.error_code() << " \"" << arg.error_message() << "\"";
  return arg.ok();
}

std::unique_ptr<grpc::ClientContext> Ctx(const std::string& session = "", absl::Duration timeout = kWait) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  if (!session.empty()) ctx->AddMetadata("kvd-session", session);
  ctx->set_deadline(DeadlineIn(timeout));
  return ctx;
}

// ---------------------------------------------------------------------------------------------
// Child processes

// A child process (posix_spawn: safe in a process with gRPC's threads), killed if still running when
// destroyed. With `pipes`, its stdin and stdout are pipes to this process; otherwise both stdout and
// stderr go to `log_path`.
class Child {
 public:
  static absl::StatusOr<std::unique_ptr<Child>> Spawn(const std::vector<std::string>& argv,
                                                      const std::vector<std::string>& extra_env,
                                                      const std::string& log_path, bool pipes) {
    auto child = std::unique_ptr<Child>(new Child());
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    int to_child[2] = {-1, -1};
    int from_child[2] = {-1, -1};
    if (pipes) {
      if (pipe2(to_child, O_CLOEXEC) != 0 || pipe2(from_child, O_CLOEXEC) != 0) {
        return absl::InternalError(absl::StrCat("pipe2: ", std::strerror(errno)));
      }
      posix_spawn_file_actions_adddup2(&actions, to_child[0], 0);
      posix_spawn_file_actions_adddup2(&actions, from_child[1], 1);
    } else {
      posix_spawn_file_actions_addopen(&actions, 1, log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      posix_spawn_file_actions_adddup2(&actions, 1, 2);
    }
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
    env.insert(env.end(), extra_env.begin(), extra_env.end());
    std::vector<char*> cargv;
    for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
    cargv.push_back(nullptr);
    std::vector<char*> cenv;
    for (const std::string& e : env) cenv.push_back(const_cast<char*>(e.c_str()));
    cenv.push_back(nullptr);
    const int rc = posix_spawn(&child->pid_, argv[0].c_str(), &actions, nullptr, cargv.data(), cenv.data());
    posix_spawn_file_actions_destroy(&actions);
    if (pipes) {
      close(to_child[0]);
      close(from_child[1]);
      child->in_ = to_child[1];
      child->out_ = from_child[0];
    }
    if (rc != 0) {
      child->pid_ = -1;
      return absl::InternalError(absl::StrCat("posix_spawn ", argv[0], ": ", std::strerror(rc)));
    }
    return child;
  }

  ~Child() {
    if (running()) {
      kill(pid_, SIGKILL);
      Wait(kWait).IgnoreError();
    }
    if (in_ >= 0) close(in_);
    if (out_ >= 0) close(out_);
  }

  pid_t pid() const { return pid_; }
  bool running() const { return pid_ > 0 && !status_.has_value(); }
  void Signal(int sig) const {
    if (running()) kill(pid_, sig);
  }

  // The wait status once the child has exited; DEADLINE_EXCEEDED if it is still running after `timeout`.
  absl::StatusOr<int> Wait(absl::Duration timeout) {
    if (status_.has_value()) return *status_;
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      int status = 0;
      const pid_t r = waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        status_ = status;
        return status;
      }
      if (r < 0) return absl::InternalError(absl::StrCat("waitpid: ", std::strerror(errno)));
      if (absl::Now() > deadline) return absl::DeadlineExceededError(absl::StrCat("pid ", pid_, " still runs"));
      absl::SleepFor(absl::Milliseconds(5));
    }
  }

  // Pipes only: one line to the child's stdin.
  bool Send(const std::string& line) const {
    const std::string data = line + "\n";
    return write(in_, data.data(), data.size()) == static_cast<ssize_t>(data.size());
  }

  // Pipes only: the first line of the child's stdout that starts with `prefix` (earlier lines that do
  // not match stay buffered for later calls), or nullopt after `timeout` or at EOF.
  std::optional<std::string> WaitLine(absl::string_view prefix, absl::Duration timeout = kWait) {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      for (auto it = lines_.begin(); it != lines_.end(); ++it) {
        if (absl::StartsWith(*it, prefix)) {
          std::string line = *it;
          lines_.erase(it);
          return line;
        }
      }
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration() || eof_) return std::nullopt;
      pollfd p{.fd = out_, .events = POLLIN, .revents = 0};
      if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1) <= 0) continue;
      char buf[4096];
      const ssize_t n = read(out_, buf, sizeof(buf));
      if (n <= 0) {
        eof_ = true;
        continue;
      }
      partial_.append(buf, static_cast<size_t>(n));
      for (size_t nl; (nl = partial_.find('\n')) != std::string::npos;) {
        lines_.push_back(partial_.substr(0, nl));
        partial_.erase(0, nl + 1);
      }
    }
  }

 private:
  Child() = default;

  pid_t pid_ = -1;
  std::optional<int> status_;
  int in_ = -1;
  int out_ = -1;
  std::string partial_;
  std::deque<std::string> lines_;
  bool eof_ = false;
};

// ---------------------------------------------------------------------------------------------
// The daemon

struct DaemonConfig {
  std::vector<std::string> extra_args;
  std::vector<std::string> extra_env;
  std::string log_name = "kvd.log";  // in the daemon's directory: its stdout and stderr
  std::vector<std::string> wrapper;  // a command kvd runs under (prlimit --nofile=N), execing it
};

class Daemon {
 public:
  explicit Daemon(std::string dir, DaemonConfig config = {})
      : dir_(std::move(dir)),
        socket_(dir_ + "/gpu0.sock"),
        handles_(dir_ + "/gpu0.handles"),
        log_(dir_ + "/" + config.log_name),
        config_(std::move(config)) {}

  // Spawns kvd (which may refuse to start: see process()).
  absl::Status Spawn() {
    std::vector<std::string> argv = config_.wrapper;
    const std::vector<std::string> kvd = {KvdBinary(),           "--backend=host",
                                          "--socket=" + socket_, "--host-capacity=1GiB",
                                          "--budget=512MiB",     "--host-granularity=2MiB"};
    // An extra argument "--flag=..." replaces the default of the same flag.
    for (const std::string& arg : kvd) {
      const std::string flag = arg.substr(0, arg.find('=') + 1);
      const bool replaced = absl::c_any_of(config_.extra_args, [&](const std::string& extra) {
        return absl::StartsWith(arg, "--") && absl::StartsWith(extra, flag);
      });
      if (!replaced) argv.push_back(arg);
    }
    argv.insert(argv.end(), config_.extra_args.begin(), config_.extra_args.end());
    KVD_ASSIGN_OR_RETURN(process_, Child::Spawn(argv, config_.extra_env, log_, /*pipes=*/false));
    return absl::OkStatus();
  }

  // Spawns kvd and waits until it logged that it is ready and answers GetDeviceInfo, or fails with its
  // log when it exits first.
  absl::Status Start() {
    KVD_RETURN_IF_ERROR(Spawn());
    const absl::Time deadline = absl::Now() + kWait;
    while (absl::Now() < deadline) {
      absl::StatusOr<int> exited = process_->Wait(absl::ZeroDuration());
      if (exited.ok()) return absl::UnavailableError(absl::StrCat("kvd exited (", *exited, "): ", log()));
      if (absl::StrContains(log(), " ready: ")) {
        // Only now: a channel that tried a missing socket would wait out its reconnect backoff.
        if (channel_ == nullptr) {
          channel_ = grpc::CreateChannel("unix:" + socket_, grpc::InsecureChannelCredentials());
          stub_ = v1::Kvd::NewStub(channel_);
        }
        v1::DeviceInfo info;
        if (stub_->GetDeviceInfo(Ctx("", absl::Seconds(2)).get(), {}, &info).ok()) return absl::OkStatus();
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    return absl::DeadlineExceededError(absl::StrCat("kvd did not become ready: ", log()));
  }

  // Signals kvd and returns its wait status once it exited.
  absl::StatusOr<int> Stop(int sig = SIGTERM) {
    if (process_ == nullptr) return absl::FailedPreconditionError("not started");
    // An open but idle connection makes kvd wait out its shutdown grace period: close ours first.
    stub_.reset();
    channel_.reset();
    process_->Signal(sig);
    return process_->Wait(kWait);
  }

  const std::string& dir() const { return dir_; }
  const std::string& socket() const { return socket_; }
  const std::string& handles() const { return handles_; }
  std::string log() const { return ReadFile(log_); }
  pid_t pid() const { return process_ == nullptr ? -1 : process_->pid(); }
  Child* process() { return process_.get(); }
  v1::Kvd::Stub& stub() { return *stub_; }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }

 private:
  std::string dir_;
  std::string socket_;
  std::string handles_;
  std::string log_;
  DaemonConfig config_;
  std::unique_ptr<Child> process_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Kvd::Stub> stub_;
};

// ---------------------------------------------------------------------------------------------
// An attached client: its own session, the pool mapped into its own reservation, a Watch thread that
// maps added chunks, unmaps released ones and (with auto_ack) acknowledges.

struct HandledEvent {
  v1::PoolEvent event;
  std::string error;  // what went wrong handling it; empty if nothing
};

class Attachment {
 public:
  static absl::StatusOr<std::unique_ptr<Attachment>> Open(const std::string& socket, const std::string& handles,
                                                          const std::string& pool, const std::string& name,
                                                          bool auto_ack) {
    KVD_ASSIGN_OR_RETURN(HandleSession session, HandleSession::Open(handles, name));
    auto a = std::unique_ptr<Attachment>(new Attachment(std::move(session), auto_ack));
    a->stub_ = v1::Kvd::NewStub(grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()));
    v1::AttachRequest request;
    request.set_pool(pool);
    request.set_client_name(name);
    v1::AttachResponse response;
    grpc::Status s = a->stub_->Attach(Ctx(a->session_.token()).get(), request, &response);
    if (!s.ok()) return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
    a->client_id_ = response.client_id();
    a->pool_ = response.pool();
    a->reserved_ = response.pool().geometry().reserved_bytes();
    void* base = mmap(nullptr, a->reserved_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) return absl::InternalError(absl::StrCat("mmap reservation: ", std::strerror(errno)));
    a->base_ = static_cast<uint8_t*>(base);
    KVD_RETURN_IF_ERROR(a->MapLease(response.lease(), response.pool().chunks()));
    a->StartWatch();
    return a;
  }

  ~Attachment() { Close(); }

  // Cancels the watch, unmaps everything and ends the session.
  void Close() {
    StopWatch();
    if (base_ != nullptr) {
      munmap(base_, reserved_);
      base_ = nullptr;
    }
    session_.Close();
  }

  // Ends only the Watch stream (the daemon then detaches this client).
  void StopWatch() {
    watch_context_.TryCancel();
    if (watcher_.joinable()) watcher_.join();
  }

  const std::string& client_id() const { return client_id_; }
  const std::string& token() const { return session_.token(); }
  const HandleSession& session() const { return session_; }
  const v1::Pool& pool() const { return pool_; }
  v1::Kvd::Stub& stub() { return *stub_; }

  // The next event the watcher has handled (in order), or nullopt after `timeout` / once the stream ended.
  std::optional<HandledEvent> NextEvent(absl::Duration timeout = kWait) {
    absl::MutexLock lock(&mu_);
    auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !events_.empty() || watch_ended_; };
    mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
    if (events_.empty()) return std::nullopt;
    HandledEvent e = std::move(events_.front());
    events_.pop_front();
    return e;
  }

  // Maps the chunks a Grow/Wake reply leased to this client's session.
  absl::Status Apply(const v1::PoolUpdate& update) {
    if (!update.has_lease() || update.lease().token().empty()) return absl::OkStatus();
    return MapLease(update.lease(), update.added());
  }

  // Acknowledges every release the watcher did not (auto_ack off).
  absl::Status AcknowledgePending() {
    std::vector<uint64_t> pending;
    {
      absl::MutexLock lock(&mu_);
      pending.swap(pending_acks_);
    }
    for (uint64_t id : pending) KVD_RETURN_IF_ERROR(Acknowledge(id));
    return absl::OkStatus();
  }

  absl::Status Write(uint64_t offset, uint64_t bytes, uint8_t value) {
    KVD_RETURN_IF_ERROR(CheckMapped(offset, bytes));
    std::memset(base_ + offset, value, bytes);
    return absl::OkStatus();
  }

  // OK when every byte of the range is `value`.
  absl::Status Check(uint64_t offset, uint64_t bytes, uint8_t value) {
    KVD_RETURN_IF_ERROR(CheckMapped(offset, bytes));
    for (uint64_t i = 0; i < bytes; ++i) {
      if (base_[offset + i] != value) {
        return absl::DataLossError(absl::StrCat("byte ", offset + i, " is ", base_[offset + i], ", expected ", value));
      }
    }
    return absl::OkStatus();
  }

  // The memfd inode behind every chunk this client has ever mapped, by chunk id.
  std::map<uint64_t, ino_t> inodes() const {
    absl::MutexLock lock(&mu_);
    return inodes_;
  }
  size_t mapped_chunks() const {
    absl::MutexLock lock(&mu_);
    return mapped_.size();
  }

 private:
  Attachment(HandleSession session, bool auto_ack) : session_(std::move(session)), auto_ack_(auto_ack) {}

  absl::Status Acknowledge(uint64_t release_id) {
    v1::AcknowledgeRequest request;
    request.set_client_id(client_id_);
    request.set_release_id(release_id);
    v1::AcknowledgeResponse response;
    grpc::Status s = stub_->Acknowledge(Ctx(session_.token()).get(), request, &response);
    if (!s.ok()) return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
    return absl::OkStatus();
  }

  absl::Status MapLease(const v1::Lease& lease, const google::protobuf::RepeatedPtrField<v1::Chunk>& chunks) {
    if (lease.chunk_ids_size() == 0) return absl::OkStatus();
    KVD_ASSIGN_OR_RETURN(auto fds, session_.Fetch(lease.token()));
    absl::Status status = absl::OkStatus();
    for (const auto& [id, fd] : fds) {
      const v1::Chunk* chunk = nullptr;
      for (const v1::Chunk& c : chunks) {
        if (c.id() == id) chunk = &c;
      }
      struct stat st {};
      fstat(fd, &st);
      if (chunk == nullptr) {
        status = absl::InternalError(absl::StrCat("lease names chunk ", id, " which the message does not describe"));
      } else if (mmap(base_ + chunk->offset(), chunk->bytes(), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) ==
                 MAP_FAILED) {
        status = absl::InternalError(absl::StrCat("mmap chunk ", id, ": ", std::strerror(errno)));
      } else {
        absl::MutexLock lock(&mu_);
        mapped_[id] = *chunk;
        inodes_[id] = st.st_ino;
      }
      close(fd);  // the mapping keeps the memory
    }
    return status;
  }

  void Unmap(const v1::Chunk& chunk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (mapped_.erase(chunk.id()) == 0) return;
    mmap(base_ + chunk.offset(), chunk.bytes(), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1,
         0);
  }

  absl::Status CheckMapped(uint64_t offset, uint64_t bytes) const {
    absl::MutexLock lock(&mu_);
    for (uint64_t at = offset; at < offset + bytes;) {
      bool found = false;
      for (const auto& [id, c] : mapped_) {
        if (at >= c.offset() && at < c.offset() + c.bytes()) {
          at = c.offset() + c.bytes();
          found = true;
          break;
        }
      }
      if (!found) return absl::FailedPreconditionError(absl::StrCat("byte ", at, " of the pool is not mapped"));
    }
    return absl::OkStatus();
  }

  void StartWatch() {
    watch_context_.AddMetadata("kvd-session", session_.token());
    v1::WatchRequest request;
    request.set_client_id(client_id_);
    reader_ = stub_->Watch(&watch_context_, request);
    reader_->WaitForInitialMetadata();  // the daemon sends it once the stream is registered
    watcher_ = std::thread([this] {
      v1::PoolEvent event;
      while (reader_->Read(&event)) Handle(event);
      reader_->Finish().IgnoreError();
      absl::MutexLock lock(&mu_);
      watch_ended_ = true;
    });
  }

  void Handle(const v1::PoolEvent& event) {
    HandledEvent handled{.event = event};
    switch (event.type()) {
      case v1::EVENT_TYPE_CHUNKS_ADDED: {
        absl::Status s = MapLease(event.lease(), event.chunks());
        if (!s.ok()) handled.error = s.ToString();
        break;
      }
      case v1::EVENT_TYPE_CHUNKS_RELEASED: {
        {
          absl::MutexLock lock(&mu_);
          for (const v1::Chunk& c : event.chunks()) Unmap(c);
          if (!auto_ack_) pending_acks_.push_back(event.release_id());
        }
        if (auto_ack_) {
          absl::Status s = Acknowledge(event.release_id());
          if (!s.ok()) handled.error = s.ToString();
        }
        break;
      }
      default: {
        absl::MutexLock lock(&mu_);
        std::vector<v1::Chunk> all;
        for (const auto& [id, c] : mapped_) all.push_back(c);
        for (const v1::Chunk& c : all) Unmap(c);
        break;
      }
    }
    absl::MutexLock lock(&mu_);
    events_.push_back(std::move(handled));
  }

  HandleSession session_;
  const bool auto_ack_;
  std::unique_ptr<v1::Kvd::Stub> stub_;
  std::string client_id_;
  v1::Pool pool_;
  uint8_t* base_ = nullptr;
  uint64_t reserved_ = 0;

  grpc::ClientContext watch_context_;
  std::unique_ptr<grpc::ClientReader<v1::PoolEvent>> reader_;
  std::thread watcher_;

  mutable absl::Mutex mu_;
  std::map<uint64_t, v1::Chunk> mapped_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, ino_t> inodes_ ABSL_GUARDED_BY(mu_);
  std::deque<HandledEvent> events_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> pending_acks_ ABSL_GUARDED_BY(mu_);
  bool watch_ended_ ABSL_GUARDED_BY(mu_) = false;
};

// ---------------------------------------------------------------------------------------------
// The peer: another process attached to the same pool (this binary, run with --kvd-peer).
//
//   kvd_daemon_test --kvd-peer SOCKET HANDLES POOL NAME ack|noack
// prints "attached CLIENT_ID" (or "failed MESSAGE"), then one line per handled event:
//   "event EVENT_TYPE_... release=ID chunks=N committed=BLOCKS lease=TOKEN error=MESSAGE"
// and answers each stdin command with one "reply ..." line:
//   write OFFSET BYTES VALUE | check OFFSET BYTES VALUE | ack | quit

int PeerMain(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: %s --kvd-peer SOCKET HANDLES POOL NAME ack|noack\n", argv[0]);
    return 2;
  }
  absl::Mutex out_mu;
  auto say = [&out_mu](const std::string& line) {
    absl::MutexLock lock(&out_mu);
    std::fputs((line + "\n").c_str(), stdout);
    std::fflush(stdout);
  };
  absl::StatusOr<std::unique_ptr<Attachment>> attached =
      Attachment::Open(argv[2], argv[3], argv[4], argv[5], std::string(argv[6]) == "ack");
  if (!attached.ok()) {
    say(absl::StrCat("failed ", attached.status().ToString()));
    return 1;
  }
  Attachment& a = **attached;
  say(absl::StrCat("attached ", a.client_id()));
  std::thread printer([&] {
    while (std::optional<HandledEvent> e = a.NextEvent(absl::InfiniteDuration())) {
      say(absl::StrCat("event ", v1::EventType_Name(e->event.type()), " release=", e->event.release_id(),
                       " chunks=", e->event.chunks_size(), " committed=", e->event.committed_blocks(),
                       " lease=", e->event.lease().token(), " error=", e->error));
    }
    say("watch-ended");
  });
  std::string line;
  while (std::getline(std::cin, line)) {
    std::vector<std::string> w = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (w.empty()) continue;
    if (w[0] == "quit") break;
    absl::Status s = absl::InvalidArgumentError(absl::StrCat("unknown command: ", line));
    uint64_t offset = 0, bytes = 0, value = 0;
    if ((w[0] == "write" || w[0] == "check") && w.size() == 4 && absl::SimpleAtoi(w[1], &offset) &&
        absl::SimpleAtoi(w[2], &bytes) && absl::SimpleAtoi(w[3], &value)) {
      s = w[0] == "write" ? a.Write(offset, bytes, static_cast<uint8_t>(value))
                          : a.Check(offset, bytes, static_cast<uint8_t>(value));
    } else if (w[0] == "ack") {
      s = a.AcknowledgePending();
    }
    say(s.ok() ? "reply ok" : absl::StrCat("reply error ", s.ToString()));
  }
  a.Close();
  printer.join();
  return 0;
}

// Another uid, for identity tests: this binary run as root with
//   kvd_daemon_test --kvd-as-uid UID SOCKET HANDLES TOKEN POOL
// becomes UID (groups dropped) and prints one line per call, "<what> <CODE> <message>":
//   stolen   GetPool(POOL) with TOKEN, a session another uid opened
//   own      ListPools with a session it opened itself
//   get      GetPool(POOL) with its own session
//   missing  GetPool of a pool that does not exist, with its own session
int AsUidMain(int argc, char** argv) {
  uint32_t uid = 0;
  if (argc != 7 || !absl::SimpleAtoi(argv[2], &uid)) {
    std::fprintf(stderr, "usage: %s --kvd-as-uid UID SOCKET HANDLES TOKEN POOL\n", argv[0]);
    return 2;
  }
  if (setgroups(0, nullptr) != 0 || setgid(uid) != 0 || setuid(uid) != 0) {
    std::printf("failed to become uid %u: %s\n", uid, std::strerror(errno));
    return 1;
  }
  auto stub = v1::Kvd::NewStub(grpc::CreateChannel(absl::StrCat("unix:", argv[3]), grpc::InsecureChannelCredentials()));
  auto say = [](absl::string_view what, const grpc::Status& s) {
    std::printf("%s %s %s\n", std::string(what).c_str(),
                absl::StatusCodeToString(static_cast<absl::StatusCode>(s.error_code())).c_str(),
                s.error_message().c_str());
    std::fflush(stdout);
  };
  v1::GetPoolRequest get;
  get.set_name(argv[6]);
  v1::Pool pool;
  say("stolen", stub->GetPool(Ctx(argv[5]).get(), get, &pool));
  absl::StatusOr<HandleSession> own = HandleSession::Open(argv[4], "other-uid");
  if (!own.ok()) {
    std::printf("own-session-failed %s\n", own.status().ToString().c_str());
    return 1;
  }
  v1::ListPoolsResponse listed;
  say("own", stub->ListPools(Ctx(own->token()).get(), {}, &listed));
  say("get", stub->GetPool(Ctx(own->token()).get(), get, &pool));
  v1::GetPoolRequest missing;
  missing.set_name("no-such-pool");
  say("missing", stub->GetPool(Ctx(own->token()).get(), missing, &pool));
  return 0;
}

class Peer {
 public:
  static absl::StatusOr<std::unique_ptr<Peer>> Start(const Daemon& daemon, const std::string& pool,
                                                     const std::string& name, bool auto_ack) {
    auto peer = std::unique_ptr<Peer>(new Peer());
    KVD_ASSIGN_OR_RETURN(peer->process_, Child::Spawn({SelfExe(), "--kvd-peer", daemon.socket(), daemon.handles(), pool,
                                                       name, auto_ack ? "ack" : "noack"},
                                                      {}, "", /*pipes=*/true));
    std::optional<std::string> hello = peer->process_->WaitLine("");
    if (!hello.has_value() || !absl::StartsWith(*hello, "attached ")) {
      return absl::InternalError(absl::StrCat("peer did not attach: ", hello.value_or("(no output)")));
    }
    peer->client_id_ = hello->substr(std::strlen("attached "));
    return peer;
  }

  // Runs one command; the reply ("ok" or "error ...").
  std::string Command(const std::string& command) {
    if (!process_->Send(command)) return "error: cannot write to the peer";
    std::optional<std::string> reply = process_->WaitLine("reply ");
    return reply.has_value() ? reply->substr(std::strlen("reply ")) : "error: no reply";
  }

  // The next event line of `type` ("EVENT_TYPE_CHUNKS_ADDED"), parsed into key=value pairs.
  std::optional<std::map<std::string, std::string>> WaitEvent(const std::string& type) {
    std::optional<std::string> line = process_->WaitLine(absl::StrCat("event ", type, " "));
    if (!line.has_value()) return std::nullopt;
    std::map<std::string, std::string> fields;
    const size_t error_at = line->find(" error=");
    fields["error"] = error_at == std::string::npos ? "" : line->substr(error_at + std::strlen(" error="));
    for (absl::string_view kv : absl::StrSplit(line->substr(0, error_at), ' ')) {
      std::pair<std::string, std::string> p = absl::StrSplit(kv, absl::MaxSplits('=', 1));
      if (!p.second.empty() || absl::StrContains(kv, "=")) fields[p.first] = p.second;
    }
    return fields;
  }

  const std::string& client_id() const { return client_id_; }
  Child& process() { return *process_; }

 private:
  Peer() = default;
  std::unique_ptr<Child> process_;
  std::string client_id_;
};

// ---------------------------------------------------------------------------------------------
// Memory accounting

// Shmem of /proc/meminfo: memfd pages live there until the last FD and mapping are gone.
uint64_t ShmemBytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kb = 0;
  std::string unit;
  while (in >> key >> kb) {
    std::getline(in, unit);
    if (key == "Shmem:") return kb * 1024;
  }
  return 0;
}

// Inodes of the memfds `pid` holds open or mapped.
std::set<ino_t> MemfdInodes(pid_t pid) {
  std::set<ino_t> inodes;
  std::error_code ec;
  const std::string proc = absl::StrCat("/proc/", pid);
  for (const auto& entry : std::filesystem::directory_iterator(proc + "/fd", ec)) {
    std::error_code ec2;
    const std::string target = std::filesystem::read_symlink(entry.path(), ec2).string();
    if (ec2 || !absl::StartsWith(target, "/memfd:")) continue;
    struct stat st {};
    if (stat(entry.path().c_str(), &st) == 0) inodes.insert(st.st_ino);
  }
  std::ifstream maps(proc + "/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (!absl::StrContains(line, "/memfd:")) continue;
    std::vector<absl::string_view> cols = absl::StrSplit(line, ' ', absl::SkipEmpty());
    uint64_t ino = 0;
    if (cols.size() >= 5 && absl::SimpleAtoi(cols[4], &ino)) inodes.insert(static_cast<ino_t>(ino));
  }
  return inodes;
}

// The inodes of `chunks` (by id) that any of `pids` still holds.
std::set<ino_t> StillHeld(const std::map<uint64_t, ino_t>& inodes, const std::vector<uint64_t>& chunks,
                          const std::vector<pid_t>& pids) {
  std::set<ino_t> held;
  for (pid_t pid : pids) {
    const std::set<ino_t> h = MemfdInodes(pid);
    for (uint64_t id : chunks) {
      auto it = inodes.find(id);
      if (it != inodes.end() && h.contains(it->second)) held.insert(it->second);
    }
  }
  return held;
}

// ---------------------------------------------------------------------------------------------
// Health and reflection, without their generated stubs (Debian ships neither .proto): raw protobuf
// bytes over gRPC's ByteBuffer, parsed with UnknownFieldSet.

grpc::ByteBuffer Buffer(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

std::string Bytes(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!buffer.Dump(&slices).ok()) return out;
  for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

std::string LengthDelimited(int field, const std::string& value) {
  return std::string(1, static_cast<char>((field << 3) | 2)) + static_cast<char>(value.size()) + value;
}

// ---------------------------------------------------------------------------------------------
// Fixtures

// Small, with several chunks' worth of capacity: LBNHC, L=2 segments of 4096 blocks of 32 KiB.
v1::PoolDims Dims(uint64_t capacity_blocks = 4096) {
  v1::PoolDims d;
  d.set_layers(2);
  d.set_capacity_blocks(capacity_blocks);
  d.set_heads(8);
  d.set_block_tokens(16);
  d.set_channels(128);
  d.set_element_bytes(2);
  return d;
}
constexpr uint64_t kBlockBytes = 16 * 8 * 128 * 2;  // N*H*C*e: one block of one layer

// Offset of layer `layer` of block `block` from the pool's base.
uint64_t At(const v1::Pool& pool, uint64_t layer, uint64_t block) {
  const v1::Geometry& g = pool.geometry();
  return g.offset() + layer * g.layer_stride() + block * g.block_stride();
}

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/kvd-daemon-test.XXXXXX";
    path_ = mkdtemp(tmpl) != nullptr ? tmpl : "";
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

class KvdDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    daemon_ = std::make_unique<Daemon>(dir_.path(), Config());
    absl::Status started = daemon_->Start();
    ASSERT_TRUE(started.ok()) << started;
    absl::StatusOr<HandleSession> admin = HandleSession::Open(daemon_->handles(), "admin");
    ASSERT_TRUE(admin.ok()) << admin.status();
    admin_ = std::make_unique<HandleSession>(*std::move(admin));
  }

  void TearDown() override {
    admin_.reset();
    if (daemon_ != nullptr && daemon_->process() != nullptr && daemon_->process()->running()) {
      absl::StatusOr<int> status = daemon_->Stop(SIGTERM);
      EXPECT_TRUE(status.ok()) << status.status();
    }
    if (HasFailure() && daemon_ != nullptr)
      std::cerr << "---- kvd log ----\n" << daemon_->log() << "-----------------\n";
  }

  virtual DaemonConfig Config() { return {}; }

  v1::Kvd::Stub& stub() { return daemon_->stub(); }
  const std::string& admin() const { return admin_->token(); }

  grpc::Status Create(const std::string& name, uint64_t initial_blocks, v1::Pool* pool = nullptr,
                      v1::PoolDims dims = Dims()) {
    v1::CreatePoolRequest request;
    request.set_name(name);
    *request.mutable_dims() = dims;
    request.set_initial_blocks(initial_blocks);
    v1::Pool response;
    grpc::Status s = stub().CreatePool(Ctx(admin()).get(), request, &response);
    if (pool != nullptr) *pool = response;
    return s;
  }

  // Attach through `session` (docs/api.md, "Pushed handles" for `push_handles`).
  grpc::Status Attach(const HandleSession& session, const std::string& pool, bool push_handles,
                      v1::AttachResponse* out) {
    v1::AttachRequest request;
    request.set_pool(pool);
    request.set_push_handles(push_handles);
    return stub().Attach(Ctx(session.token()).get(), request, out);
  }

  v1::Pool Get(const std::string& name) {
    v1::GetPoolRequest request;
    request.set_name(name);
    v1::Pool pool;
    grpc::Status s = stub().GetPool(Ctx(admin()).get(), request, &pool);
    EXPECT_THAT(s, GrpcOk());
    return pool;
  }

  grpc::Status Grow(const std::string& session, const std::string& pool, uint64_t blocks,
                    v1::PoolUpdate* update = nullptr) {
    v1::GrowRequest request;
    request.set_pool(pool);
    request.set_target_blocks(blocks);
    v1::PoolUpdate response;
    grpc::Status s = stub().Grow(Ctx(session).get(), request, &response);
    if (update != nullptr) *update = response;
    return s;
  }

  // Shrink with wait_for_release, on its own thread.
  std::future<std::pair<grpc::Status, v1::PoolUpdate>> ShrinkAsync(const std::string& pool, uint64_t blocks) {
    return std::async(std::launch::async, [this, pool, blocks] {
      v1::ShrinkRequest request;
      request.set_pool(pool);
      request.set_target_blocks(blocks);
      request.set_wait_for_release(true);
      request.set_force(true);  // past the test's clients, which are not pausable: they get CHUNKS_RELEASED
      v1::PoolUpdate response;
      grpc::Status s = stub().Shrink(Ctx(admin()).get(), request, &response);
      return std::make_pair(s, response);
    });
  }

  v1::DeviceInfo DeviceInfo() {
    v1::DeviceInfo info;
    EXPECT_THAT(stub().GetDeviceInfo(Ctx().get(), {}, &info), GrpcOk());
    return info;
  }

  absl::StatusOr<std::unique_ptr<Attachment>> Attach(const std::string& pool, const std::string& name,
                                                     bool auto_ack = true) {
    return Attachment::Open(daemon_->socket(), daemon_->handles(), pool, name, auto_ack);
  }

  TempDir dir_;
  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<HandleSession> admin_;
};

template <typename T>
bool Ready(const std::future<T>& f) {
  return f.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

// ---------------------------------------------------------------------------------------------
// Serving

TEST_F(KvdDaemonTest, HealthCheckReportsServing) {
  const grpc::internal::RpcMethod method("/grpc.health.v1.Health/Check", grpc::internal::RpcMethod::NORMAL_RPC);
  for (const std::string& service : {std::string(), std::string("kvd.v1.Kvd")}) {
    grpc::ByteBuffer response;
    grpc::Status s = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
        daemon_->channel().get(), method, Ctx().get(), Buffer(service.empty() ? "" : LengthDelimited(1, service)),
        &response);
    ASSERT_THAT(s, GrpcOk()) << "service \"" << service << "\"";
    google::protobuf::UnknownFieldSet fields;
    ASSERT_TRUE(fields.ParseFromString(Bytes(response)));
    ASSERT_EQ(fields.field_count(), 1);
    EXPECT_EQ(fields.field(0).number(), 1);   // HealthCheckResponse.status
    EXPECT_EQ(fields.field(0).varint(), 1u);  // SERVING
  }
}

// kvd serves grpc.health.v1 itself (Note [No callback API] in docs/architecture.md): a name it does not report is
// NOT_FOUND for Check; Watch writes the status at once, then each change, and ends once kvd stops.
TEST_F(KvdDaemonTest, HealthWatchFollowsTheDaemonUntilItStops) {
  const grpc::internal::RpcMethod check("/grpc.health.v1.Health/Check", grpc::internal::RpcMethod::NORMAL_RPC);
  auto status_of = [](const grpc::ByteBuffer& response) -> int {
    google::protobuf::UnknownFieldSet fields;
    if (!fields.ParseFromString(Bytes(response))) return -1;
    return fields.field_count() == 0 ? 0 : static_cast<int>(fields.field(0).varint());
  };
  grpc::ByteBuffer response;
  ASSERT_THAT((grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
                  daemon_->channel().get(), check, Ctx().get(), Buffer(LengthDelimited(1, "kvd.state")), &response)),
              GrpcOk());
  EXPECT_EQ(status_of(response), 1);  // SERVING: the saved state is current
  EXPECT_THAT((grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
                  daemon_->channel().get(), check, Ctx().get(), Buffer(LengthDelimited(1, "nope")), &response)),
              GrpcIs(grpc::StatusCode::NOT_FOUND, "service: \"nope\" is not a name kvd reports"));

  const grpc::internal::RpcMethod watch("/grpc.health.v1.Health/Watch", grpc::internal::RpcMethod::SERVER_STREAMING);
  grpc::ClientContext daemon_ctx, unknown_ctx;
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> daemon_watch(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(daemon_->channel().get(), watch, &daemon_ctx,
                                                                    Buffer("")));
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> unknown_watch(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(daemon_->channel().get(), watch, &unknown_ctx,
                                                                    Buffer(LengthDelimited(1, "nope"))));
  ASSERT_TRUE(daemon_watch->Read(&response));
  EXPECT_EQ(status_of(response), 1);  // SERVING
  ASSERT_TRUE(unknown_watch->Read(&response));
  EXPECT_EQ(status_of(response), 3);  // SERVICE_UNKNOWN

  daemon_->process()->Signal(SIGTERM);
  ASSERT_TRUE(daemon_watch->Read(&response));
  EXPECT_EQ(status_of(response), 2);  // NOT_SERVING, then the end
  EXPECT_FALSE(daemon_watch->Read(&response));
  EXPECT_THAT(daemon_watch->Finish(), GrpcOk());
  ASSERT_TRUE(unknown_watch->Read(&response));
  EXPECT_EQ(status_of(response), 2);
  EXPECT_FALSE(unknown_watch->Read(&response));
  EXPECT_THAT(unknown_watch->Finish(), GrpcOk());
  EXPECT_THAT(daemon_->process()->Wait(kWait), testing::IsOkAndHolds(0));
}

TEST_F(KvdDaemonTest, ACrashLeavesItsSignalAndStackInTheLog) {
#ifndef KVD_FAILURE_SIGNAL_HANDLER
  GTEST_SKIP() << "a sanitizer build: the sanitizer's own handler reports a crash";
#endif
  const rlimit no_core{0, 0};  // the crash is the test's: no core file
  ASSERT_EQ(prlimit(daemon_->pid(), RLIMIT_CORE, &no_core, nullptr), 0) << std::strerror(errno);
  daemon_->process()->Signal(SIGSEGV);  // as a stray pointer would raise it
  absl::StatusOr<int> status = daemon_->process()->Wait(kWait);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_TRUE(WIFSIGNALED(*status) && WTERMSIG(*status) == SIGSEGV) << "wait status " << *status;
  const std::string log = daemon_->log();
  EXPECT_THAT(log, HasSubstr("*** SIGSEGV received at time=")) << log;
  EXPECT_THAT(log, HasSubstr("@ ")) << "no stack frame: " << log;
}

TEST_F(KvdDaemonTest, ReflectionListsTheKvdService) {
  const grpc::internal::RpcMethod method("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                         grpc::internal::RpcMethod::BIDI_STREAMING);
  auto ctx = Ctx();
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(daemon_->channel().get(),
                                                                                            method, ctx.get()));
  ASSERT_TRUE(stream->Write(Buffer(LengthDelimited(7, "*"))));  // ServerReflectionRequest.list_services
  ASSERT_TRUE(stream->WritesDone());
  grpc::ByteBuffer response;
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_THAT(stream->Finish(), GrpcOk());

  std::vector<std::string> services;
  google::protobuf::UnknownFieldSet top;
  ASSERT_TRUE(top.ParseFromString(Bytes(response)));
  for (int i = 0; i < top.field_count(); ++i) {
    if (top.field(i).number() != 6) continue;  // list_services_response
    google::protobuf::UnknownFieldSet list;
    ASSERT_TRUE(list.ParseFromString(top.field(i).length_delimited()));
    for (int j = 0; j < list.field_count(); ++j) {
      google::protobuf::UnknownFieldSet service;  // ServiceResponse { string name = 1; }
      ASSERT_TRUE(service.ParseFromString(list.field(j).length_delimited()));
      for (int k = 0; k < service.field_count(); ++k) services.push_back(service.field(k).length_delimited());
    }
  }
  EXPECT_THAT(services, ::testing::Contains("kvd.v1.Kvd"));
  EXPECT_THAT(services, ::testing::Contains("grpc.health.v1.Health"));
}

TEST_F(KvdDaemonTest, DeviceInfoReportsHostBackendBudgetAndGranularity) {
  const v1::DeviceInfo info = DeviceInfo();
  EXPECT_EQ(info.backend(), v1::BACKEND_HOST);
  EXPECT_EQ(info.device_index(), 0u);
  EXPECT_FALSE(info.device_name().empty());
  EXPECT_EQ(info.total_bytes(), 1024 * kMiB);
  EXPECT_EQ(info.budget_bytes(), 512 * kMiB);
  EXPECT_EQ(info.granularity_bytes(), 2 * kMiB);
  EXPECT_EQ(info.max_chunk_bytes(), 4096 * kMiB);
  EXPECT_EQ(info.committed_bytes(), 0u);
  EXPECT_EQ(info.pool_count(), 0u);
  EXPECT_THAT(info.handle_types(), ::testing::Contains(v1::HANDLE_TYPE_POSIX_FD));
  EXPECT_FALSE(info.daemon_version().empty());
}

TEST_F(KvdDaemonTest, SocketsAreOwnerAndGroupOnly) {
  for (const std::string& path : {daemon_->socket(), daemon_->handles()}) {
    struct stat st {};
    ASSERT_EQ(lstat(path.c_str(), &st), 0) << path;
    EXPECT_TRUE(S_ISSOCK(st.st_mode)) << path;
    EXPECT_EQ(st.st_mode & 0777, 0660u) << path;
  }
}

TEST_F(KvdDaemonTest, ResolveLayoutNeedsNoSessionAndComputesGeometry) {
  v1::ResolveLayoutRequest request;
  v1::BackendRequirement* b = request.mutable_layout_request()->add_backend_requirements();
  b->set_backend("FLASHINFER");
  b->add_layouts("block-outermost");
  *request.mutable_dims() = Dims();
  v1::ResolveLayoutResponse response;
  ASSERT_THAT(stub().ResolveLayout(Ctx().get(), request, &response), GrpcOk());
  EXPECT_EQ(response.resolution().layout(), "BLHNC");
  EXPECT_EQ(response.resolution().rule(), v1::LAYOUT_RULE_DEFAULT);
  EXPECT_THAT(response.resolution().allowed_layouts(), ::testing::ElementsAre("BLHNC", "BLNHC", "BHLNC"));
  EXPECT_EQ(response.geometry().segments(), 1u);
  EXPECT_EQ(response.geometry().granularity_bytes(), 2 * kMiB);
}

// ---------------------------------------------------------------------------------------------
// Pools

TEST_F(KvdDaemonTest, CreateGetListAndDeletePool) {
  v1::Pool created;
  ASSERT_THAT(Create("kv0", 64, &created), GrpcOk());
  EXPECT_EQ(created.name(), "kv0");
  EXPECT_EQ(created.state(), v1::POOL_STATE_AWAKE);
  EXPECT_EQ(created.geometry().layout(), "LBNHC");
  EXPECT_EQ(created.layout().rule(), v1::LAYOUT_RULE_DEFAULT);
  EXPECT_EQ(created.geometry().segments(), 2u);
  EXPECT_EQ(created.geometry().block_stride(), kBlockBytes);
  EXPECT_EQ(created.committed_blocks(), 64u);
  EXPECT_EQ(created.committed_bytes(), 4 * kMiB);  // 2 MiB per segment
  EXPECT_EQ(created.reserved_bytes(), 256 * kMiB);
  EXPECT_EQ(created.chunks_size(), 2);
  EXPECT_EQ(created.owner_uid(), getuid());

  const v1::Pool got = Get("kv0");
  EXPECT_EQ(got.committed_blocks(), 64u);
  EXPECT_EQ(got.generation(), created.generation());
  ASSERT_EQ(got.chunks_size(), 2);
  EXPECT_EQ(got.chunks(0).id(), created.chunks(0).id());

  ASSERT_THAT(Create("kv1", 0), GrpcOk());
  v1::ListPoolsResponse list;
  ASSERT_THAT(stub().ListPools(Ctx(admin()).get(), {}, &list), GrpcOk());
  ASSERT_EQ(list.pools_size(), 2);
  EXPECT_EQ(list.pools(0).name(), "kv0");
  EXPECT_EQ(list.pools(1).name(), "kv1");
  EXPECT_EQ(DeviceInfo().committed_bytes(), 4 * kMiB);
  EXPECT_EQ(DeviceInfo().pool_count(), 2u);

  v1::DeletePoolRequest del;
  del.set_name("kv0");
  v1::DeletePoolResponse deleted;
  ASSERT_THAT(stub().DeletePool(Ctx(admin()).get(), del, &deleted), GrpcOk());
  EXPECT_EQ(deleted.released_bytes(), 4 * kMiB);
  v1::GetPoolRequest get;
  get.set_name("kv0");
  v1::Pool gone;
  EXPECT_THAT(stub().GetPool(Ctx(admin()).get(), get, &gone), GrpcIs(grpc::StatusCode::NOT_FOUND, "kv0"));
  EXPECT_EQ(DeviceInfo().committed_bytes(), 0u);
  EXPECT_EQ(DeviceInfo().pool_count(), 1u);
}

TEST_F(KvdDaemonTest, TwoSessionsSeeEachOthersWrites) {
  ASSERT_THAT(Create("kv", 64), GrpcOk());
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Attachment> a, Attach("kv", "engine"));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Attachment> b, Attach("kv", "connector"));
  EXPECT_NE(a->token(), b->token());
  const v1::Pool& pool = a->pool();
  ASSERT_TRUE(a->Write(At(pool, 1, 7), kBlockBytes, 0x5a).ok());
  EXPECT_TRUE(b->Check(At(pool, 1, 7), kBlockBytes, 0x5a).ok());
  ASSERT_TRUE(b->Write(At(pool, 0, 63), kBlockBytes, 0xa5).ok());
  EXPECT_TRUE(a->Check(At(pool, 0, 63), kBlockBytes, 0xa5).ok());
  EXPECT_EQ(Get("kv").clients_size(), 2);
}

TEST_F(KvdDaemonTest, ClientInAnotherProcessSeesWritesBothWays) {
  ASSERT_THAT(Create("kv", 64), GrpcOk());
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Attachment> a, Attach("kv", "engine"));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Peer> peer, Peer::Start(*daemon_, "kv", "peer", true));
  const v1::Pool& pool = a->pool();
  ASSERT_TRUE(a->Write(At(pool, 1, 3), kBlockBytes, 0x11).ok());
  EXPECT_EQ(peer->Command(absl::StrCat("check ", At(pool, 1, 3), " ", kBlockBytes, " ", 0x11)), "ok");
  EXPECT_EQ(peer->Command(absl::StrCat("write ", At(pool, 0, 5), " ", kBlockBytes, " ", 0x22)), "ok");
  EXPECT_TRUE(a->Check(At(pool, 0, 5), kBlockBytes, 0x22).ok());

  const v1::Pool seen = Get("kv");
  ASSERT_EQ(seen.clients_size(), 2);
  std::set<int32_t> pids;
  for (const v1::ClientInfo& c : seen.clients()) pids.insert(c.pid());
  EXPECT_EQ(pids, (std::set<int32_t>{getpid(), peer->process().pid()}));
}

TEST_F(KvdDaemonTest, GrowTellsTheOtherClientWithItsOwnLease) {
  ASSERT_THAT(Create("kv", 64), GrpcOk());
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Attachment> a, Attach("kv", "engine"));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Peer> peer, Peer::Start(*daemon_, "kv", "peer", true));

  // The engine grows through its own session: its lease comes in the reply; the peer's on Watch.
  v1::PoolUpdate update;
  ASSERT_THAT(Grow(a->token(), "kv", 1024, &update), GrpcOk());
  EXPECT_EQ(update.pool().committed_blocks(), 1024u);
  EXPECT_EQ(update.added_size(), 2);  // one chunk per segment for the whole delta
  EXPECT_EQ(update.pool().committed_bytes(), 64 * kMiB);
  ASSERT_TRUE(update.has_lease());
  ASSERT_TRUE(a->Apply(update).ok());

  std::optional<std::map<std::string, std::string>> event = peer->WaitEvent("EVENT_TYPE_CHUNKS_ADDED");
  ASSERT_TRUE(event.has_value());
  EXPECT_EQ((*event)["error"], "");
  EXPECT_EQ((*event)["chunks"], "2");
  EXPECT_EQ((*event)["committed"], "1024");
  EXPECT_FALSE((*event)["lease"].empty());
  EXPECT_NE((*event)["lease"], update.lease().token());

  const v1::Pool& pool = update.pool();
  ASSERT_TRUE(a->Write(At(pool, 1, 1000), kBlockBytes, 0x77).ok());
  EXPECT_EQ(peer->Command(absl::StrCat("check ", At(pool, 1, 1000), " ", kBlockBytes, " ", 0x77)), "ok");
  EXPECT_EQ(peer->Command(absl::StrCat("write ", At(pool, 0, 900), " ", kBlockBytes, " ", 0x78)), "ok");
  EXPECT_TRUE(a->Check(At(pool, 0, 900), kBlockBytes, 0x78).ok());
  EXPECT_EQ(DeviceInfo().committed_bytes(), 64 * kMiB);
}

TEST_F(KvdDaemonTest, ShrinkWaitsForEveryWatcherAndThenTheMemoryIsFree) {
  ASSERT_THAT(Create("kv", 64), GrpcOk());
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Attachment> a, Attach("kv", "engine", /*auto_ack=*/true));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Peer> peer, Peer::Start(*daemon_, "kv", "peer", /*auto_ack=*/false));
  v1::PoolUpdate grown;
  ASSERT_THAT(Grow(admin(), "kv", 4096, &grown), GrpcOk());
  std::optional<HandledEvent> added = a->NextEvent();
  ASSERT_TRUE(added.has_value());
  ASSERT_EQ(added->event.type(), v1::EVENT_TYPE_CHUNKS_ADDED);
  ASSERT_EQ(added->error, "");
  ASSERT_TRUE(peer->WaitEvent("EVENT_TYPE_CHUNKS_ADDED").has_value());
  std::vector<uint64_t> grown_ids;
  for (const v1::Chunk& c : grown.added()) grown_ids.push_back(c.id());
  const uint64_t grown_bytes = 252 * kMiB;  // 126 MiB per segment
  // Touch every page so that the pages certainly exist.
  ASSERT_TRUE(a->Write(At(grown.pool(), 0, 64), 4032 * kBlockBytes, 1).ok());
  ASSERT_TRUE(a->Write(At(grown.pool(), 1, 64), 4032 * kBlockBytes, 2).ok());
  const uint64_t shmem_before = ShmemBytes();

  auto shrink = ShrinkAsync("kv", 64);
  std::optional<HandledEvent> released = a->NextEvent();
  ASSERT_TRUE(released.has_value());
  EXPECT_EQ(released->event.type(), v1::EVENT_TYPE_CHUNKS_RELEASED);
  EXPECT_EQ(released->error, "");  // auto-acknowledged
  std::optional<std::map<std::string, std::string>> peer_released = peer->WaitEvent("EVENT_TYPE_CHUNKS_RELEASED");
  ASSERT_TRUE(peer_released.has_value());
  EXPECT_EQ((*peer_released)["release"], absl::StrCat(released->event.release_id()));

  // The peer has unmapped but not acknowledged: the shrink cannot have completed.
  EXPECT_FALSE(Ready(shrink));
  EXPECT_EQ(Get("kv").pending_release_bytes(), grown_bytes);
  EXPECT_EQ(peer->Command("ack"), "ok");

  auto [status, update] = shrink.get();
  ASSERT_THAT(status, GrpcOk());
  EXPECT_EQ(update.pool().committed_blocks(), 64u);
  EXPECT_EQ(update.pool().pending_release_bytes(), 0u);
  EXPECT_EQ(update.released_chunk_ids_size(), 2);
  EXPECT_NE(update.release_id(), 0u);
  EXPECT_EQ(DeviceInfo().committed_bytes(), 4 * kMiB);

  // Nobody holds the released memfds any more, and the kernel got the pages back.
  EXPECT_THAT(StillHeld(a->inodes(), grown_ids, {daemon_->pid(), getpid(), peer->process().pid()}),
              ::testing::IsEmpty());
  uint64_t shmem_after = 0;
  EXPECT_TRUE(WaitFor([&] {
    shmem_after = ShmemBytes();
    return shmem_after + grown_bytes / 2 <= shmem_before;
  })) << "Shmem "
      << shmem_before << " -> " << shmem_after;
}

TEST_F(KvdDaemonTest, SleepReleasesEverythingAndWakeRecommitsForEveryClient) {
  ASSERT_THAT(Create("kv", 256), GrpcOk());
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Attachment> a, Attach("kv", "engine", /*auto_ack=*/true));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Peer> peer, Peer::Start(*daemon_, "kv", "peer", /*auto_ack=*/false));
  const v1::Pool pool = a->pool();
  std::vector<uint64_t> before_ids;
  for (const v1::Chunk& c : pool.chunks()) before_ids.push_back(c.id());
  ASSERT_TRUE(a->Write(At(pool, 0, 0), kBlockBytes, 0xab).ok());
  EXPECT_EQ(peer->Command(absl::StrCat("check ", At(pool, 0, 0), " ", kBlockBytes, " ", 0xab)), "ok");

  auto sleeping = std::async(std::launch::async, [&] {
    v1::SleepRequest request;
    request.set_pool("kv");
    request.set_wait_for_release(true);
    request.set_force(true);  // past the clients, which are not pausable (docs/api.md, "Releases and running engines")
    v1::PoolUpdates response;
    grpc::Status s = stub().Sleep(Ctx(admin()).get(), request, &response);
    return std::make_pair(s, response);
  });
  std::optional<HandledEvent> released = a->NextEvent();
  ASSERT_TRUE(released.has_value());
  EXPECT_EQ(released->event.type(), v1::EVENT_TYPE_CHUNKS_RELEASED);
  EXPECT_EQ(released->event.state(), v1::POOL_STATE_SLEEPING);
  ASSERT_TRUE(peer->WaitEvent("EVENT_TYPE_CHUNKS_RELEASED").has_value());
  EXPECT_FALSE(Ready(sleeping));
  EXPECT_EQ(peer->Command("ack"), "ok");
  auto [slept, updates] = sleeping.get();
  ASSERT_THAT(slept, GrpcOk());
  ASSERT_EQ(updates.updates_size(), 1);
  EXPECT_EQ(updates.updates(0).pool().state(), v1::POOL_STATE_SLEEPING);
  EXPECT_EQ(updates.updates(0).pool().committed_blocks(), 0u);
  EXPECT_EQ(updates.updates(0).pool().wake_blocks(), 256u);
  EXPECT_EQ(updates.updates(0).pool().pending_release_bytes(), 0u);
  EXPECT_EQ(DeviceInfo().committed_bytes(), 0u);
  EXPECT_THAT(StillHeld(a->inodes(), before_ids, {daemon_->pid(), getpid(), peer->process().pid()}),
              ::testing::IsEmpty());
  EXPECT_EQ(a->mapped_chunks(), 0u);
  EXPECT_EQ(Get("kv").clients_size(), 2);  // attachments survive sleep

  v1::WakeRequest wake;
  wake.set_pool("kv");
  v1::PoolUpdates woken;
  ASSERT_THAT(stub().Wake(Ctx(admin()).get(), wake, &woken), GrpcOk());
  ASSERT_EQ(woken.updates_size(), 1);
  EXPECT_EQ(woken.updates(0).pool().state(), v1::POOL_STATE_AWAKE);
  EXPECT_EQ(woken.updates(0).pool().committed_blocks(), 256u);
  EXPECT_EQ(woken.updates(0).added_size(), 2);
  std::optional<HandledEvent> added = a->NextEvent();
  ASSERT_TRUE(added.has_value());
  EXPECT_EQ(added->event.type(), v1::EVENT_TYPE_CHUNKS_ADDED);
  EXPECT_EQ(added->error, "");
  ASSERT_TRUE(peer->WaitEvent("EVENT_TYPE_CHUNKS_ADDED").has_value());

  // Content is discarded by sleep; the new memory is shared again.
  EXPECT_EQ(peer->Command(absl::StrCat("check ", At(pool, 0, 0), " ", kBlockBytes, " 0")), "ok");
  ASSERT_TRUE(a->Write(At(pool, 1, 255), kBlockBytes, 0xcd).ok());
  EXPECT_EQ(peer->Command(absl::StrCat("check ", At(pool, 1, 255), " ", kBlockBytes, " ", 0xcd)), "ok");
}

TEST_F(KvdDaemonTest, KilledClientIsDetachedAndLeavesNothingBehind) {
  ASSERT_THAT(Create("kv", 64), GrpcOk());
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Attachment> a, Attach("kv", "engine", /*auto_ack=*/true));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Peer> peer, Peer::Start(*daemon_, "kv", "doomed", /*auto_ack=*/false));
  v1::PoolUpdate grown;
  ASSERT_THAT(Grow(admin(), "kv", 1024, &grown), GrpcOk());
  ASSERT_TRUE(a->NextEvent().has_value());
  ASSERT_TRUE(peer->WaitEvent("EVENT_TYPE_CHUNKS_ADDED").has_value());
  std::vector<uint64_t> grown_ids;
  for (const v1::Chunk& c : grown.added()) grown_ids.push_back(c.id());

  auto shrink = ShrinkAsync("kv", 64);
  ASSERT_TRUE(a->NextEvent().has_value());
  ASSERT_TRUE(peer->WaitEvent("EVENT_TYPE_CHUNKS_RELEASED").has_value());
  EXPECT_FALSE(Ready(shrink));
  EXPECT_GT(Get("kv").pending_release_bytes(), 0u);

  // Dies without acknowledging: its session closes and the daemon drops its pending acknowledgement.
  const pid_t doomed = peer->process().pid();
  peer->process().Signal(SIGKILL);
  ASSERT_TRUE(peer->process().Wait(kWait).ok());
  auto [status, update] = shrink.get();
  ASSERT_THAT(status, GrpcOk());
  EXPECT_EQ(update.pool().pending_release_bytes(), 0u);
  EXPECT_EQ(update.pool().committed_blocks(), 64u);

  EXPECT_TRUE(WaitFor([&] { return Get("kv").clients_size() == 1; }));
  const v1::Pool after = Get("kv");
  ASSERT_EQ(after.clients_size(), 1);
  EXPECT_NE(after.clients(0).pid(), doomed);
  EXPECT_EQ(after.pending_release_bytes(), 0u);
  EXPECT_EQ(DeviceInfo().committed_bytes(), 4 * kMiB);
  EXPECT_THAT(StillHeld(a->inodes(), grown_ids, {daemon_->pid(), getpid()}), ::testing::IsEmpty());
}

TEST_F(KvdDaemonTest, ClosingTheWatchStreamDetachesTheClient) {
  ASSERT_THAT(Create("kv", 64), GrpcOk());
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Attachment> a, Attach("kv", "engine"));
  ASSERT_EQ(Get("kv").clients_size(), 1);
  a->StopWatch();
  EXPECT_TRUE(WaitFor([&] { return Get("kv").clients_size() == 0; }));
  v1::AcknowledgeRequest ack;
  ack.set_client_id(a->client_id());
  ack.set_release_id(1);
  v1::AcknowledgeResponse response;
  EXPECT_THAT(a->stub().Acknowledge(Ctx(a->token()).get(), ack, &response),
              GrpcIs(grpc::StatusCode::NOT_FOUND, "client_id"));
}

// The threads of process `pid` (its /proc/<pid>/task entries).
size_t ThreadsOf(pid_t pid) {
  std::error_code ec;
  size_t n = 0;
  for (auto it = std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/task"), ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++n;
  }
  return n;
}

// Note [Watch streams are pushed]: an open Watch stream holds no thread of the daemon, each gets its events
// as they happen, and the streams of clients that stop reading or hang up hold nothing up.
TEST_F(KvdDaemonTest, ManyWatchStreamsHoldNoThreadsAndEachGetsItsEvents) {
  constexpr int kStreams = 200;
  ASSERT_THAT(Create("kv", 64), GrpcOk());
  std::vector<std::string> clients;
  for (int i = 0; i < kStreams; ++i) {
    v1::AttachRequest attach;
    attach.set_pool("kv");
    attach.set_client_name(absl::StrCat("watcher-", i));
    v1::AttachResponse attached;
    ASSERT_THAT(stub().Attach(Ctx(admin()).get(), attach, &attached), GrpcOk());
    clients.push_back(attached.client_id());
  }
  const size_t threads_before = ThreadsOf(daemon_->pid());
  grpc::CompletionQueue cq;
  struct Stream {
    std::unique_ptr<grpc::ClientContext> context;
    std::unique_ptr<grpc::ClientAsyncReader<v1::PoolEvent>> reader;
    v1::PoolEvent event;
  };
  std::vector<Stream> streams(kStreams);
  // The tag of the next completion; -1 when none came in time, -2 when it failed.
  auto next = [&cq] {
    void* tag = nullptr;
    bool ok = false;
    const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(30);
    if (cq.AsyncNext(&tag, &ok, deadline) != grpc::CompletionQueue::GOT_EVENT) return -1;
    return ok ? static_cast<int>(reinterpret_cast<intptr_t>(tag)) : -2;
  };
  auto tag = [](int i) { return reinterpret_cast<void*>(static_cast<intptr_t>(i)); };
  for (int i = 0; i < kStreams; ++i) {
    Stream& st = streams[i];
    st.context = Ctx(admin());
    v1::WatchRequest watch;
    watch.set_client_id(clients[i]);
    st.reader = stub().PrepareAsyncWatch(st.context.get(), watch, &cq);
    st.reader->StartCall(tag(i));
  }
  for (int i = 0; i < kStreams; ++i) ASSERT_GE(next(), 0) << "stream start " << i;
  // Initial metadata: the daemon sends it once a stream is registered.
  for (int i = 0; i < kStreams; ++i) streams[i].reader->ReadInitialMetadata(tag(i));
  for (int i = 0; i < kStreams; ++i) ASSERT_GE(next(), 0) << "initial metadata " << i;
  const size_t threads_open = ThreadsOf(daemon_->pid());
  EXPECT_LT(threads_open, threads_before + kStreams / 4)
      << kStreams << " open streams took " << threads_open - threads_before << " threads";

  // A grow from another session reaches every stream (a client of the grower's own session would get the
  // lease in the reply instead); half of them read it, the other half have stopped reading.
  for (int i = 0; i < kStreams; i += 2) streams[i].reader->Read(&streams[i].event, tag(i));
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession grower, HandleSession::Open(daemon_->handles(), "grower"));
  ASSERT_THAT(Grow(grower.token(), "kv", 128), GrpcOk());
  std::set<int> told;
  for (int i = 0; i < kStreams / 2; ++i) {
    const int read = next();
    ASSERT_GE(read, 0) << "a read failed or timed out after " << told.size() << " events";
    EXPECT_EQ(streams[read].event.type(), v1::EVENT_TYPE_CHUNKS_ADDED);
    told.insert(read);
  }
  EXPECT_EQ(told.size(), static_cast<size_t>(kStreams / 2));
  // Those that read hang up: their clients go, the others' stay.
  grpc::Status finished[kStreams];
  for (int i = 0; i < kStreams; i += 2) {
    streams[i].context->TryCancel();
    streams[i].reader->Finish(&finished[i], tag(i));
  }
  for (int i = 0; i < kStreams / 2; ++i) ASSERT_NE(next(), -1);
  EXPECT_TRUE(WaitFor([&] { return Get("kv").clients_size() == kStreams / 2; })) << Get("kv").clients_size();
  // The daemon stops with the other half open: it tells them (DAEMON_RESTARTING), ends every stream (OK)
  // and exits cleanly. (They read meanwhile: what a client reads after the daemon is gone is up to its gRPC.)
  std::map<int, std::vector<v1::EventType>> types;
  std::set<int> finishing;
  for (int i = 1; i < kStreams; i += 2) streams[i].reader->Read(&streams[i].event, tag(i));
  std::future<absl::StatusOr<int>> stopped = std::async(std::launch::async, [&] { return daemon_->Stop(SIGTERM); });
  for (int open = kStreams / 2; open > 0;) {
    void* done = nullptr;
    bool ok = false;
    ASSERT_EQ(cq.AsyncNext(&done, &ok, std::chrono::system_clock::now() + std::chrono::seconds(30)),
              grpc::CompletionQueue::GOT_EVENT);
    const int i = static_cast<int>(reinterpret_cast<intptr_t>(done));
    if (finishing.contains(i)) {
      --open;
    } else if (ok) {
      types[i].push_back(streams[i].event.type());
      streams[i].reader->Read(&streams[i].event, tag(i));
    } else {  // the stream ended: its status
      finishing.insert(i);
      streams[i].reader->Finish(&finished[i], tag(i));
    }
  }
  const absl::StatusOr<int> status = stopped.get();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << *status;
  for (int i = 1; i < kStreams; i += 2) {
    EXPECT_THAT(types[i], ::testing::ElementsAre(v1::EVENT_TYPE_CHUNKS_ADDED, v1::EVENT_TYPE_DAEMON_RESTARTING))
        << "stream " << i;
    EXPECT_THAT(finished[i], GrpcOk()) << "stream " << i;
  }
  cq.Shutdown();
  void* drained;
  bool ok;
  while (cq.Next(&drained, &ok)) {
  }
}

TEST_F(KvdDaemonTest, ForcedDeleteTellsWatchersThePoolIsGone) {
  ASSERT_THAT(Create("kv", 64), GrpcOk());
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Attachment> a, Attach("kv", "engine"));
  v1::DeletePoolRequest del;
  del.set_name("kv");
  v1::DeletePoolResponse response;
  EXPECT_THAT(stub().DeletePool(Ctx(admin()).get(), del, &response),
              GrpcIs(grpc::StatusCode::FAILED_PRECONDITION, "kv"));
  del.set_force(true);
  ASSERT_THAT(stub().DeletePool(Ctx(admin()).get(), del, &response), GrpcOk());
  std::optional<HandledEvent> gone = a->NextEvent();
  ASSERT_TRUE(gone.has_value());
  EXPECT_EQ(gone->event.type(), v1::EVENT_TYPE_POOL_DELETED);
  EXPECT_EQ(a->mapped_chunks(), 0u);
  // The daemon cannot see the engine unmap: what it fetched stays counted until it says it let go.
  const v1::DeviceInfo after = DeviceInfo();
  EXPECT_EQ(after.committed_bytes(), response.released_bytes());
  v1::DetachRequest detach;
  detach.set_client_id(a->client_id());
  detach.set_released(true);
  v1::DetachResponse detached;
  EXPECT_THAT(stub().Detach(Ctx(admin()).get(), detach, &detached), GrpcIs(grpc::StatusCode::NOT_FOUND, "client_id"))
      << "only the engine's own session can say so";
  EXPECT_THAT(stub().Detach(Ctx(a->token()).get(), detach, &detached), GrpcOk());
  EXPECT_EQ(DeviceInfo().committed_bytes(), 0u);

  // Or its session ends.
  ASSERT_THAT(Create("kv", 64), GrpcOk());
  KVD_ASSERT_OK_AND_ASSIGN(a, Attach("kv", "engine"));
  ASSERT_THAT(stub().DeletePool(Ctx(admin()).get(), del, &response), GrpcOk());
  EXPECT_GT(DeviceInfo().committed_bytes(), 0u);
  a.reset();
  EXPECT_TRUE(WaitFor([&] { return DeviceInfo().committed_bytes() == 0; }));
}

// ---------------------------------------------------------------------------------------------
// Malformed requests

TEST_F(KvdDaemonTest, MalformedRequestsGetTheRightCodeAndTheDaemonKeepsServing) {
  ASSERT_THAT(Create("p", 64), GrpcOk());
  ASSERT_THAT(Create("big", 0, nullptr, Dims(16384)), GrpcOk());  // 1 GiB of capacity, budget 512 MiB
  ASSERT_THAT(Create("z", 64), GrpcOk());
  {
    v1::SleepRequest sleep;
    sleep.set_pool("z");
    v1::PoolUpdates updates;
    ASSERT_THAT(stub().Sleep(Ctx(admin()).get(), sleep, &updates), GrpcOk());
  }
  // An attached client of "p", through the admin session, for the lease rows.
  v1::AttachResponse attached;
  {
    v1::AttachRequest attach;
    attach.set_pool("p");
    ASSERT_THAT(stub().Attach(Ctx(admin()).get(), attach, &attached), GrpcOk());
  }

  auto create = [&](const std::function<void(v1::CreatePoolRequest&)>& edit) {
    v1::CreatePoolRequest r;
    r.set_name("new");
    *r.mutable_dims() = Dims();
    r.set_initial_blocks(0);
    edit(r);
    v1::Pool pool;
    return stub().CreatePool(Ctx(admin()).get(), r, &pool);
  };
  auto grow = [&](const std::string& pool, uint64_t blocks) { return Grow(admin(), pool, blocks); };
  auto shrink = [&](const std::string& pool, uint64_t blocks) {
    v1::ShrinkRequest r;
    r.set_pool(pool);
    r.set_target_blocks(blocks);
    v1::PoolUpdate u;
    return stub().Shrink(Ctx(admin()).get(), r, &u);
  };
  auto get = [&](const std::string& session, const std::string& pool) {
    v1::GetPoolRequest r;
    r.set_name(pool);
    v1::Pool p;
    return stub().GetPool(Ctx(session).get(), r, &p);
  };

  // A Prepare of pool "p" (64 blocks, awake) after `edit`.
  auto prepare = [&](const std::function<void(v1::PrepareRequest&)>& edit) {
    v1::PrepareRequest q;
    q.set_pool("p");
    edit(q);
    v1::PrepareResponse r;
    return stub().Prepare(Ctx(admin()).get(), q, &r);
  };

  struct Case {
    std::string what;
    std::function<grpc::Status()> call;
    grpc::StatusCode code;
    std::string substring;
  };
  using C = grpc::StatusCode;
  const std::vector<Case> cases = {
      {"empty pool name", [&] { return create([](auto& r) { r.set_name(""); }); }, C::INVALID_ARGUMENT, "name"},
      {"bad characters", [&] { return create([](auto& r) { r.set_name("kv/../etc"); }); }, C::INVALID_ARGUMENT, "name"},
      {"too long a name", [&] { return create([](auto& r) { r.set_name(std::string(65, 'a')); }); },
       C::INVALID_ARGUMENT, "name"},
      {"no dims", [&] { return create([](auto& r) { r.clear_dims(); }); }, C::INVALID_ARGUMENT, "dims"},
      {"zero heads", [&] { return create([](auto& r) { r.mutable_dims()->set_heads(0); }); }, C::INVALID_ARGUMENT,
       "dims.heads"},
      {"zero element bytes", [&] { return create([](auto& r) { r.mutable_dims()->set_element_bytes(0); }); },
       C::INVALID_ARGUMENT, "dims.element_bytes"},
      {"capacity overflow",
       [&] { return create([](auto& r) { r.mutable_dims()->set_capacity_blocks(uint64_t{1} << 62); }); },
       C::INVALID_ARGUMENT, "dims."},
      {"initial blocks past capacity", [&] { return create([](auto& r) { r.set_initial_blocks(4097); }); },
       C::INVALID_ARGUMENT, "initial_blocks"},
      {"unknown layout",
       [&] { return create([](auto& r) { r.mutable_layout_request()->set_override_layout("LBXYZ"); }); },
       C::INVALID_ARGUMENT, "layout_request.override_layout"},
      {"conflicting backends",
       [&] {
         return create([](auto& r) {
           v1::BackendRequirement* a = r.mutable_layout_request()->add_backend_requirements();
           a->set_backend("FLASH_ATTN");
           a->add_layouts("LBNHC");
           v1::BackendRequirement* b = r.mutable_layout_request()->add_backend_requirements();
           b->set_backend("FLASHINFER");
           b->add_layouts("block-outermost");
         });
       },
       C::FAILED_PRECONDITION, "FLASHINFER"},
      {"duplicate pool", [&] { return create([](auto& r) { r.set_name("p"); }); }, C::ALREADY_EXISTS, "p"},
      {"grow past capacity", [&] { return grow("p", 4097); }, C::INVALID_ARGUMENT, "target_blocks"},
      {"grow past budget", [&] { return grow("big", 16384); }, C::RESOURCE_EXHAUSTED, "1073741824 bytes"},
      {"grow to no more than committed", [&] { return grow("p", 64); }, C::INVALID_ARGUMENT, "target_blocks"},
      {"shrink to more than committed", [&] { return shrink("p", 100); }, C::INVALID_ARGUMENT, "target_blocks"},
      {"grow a sleeping pool", [&] { return grow("z", 128); }, C::FAILED_PRECONDITION, "sleeping"},
      {"grow with no pool name", [&] { return grow("", 128); }, C::INVALID_ARGUMENT, "pool"},
      {"unknown pool", [&] { return get(admin(), "nope"); }, C::NOT_FOUND, "nope"},
      {"grow an unknown pool", [&] { return grow("nope", 1); }, C::NOT_FOUND, "nope"},
      {"missing session", [&] { return get("", "p"); }, C::UNAUTHENTICATED, "kvd-session"},
      {"unknown session", [&] { return get("not-a-session", "p"); }, C::UNAUTHENTICATED, "session"},
      {"list without session",
       [&] {
         v1::ListPoolsResponse r;
         return stub().ListPools(Ctx().get(), {}, &r);
       },
       C::UNAUTHENTICATED, "kvd-session"},
      {"sleep without target",
       [&] {
         v1::PoolUpdates u;
         return stub().Sleep(Ctx(admin()).get(), {}, &u);
       },
       C::INVALID_ARGUMENT, "target"},
      {"wake without target",
       [&] {
         v1::PoolUpdates u;
         return stub().Wake(Ctx(admin()).get(), {}, &u);
       },
       C::INVALID_ARGUMENT, "target"},
      {"sleep with all=false",
       [&] {
         v1::SleepRequest r;
         r.set_all(false);
         v1::PoolUpdates u;
         return stub().Sleep(Ctx(admin()).get(), r, &u);
       },
       C::INVALID_ARGUMENT, "all"},
      {"attach with no pool",
       [&] {
         v1::AttachResponse r;
         return stub().Attach(Ctx(admin()).get(), {}, &r);
       },
       C::INVALID_ARGUMENT, "pool"},
      {"attach with a bad client name",
       [&] {
         v1::AttachRequest q;
         q.set_pool("p");
         q.set_client_name("no spaces please");
         v1::AttachResponse r;
         return stub().Attach(Ctx(admin()).get(), q, &r);
       },
       C::INVALID_ARGUMENT, "client_name"},
      {"acknowledge release 0",
       [&] {
         v1::AcknowledgeRequest q;
         q.set_client_id(attached.client_id());
         v1::AcknowledgeResponse r;
         return stub().Acknowledge(Ctx(admin()).get(), q, &r);
       },
       C::INVALID_ARGUMENT, "release_id"},
      {"watch an unknown client",
       [&] {
         v1::WatchRequest q;
         q.set_client_id("c-unknown");
         auto ctx = Ctx(admin());
         auto reader = stub().Watch(ctx.get(), q);
         v1::PoolEvent e;
         while (reader->Read(&e)) {
         }
         return reader->Finish();
       },
       C::NOT_FOUND, "client_id"},
      {"delete with a client attached",
       [&] {
         v1::DeletePoolRequest q;
         q.set_name("p");
         v1::DeletePoolResponse r;
         return stub().DeletePool(Ctx(admin()).get(), q, &r);
       },
       C::FAILED_PRECONDITION, "p"},
      {"zero an uncommitted block",
       [&] {
         v1::ZeroBlocksRequest q;
         q.set_pool("p");
         q.add_block_ids(1);
         q.add_block_ids(64);
         v1::ZeroBlocksResponse r;
         return stub().ZeroBlocks(Ctx(admin()).get(), q, &r);
       },
       C::INVALID_ARGUMENT, "block_ids[1]"},
      {"copy onto one block twice",
       [&] {
         v1::CopyBlocksRequest q;
         q.set_pool("p");
         v1::BlockCopy* a = q.add_copies();
         a->set_src(1);
         a->set_dst(2);
         v1::BlockCopy* b = q.add_copies();
         b->set_src(3);
         b->set_dst(2);
         v1::CopyBlocksResponse r;
         return stub().CopyBlocks(Ctx(admin()).get(), q, &r);
       },
       C::INVALID_ARGUMENT, "copies[1].dst"},
      {"resolve an unknown layout class",
       [&] {
         v1::ResolveLayoutRequest q;
         v1::BackendRequirement* b = q.mutable_layout_request()->add_backend_requirements();
         b->set_backend("X");
         b->add_layouts("inner-most");
         v1::ResolveLayoutResponse r;
         return stub().ResolveLayout(Ctx().get(), q, &r);
       },
       C::INVALID_ARGUMENT, "layout_request.backend_requirements[0].layouts[0]"},
      // Engine groups and peer access (docs/api.md): what libkvd never sends.
      {"prepare with no operation", [&] { return prepare([](auto&) {}); }, C::INVALID_ARGUMENT, "operation"},
      {"prepare an unknown operation",
       [&] { return prepare([](auto& q) { q.set_operation(static_cast<v1::Operation>(42)); }); }, C::INVALID_ARGUMENT,
       "operation"},
      {"prepare with no pool",
       [&] {
         return prepare([](auto& q) {
           q.set_operation(v1::OPERATION_SLEEP);
           q.clear_pool();
         });
       },
       C::INVALID_ARGUMENT, "pool"},
      {"prepare a sleep with target_blocks",
       [&] {
         return prepare([](auto& q) {
           q.set_operation(v1::OPERATION_SLEEP);
           q.set_target_blocks(8);
         });
       },
       C::INVALID_ARGUMENT, "target_blocks"},
      {"prepare a grow past capacity",
       [&] {
         return prepare([](auto& q) {
           q.set_operation(v1::OPERATION_GROW);
           q.set_target_blocks(4097);
         });
       },
       C::INVALID_ARGUMENT, "target_blocks"},
      {"prepare a grow past the budget",
       [&] {
         return prepare([](auto& q) {
           q.set_pool("big");
           q.set_operation(v1::OPERATION_GROW);
           q.set_target_blocks(16384);
         });
       },
       C::RESOURCE_EXHAUSTED, "budget"},
      {"prepare with a ttl past the maximum",
       [&] {
         return prepare([](auto& q) {
           q.set_operation(v1::OPERATION_SLEEP);
           q.set_ttl_ms(600'001);
         });
       },
       C::INVALID_ARGUMENT, "ttl_ms"},
      {"prepare a wake of an awake pool", [&] { return prepare([](auto& q) { q.set_operation(v1::OPERATION_WAKE); }); },
       C::FAILED_PRECONDITION, "already awake"},
      {"commit with no transaction",
       [&] {
         v1::PoolUpdate r;
         return stub().Commit(Ctx(admin()).get(), {}, &r);
       },
       C::INVALID_ARGUMENT, "transaction"},
      {"abort an unknown transaction",
       [&] {
         v1::AbortRequest q;
         q.set_transaction("t-unknown");
         v1::AbortResponse r;
         return stub().Abort(Ctx(admin()).get(), q, &r);
       },
       C::NOT_FOUND, "transaction"},
      {"grant a malformed device",
       [&] {
         v1::GrantPeerAccessRequest q;
         q.set_pool("p");
         q.set_device_uuid("GPU 1; rm -rf");
         v1::Pool r;
         return stub().GrantPeerAccess(Ctx(admin()).get(), q, &r);
       },
       C::INVALID_ARGUMENT, "device_uuid"},
      {"attach from an ungranted device",
       [&] {
         v1::AttachRequest q;
         q.set_pool("p");
         q.set_device_uuid("GPU-another");
         v1::AttachResponse r;
         return stub().Attach(Ctx(admin()).get(), q, &r);
       },
       C::PERMISSION_DENIED, "device_uuid"},
      {"create a group rank past its size",
       [&] {
         return create([](auto& r) {
           r.mutable_group()->set_name("g");
           r.mutable_group()->set_rank(2);
           r.mutable_group()->set_size(2);
         });
       },
       C::INVALID_ARGUMENT, "group.rank"},
  };
  for (const Case& c : cases) {
    EXPECT_THAT(c.call(), GrpcIs(c.code, c.substring)) << c.what;
  }

  // The handle channel: a lease is single-use and bound to its session.
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession other, HandleSession::Open(daemon_->handles(), "other"));
  EXPECT_THAT(other.Fetch(attached.lease().token()).status(),
              testing::StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("lease_token")))
      << "a lease of another session";
  {
    KVD_ASSERT_OK_AND_ASSIGN(auto fds, admin_->Fetch(attached.lease().token()));
    EXPECT_EQ(fds.size(), 2u);
    for (const auto& [id, fd] : fds) close(fd);
  }
  EXPECT_THAT(admin_->Fetch(attached.lease().token()).status(),
              testing::StatusIs(absl::StatusCode::kNotFound, HasSubstr("lease_token")))
      << "a used lease";
  EXPECT_THAT(admin_->Fetch("no-such-lease").status(),
              testing::StatusIs(absl::StatusCode::kNotFound, HasSubstr("lease_token")))
      << "an unknown lease";

  // Nothing of that broke the daemon, and nothing was committed by the failures.
  const v1::DeviceInfo info = DeviceInfo();
  EXPECT_EQ(info.pool_count(), 3u);
  EXPECT_EQ(info.committed_bytes(), 4 * kMiB);
  {  // and no refused Prepare left a pool held
    v1::ListPoolsResponse pools;
    ASSERT_THAT(stub().ListPools(Ctx(admin()).get(), {}, &pools), GrpcOk());
    for (const v1::Pool& p : pools.pools()) EXPECT_EQ(p.transaction(), "") << p.name();
  }
  EXPECT_EQ(kill(daemon_->pid(), 0), 0);
  EXPECT_TRUE(daemon_->process()->running());
}

// ---------------------------------------------------------------------------------------------
// Tenant safety (issue 13): identity, bounded work, detached clients, logs

TEST_F(KvdDaemonTest, SessionTokenFromAnotherUidIsRefusedAndItsPoolsLookMissing) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root, to run a client as another uid";
  ASSERT_THAT(Create("kv", 64), GrpcOk());
  // Let uid 65534 connect at all (who may connect is the operator's choice of modes; kvd's stay 0660).
  ASSERT_EQ(chmod(daemon_->dir().c_str(), 0755), 0);
  ASSERT_EQ(chmod(daemon_->socket().c_str(), 0666), 0);
  ASSERT_EQ(chmod(daemon_->handles().c_str(), 0666), 0);
  KVD_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<Child> other,
      Child::Spawn({SelfExe(), "--kvd-as-uid", "65534", daemon_->socket(), daemon_->handles(), admin(), "kv"}, {}, "",
                   /*pipes=*/true));
  // The admin's token, presented from uid 65534, is not a bearer secret.
  const std::optional<std::string> stolen = other->WaitLine("stolen ");
  ASSERT_TRUE(stolen.has_value());
  EXPECT_THAT(*stolen, HasSubstr("stolen PERMISSION_DENIED kvd-session: the session belongs to uid 0; this "
                                 "connection is uid 65534"));
  // Its own session works, sees no pool, and gets the same answer for a pool it may not use as for one
  // that does not exist.
  const std::optional<std::string> own = other->WaitLine("own ");
  ASSERT_TRUE(own.has_value());
  EXPECT_EQ(*own, "own OK ");
  const std::optional<std::string> get = other->WaitLine("get ");
  const std::optional<std::string> missing = other->WaitLine("missing ");
  ASSERT_TRUE(get.has_value() && missing.has_value());
  EXPECT_EQ(*get, "get NOT_FOUND pool kv does not exist");
  EXPECT_EQ(*missing, "missing NOT_FOUND pool no-such-pool does not exist");
  EXPECT_THAT(other->Wait(kWait), testing::IsOkAndHolds(0));
  // The owner's token on the owner's own connections still works.
  EXPECT_EQ(Get("kv").name(), "kv");
}

TEST_F(KvdDaemonTest, LeaseIsNotRedeemableAfterItsClientDetached) {
  ASSERT_THAT(Create("kv", 64), GrpcOk());
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession session, HandleSession::Open(daemon_->handles(), "detacher"));
  v1::AttachRequest attach;
  attach.set_pool("kv");
  v1::AttachResponse attached;
  ASSERT_THAT(stub().Attach(Ctx(session.token()).get(), attach, &attached), GrpcOk());
  ASSERT_GT(attached.lease().chunk_ids_size(), 0);
  v1::DetachRequest detach;
  detach.set_pool("kv");
  detach.set_client_id(attached.client_id());
  v1::DetachResponse detached;
  ASSERT_THAT(stub().Detach(Ctx(session.token()).get(), detach, &detached), GrpcOk());
  absl::StatusOr<std::vector<std::pair<uint64_t, int>>> fds = session.Fetch(attached.lease().token());
  if (fds.ok()) {
    for (const auto& [id, fd] : *fds) close(fd);
  }
  EXPECT_THAT(fds.status(), testing::StatusIs(absl::StatusCode::kNotFound, HasSubstr("lease_token")));
  // It never fetched a chunk, so it holds none: releasing the pool's memory waits for nobody.
  v1::SleepRequest sleep;
  sleep.set_pool("kv");
  v1::PoolUpdates slept;
  ASSERT_THAT(stub().Sleep(Ctx(admin()).get(), sleep, &slept), GrpcOk());
  EXPECT_EQ(Get("kv").pending_release_bytes(), 0u);
  EXPECT_EQ(DeviceInfo().committed_bytes(), 0u);
}

// docs/api.md, "Pushed handles".
TEST_F(KvdDaemonTest, AnAttachThatAsksPushesItsLeaseOnTheSessionsConnectionBeforeItReplies) {
  ASSERT_THAT(Create("kv", 64), GrpcOk());
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession session, HandleSession::Open(daemon_->handles(), "pusher"));
  v1::AttachResponse attached;
  ASSERT_THAT(Attach(session, "kv", /*push_handles=*/true, &attached), GrpcOk());
  ASSERT_TRUE(attached.handles_pushed());
  ASSERT_EQ(attached.lease().chunk_ids_size(), attached.pool().chunks_size());
  EXPECT_TRUE(session.Alive());
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession::LeasedFds pushed, session.TakePushed(attached.lease().token()));
  ASSERT_EQ(pushed.size(), static_cast<size_t>(attached.lease().chunk_ids_size()));
  for (size_t i = 0; i < pushed.size(); ++i) {
    const v1::Chunk& chunk = attached.pool().chunks(static_cast<int>(i));
    EXPECT_EQ(pushed[i].first, attached.lease().chunk_ids(static_cast<int>(i)));
    EXPECT_EQ(pushed[i].first, chunk.id());
    struct stat st {};
    ASSERT_EQ(fstat(pushed[i].second, &st), 0);
    EXPECT_EQ(static_cast<uint64_t>(st.st_size), chunk.bytes());  // the chunk's memfd
  }
  CloseLeased(pushed);
  // The push redeemed the lease.
  absl::StatusOr<HandleSession::LeasedFds> again = session.Fetch(attached.lease().token());
  if (again.ok()) CloseLeased(*again);
  EXPECT_THAT(again.status(), testing::StatusIs(absl::StatusCode::kNotFound, HasSubstr("already used")));
  // A client that does not ask gets its lease to fetch, and nothing on the session's connection.
  v1::AttachResponse plain;
  ASSERT_THAT(Attach(session, "kv", /*push_handles=*/false, &plain), GrpcOk());
  EXPECT_FALSE(plain.handles_pushed());
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession::LeasedFds fetched, session.Fetch(plain.lease().token()));
  EXPECT_EQ(fetched.size(), static_cast<size_t>(plain.lease().chunk_ids_size()));
  CloseLeased(fetched);
  EXPECT_THAT(session.TakePushed(plain.lease().token()),
              testing::StatusIs(absl::StatusCode::kInternal, HasSubstr("holds no batch")));
  EXPECT_EQ(Get("kv").clients_size(), 2);
}

// docs/api.md, "Pushed handles": a session that does not read its connection fills its queue; the Attach that
// finds no room answers handles_pushed false and its lease is left to fetch, whole, and what was pushed before
// stays queued in order.
TEST_F(KvdDaemonTest, AnAttachWhoseSessionsQueueIsFullLeavesItsLeaseToFetch) {
  // A Unix stream socket's default send buffer holds some 280 small packets: two pools of at most 250
  // clients each (256 per pool) fill it.
  const std::string pools[] = {"kv", "kv2"};
  for (const std::string& pool : pools) ASSERT_THAT(Create(pool, 64), GrpcOk());
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession session, HandleSession::Open(daemon_->handles(), "not-reading"));
  std::vector<v1::AttachResponse> pushed;
  v1::AttachResponse refused;
  for (int i = 0; i < 500 && !refused.has_lease(); ++i) {
    v1::AttachResponse attached;
    ASSERT_THAT(Attach(session, pools[i % 2], /*push_handles=*/true, &attached), GrpcOk());
    (attached.handles_pushed() ? pushed.emplace_back() : refused) = std::move(attached);
  }
  ASSERT_TRUE(refused.has_lease()) << pushed.size() << " leases pushed and the queue still had room";
  ASSERT_FALSE(pushed.empty());
  EXPECT_TRUE(session.Alive());
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession::LeasedFds fetched, session.Fetch(refused.lease().token()));
  ASSERT_EQ(fetched.size(), static_cast<size_t>(refused.lease().chunk_ids_size()));
  for (size_t i = 0; i < fetched.size(); ++i) {
    EXPECT_EQ(fetched[i].first, refused.lease().chunk_ids(static_cast<int>(i)));
    struct stat st {};
    ASSERT_EQ(fstat(fetched[i].second, &st), 0);
    EXPECT_EQ(static_cast<uint64_t>(st.st_size), refused.pool().chunks(static_cast<int>(i)).bytes());
  }
  CloseLeased(fetched);
  for (const v1::AttachResponse& a : pushed) {
    KVD_ASSERT_OK_AND_ASSIGN(HandleSession::LeasedFds batch, session.TakePushed(a.lease().token()));
    EXPECT_EQ(batch.size(), static_cast<size_t>(a.lease().chunk_ids_size()));
    CloseLeased(batch);
  }
  // Read, the queue has room again.
  v1::AttachResponse again;
  ASSERT_THAT(Attach(session, "kv", /*push_handles=*/true, &again), GrpcOk());
  EXPECT_TRUE(again.handles_pushed());
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession::LeasedFds last, session.TakePushed(again.lease().token()));
  CloseLeased(last);
  EXPECT_EQ(Get("kv").clients_size() + Get("kv2").clients_size(), static_cast<int>(pushed.size()) + 2);
}

TEST_F(KvdDaemonTest, DetachedClientKeepsItsBytesCountedUntilItAcknowledgesOrItsSessionEnds) {
  // Chunks of blocks [0, 64), [64, 512) and [512, 1024) in each of the two segments.
  constexpr uint64_t kFirstRelease = 2 * 512 * kBlockBytes;
  constexpr uint64_t kSecondRelease = 2 * 448 * kBlockBytes;
  ASSERT_THAT(Create("kv", 64), GrpcOk());
  ASSERT_THAT(Grow(admin(), "kv", 512), GrpcOk());
  ASSERT_THAT(Grow(admin(), "kv", 1024), GrpcOk());
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Attachment> a, Attach("kv", "holder", /*auto_ack=*/false));
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Attachment> b, Attach("kv", "keeper", /*auto_ack=*/true));
  auto detach = [](Attachment& x) {
    v1::DetachRequest request;
    request.set_pool("kv");
    request.set_client_id(x.client_id());
    v1::DetachResponse response;
    return x.stub().Detach(Ctx(x.token()).get(), request, &response);
  };
  auto shrink = [&](uint64_t blocks) {
    v1::ShrinkRequest request;
    request.set_pool("kv");
    request.set_target_blocks(blocks);
    request.set_force(true);  // past the detached clients' session's other clients
    v1::PoolUpdate response;
    return stub().Shrink(Ctx(admin()).get(), request, &response);
  };

  // a is told of a release, detaches without acknowledging it: the release still waits for a.
  ASSERT_THAT(shrink(512), GrpcOk());
  std::optional<HandledEvent> released = a->NextEvent();
  ASSERT_TRUE(released.has_value());
  ASSERT_EQ(released->event.type(), v1::EVENT_TYPE_CHUNKS_RELEASED);
  std::optional<HandledEvent> b_released = b->NextEvent();
  ASSERT_TRUE(b_released.has_value());
  ASSERT_EQ(b_released->event.type(), v1::EVENT_TYPE_CHUNKS_RELEASED);
  ASSERT_EQ(b_released->error, "");  // b acknowledged
  ASSERT_THAT(detach(*a), GrpcOk());
  EXPECT_EQ(Get("kv").clients_size(), 1);
  EXPECT_EQ(Get("kv").pending_release_bytes(), kFirstRelease);
  // ... until it acknowledges, detached as it is.
  EXPECT_TRUE(a->AcknowledgePending().ok());
  EXPECT_EQ(Get("kv").pending_release_bytes(), 0u);

  // b detaches while it maps the pool, and never unmaps: a later shrink counts the blocks b (and a,
  // detached too) were handed as pending release, in the pool and in the device's committed bytes,
  // until their sessions end.
  ASSERT_THAT(detach(*b), GrpcOk());
  ASSERT_THAT(shrink(64), GrpcOk());
  EXPECT_EQ(Get("kv").pending_release_bytes(), kSecondRelease);
  EXPECT_EQ(DeviceInfo().committed_bytes(), 4 * kMiB + kSecondRelease);
  a->Close();
  b->Close();
  EXPECT_TRUE(WaitFor([&] { return Get("kv").pending_release_bytes() == 0; }));
  EXPECT_EQ(DeviceInfo().committed_bytes(), 4 * kMiB);
}

TEST_F(KvdDaemonTest, ReattachingInTheSameSessionTakesOverWhatTheDetachedClientHeld) {
  ASSERT_THAT(Create("kv", 64), GrpcOk());
  ASSERT_THAT(Grow(admin(), "kv", 512), GrpcOk());
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession session, HandleSession::Open(daemon_->handles(), "follower"));
  auto attach = [&](v1::AttachResponse* attached) {
    v1::AttachRequest request;
    request.set_pool("kv");
    return stub().Attach(Ctx(session.token()).get(), request, attached);
  };
  v1::AttachResponse first;
  ASSERT_THAT(attach(&first), GrpcOk());
  KVD_ASSERT_OK_AND_ASSIGN(auto fds, session.Fetch(first.lease().token()));
  for (const auto& [id, fd] : fds) close(fd);
  v1::DetachRequest detach;
  detach.set_client_id(first.client_id());
  v1::DetachResponse detached;
  ASSERT_THAT(stub().Detach(Ctx(session.token()).get(), detach, &detached), GrpcOk());
  v1::ShrinkRequest shrink;
  shrink.set_pool("kv");
  shrink.set_target_blocks(64);
  v1::PoolUpdate shrunk;
  ASSERT_THAT(stub().Shrink(Ctx(session.token()).get(), shrink, &shrunk), GrpcOk());
  ASSERT_GT(Get("kv").pending_release_bytes(), 0u);  // the detached client fetched those chunks

  // The same session attaches again (a follower whose stream broke): the new client is told of the
  // release and its acknowledgement settles it.
  v1::AttachResponse second;
  ASSERT_THAT(attach(&second), GrpcOk());
  v1::WatchRequest watch;
  watch.set_client_id(second.client_id());
  std::unique_ptr<grpc::ClientContext> ctx = Ctx(session.token());
  std::unique_ptr<grpc::ClientReader<v1::PoolEvent>> events = stub().Watch(ctx.get(), watch);
  v1::PoolEvent event;
  ASSERT_TRUE(events->Read(&event));
  EXPECT_EQ(event.type(), v1::EVENT_TYPE_CHUNKS_RELEASED);
  EXPECT_EQ(event.release_id(), shrunk.release_id());
  v1::AcknowledgeRequest ack;
  ack.set_client_id(second.client_id());
  ack.set_release_id(event.release_id());
  v1::AcknowledgeResponse acked;
  ASSERT_THAT(stub().Acknowledge(Ctx(session.token()).get(), ack, &acked), GrpcOk());
  EXPECT_EQ(acked.pending_release_bytes(), 0u);
  ctx->TryCancel();
}

// ---------------------------------------------------------------------------------------------
// Shrink to the exact target, Compact and the pause (docs/api.md, "Pauses and reshaping")

TEST_F(KvdDaemonTest, CompactRewritesAFragmentedPoolAsOneChunkPerSegment) {
  ASSERT_THAT(Create("frag", 64), GrpcOk());  // 64 blocks of 32 KiB: one 2 MiB granule per segment
  for (uint64_t b = 128; b <= 512; b += 64) ASSERT_THAT(Grow(admin(), "frag", b), GrpcOk());
  const v1::Pool before = Get("frag");
  ASSERT_GT(before.chunks_size(), 2 * static_cast<int>(before.geometry().segments()));

  v1::CompactRequest request;
  request.set_pool("frag");
  v1::PoolUpdate update;
  ASSERT_THAT(stub().Compact(Ctx(admin()).get(), request, &update), GrpcOk());
  const v1::Reshape& r = update.reshape();
  EXPECT_EQ(r.chunks_before(), static_cast<uint32_t>(before.chunks_size()));
  EXPECT_EQ(r.chunks_after(), before.geometry().segments());
  EXPECT_EQ(update.pool().chunks_size(), static_cast<int>(before.geometry().segments()));
  EXPECT_EQ(r.copied_bytes(), before.committed_bytes());
  EXPECT_EQ(r.chunks_replaced(), static_cast<uint32_t>(before.chunks_size()));
  EXPECT_EQ(r.paused_clients(), 0u) << "nobody attached: nobody paused";
  EXPECT_EQ(update.pool().committed_bytes(), before.committed_bytes());
  EXPECT_EQ(update.pool().committed_blocks(), before.committed_blocks());
  EXPECT_GT(update.pool().generation(), before.generation());
  EXPECT_EQ(update.added_size(), static_cast<int>(before.geometry().segments()));
  EXPECT_EQ(update.released_chunk_ids_size(), before.chunks_size());
  EXPECT_EQ(DeviceInfo().committed_bytes(), before.committed_bytes()) << "the old chunks' bytes went back";

  request.set_pool("nope");
  EXPECT_THAT(stub().Compact(Ctx(admin()).get(), request, &update), GrpcIs(grpc::StatusCode::NOT_FOUND, "nope"));
  request.set_pool("");
  EXPECT_THAT(stub().Compact(Ctx(admin()).get(), request, &update), GrpcIs(grpc::StatusCode::INVALID_ARGUMENT, "pool"));
  request.set_pool("frag");
  request.mutable_pause()->set_timeout_ms(600001);
  EXPECT_THAT(stub().Compact(Ctx(admin()).get(), request, &update),
              GrpcIs(grpc::StatusCode::INVALID_ARGUMENT, "pause.timeout_ms"));
}

TEST_F(KvdDaemonTest, ShrinkReachesTheTargetAndWholeChunksOnlySaysWhenItDoesNot) {
  v1::Pool pool;
  ASSERT_THAT(Create("p", 0, &pool), GrpcOk());
  const uint64_t capacity = pool.geometry().dims().capacity_blocks();
  ASSERT_THAT(Grow(admin(), "p", capacity), GrpcOk());
  const uint64_t granularity = DeviceInfo().granularity_bytes();
  const uint64_t target = capacity / 3;
  const uint64_t prefix = (target * pool.geometry().block_stride() + granularity - 1) / granularity * granularity;

  std::unique_ptr<Attachment> engine = *Attach("p", "engine");
  v1::ShrinkRequest request;
  request.set_pool("p");
  request.set_target_blocks(target);
  v1::PoolUpdate update;
  EXPECT_THAT(stub().Shrink(Ctx(admin()).get(), request, &update),
              GrpcIs(grpc::StatusCode::FAILED_PRECONDITION, engine->client_id()));
  EXPECT_FALSE(Get("p").clients(0).pausable());

  request.set_whole_chunks_only(true);
  ASSERT_THAT(stub().Shrink(Ctx(admin()).get(), request, &update), GrpcOk());
  EXPECT_FALSE(update.reshape().target_reached());
  EXPECT_GT(update.pool().committed_blocks(), target);
  request.set_whole_chunks_only(false);
  request.mutable_live()->add_blocks(1);
  request.set_whole_chunks_only(true);
  EXPECT_THAT(stub().Shrink(Ctx(admin()).get(), request, &update),
              GrpcIs(grpc::StatusCode::INVALID_ARGUMENT, "whole_chunks_only"));
  engine.reset();  // detached (once the daemon saw its stream and session end): now nobody needs to pause
  ASSERT_TRUE(WaitFor([&] { return Get("p").client_count() == 0; }));

  request.Clear();
  request.set_pool("p");
  request.set_target_blocks(target);
  ASSERT_THAT(stub().Shrink(Ctx(admin()).get(), request, &update), GrpcOk());
  EXPECT_TRUE(update.reshape().target_reached());
  EXPECT_EQ(update.pool().committed_bytes(), prefix * pool.geometry().segments());
  EXPECT_EQ(update.reshape().chunks_added(), pool.geometry().segments());
  EXPECT_EQ(update.reshape().copied_bytes(), prefix * pool.geometry().segments());
  EXPECT_EQ(DeviceInfo().committed_bytes(), prefix * pool.geometry().segments());

  request.set_target_blocks(1);
  for (int i = 0; i < 65537; ++i) request.mutable_live()->add_blocks(0);
  EXPECT_THAT(stub().Shrink(Ctx(admin()).get(), request, &update),
              GrpcIs(grpc::StatusCode::RESOURCE_EXHAUSTED, "live.blocks: 65537 in one request"));
}

// 64 KiB granules: a pool of hundreds of chunks in a few MiB, whose replies are past the size after which the daemon
// trims its heap (Note [Replies are built on an arena] in docs/architecture.md).
class KvdDaemonSmallGranuleTest : public KvdDaemonTest {
 protected:
  DaemonConfig Config() override { return {.extra_args = {"--host-granularity=64KiB"}}; }
};

TEST_F(KvdDaemonSmallGranuleTest, RepliesOfHundredsOfChunksCarryThePoolAsGetPoolDoes) {
  constexpr int kSteps = 160;  // one granule (2 blocks) per segment per grow, 2 segments: 320 chunks
  ASSERT_THAT(Create("kv", 0, nullptr, Dims(2 * kSteps)), GrpcOk());
  v1::PoolUpdate grown;
  for (int k = 1; k <= kSteps; ++k) ASSERT_THAT(Grow(admin(), "kv", 2 * k, &grown), GrpcOk()) << k;
  EXPECT_GT(grown.ByteSizeLong(), 4096u) << "a reply past the size after which the daemon trims its heap";
  auto same_chunks = [](const v1::Pool& a, const v1::Pool& b) {
    if (a.chunks_size() != b.chunks_size()) return false;
    for (int i = 0; i < a.chunks_size(); ++i) {
      if (a.chunks(i).SerializeAsString() != b.chunks(i).SerializeAsString()) return false;
    }
    return true;
  };
  v1::Pool got = Get("kv");
  ASSERT_EQ(got.chunks_size(), 2 * kSteps);
  EXPECT_TRUE(same_chunks(grown.pool(), got));
  EXPECT_EQ(grown.pool().committed_blocks(), 2u * kSteps);
  EXPECT_EQ(grown.pool().generation(), got.generation());
  ASSERT_EQ(grown.added_size(), 2);
  EXPECT_EQ(grown.added(1).SerializeAsString(), got.chunks(got.chunks_size() - 1).SerializeAsString());

  // Attach: the pool and a lease of every chunk, which the client maps.
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Attachment> a, Attach("kv", "engine"));
  EXPECT_TRUE(same_chunks(a->pool(), got));
  EXPECT_EQ(a->mapped_chunks(), static_cast<size_t>(2 * kSteps));
  ASSERT_TRUE(a->Write(0, 64 * kKiB, 0x5a).ok());

  // Shrink to half, past the attached client: the reply is the pool GetPool sees after it.
  auto shrunk = ShrinkAsync("kv", kSteps).get();
  ASSERT_THAT(shrunk.first, GrpcOk());
  got = Get("kv");
  ASSERT_EQ(got.chunks_size(), kSteps);
  EXPECT_TRUE(same_chunks(shrunk.second.pool(), got));
  EXPECT_EQ(shrunk.second.released_chunk_ids_size(), kSteps);
  EXPECT_TRUE(a->Check(0, 64 * kKiB, 0x5a).ok()) << "the kept chunks keep their bytes";
}

TEST_F(KvdDaemonTest, AcknowledgeTakesExactlyOneOfReleaseAndPause) {
  ASSERT_THAT(Create("p", 16), GrpcOk());
  std::unique_ptr<Attachment> engine = *Attach("p", "engine");
  v1::AcknowledgeRequest request;
  request.set_client_id(engine->client_id());
  v1::AcknowledgeResponse response;
  EXPECT_THAT(stub().Acknowledge(Ctx(engine->token()).get(), request, &response),
              GrpcIs(grpc::StatusCode::INVALID_ARGUMENT, "release_id, pause_id: set exactly one"));
  request.set_release_id(3);
  request.set_pause_id(4);
  EXPECT_THAT(stub().Acknowledge(Ctx(engine->token()).get(), request, &response),
              GrpcIs(grpc::StatusCode::INVALID_ARGUMENT, "release_id, pause_id: set exactly one"));
  request.set_release_id(0);
  EXPECT_THAT(stub().Acknowledge(Ctx(engine->token()).get(), request, &response),
              GrpcIs(grpc::StatusCode::NOT_FOUND, "pause_id: 4"));
}

TEST_F(KvdDaemonTest, ZeroBlocksRefusesARepeatedBlockBeforeAnyWork) {
  ASSERT_THAT(Create("kv", 64), GrpcOk());
  v1::ZeroBlocksRequest request;
  request.set_pool("kv");
  for (uint64_t id : {3, 5, 7, 5}) request.add_block_ids(id);
  v1::ZeroBlocksResponse response;
  EXPECT_THAT(stub().ZeroBlocks(Ctx(admin()).get(), request, &response),
              GrpcIs(grpc::StatusCode::INVALID_ARGUMENT, "block_ids[3]: block 5 repeats block_ids[1]"));
}

TEST_F(KvdDaemonTest, LongBlockOperationStopsAtTheCallersDeadline) {
  // 448 MiB committed: zeroing all of it takes longer than the call allows.
  constexpr uint64_t kBlocks = 7168;
  ASSERT_THAT(Create("kv", kBlocks, nullptr, Dims(8192)), GrpcOk());
  v1::ZeroBlocksRequest request;
  request.set_pool("kv");
  for (uint64_t id = 0; id < kBlocks; ++id) request.add_block_ids(id);
  v1::ZeroBlocksResponse response;
  EXPECT_THAT(stub().ZeroBlocks(Ctx(admin(), absl::Milliseconds(20)).get(), request, &response),
              GrpcIs(grpc::StatusCode::DEADLINE_EXCEEDED, ""));
  // The daemon stopped at a slice boundary rather than finishing the work for nobody.
  EXPECT_TRUE(WaitFor([&] {
    return absl::StrContains(
        daemon_->log(), "rpc ZeroBlocks failed: DEADLINE_EXCEEDED: ZeroBlocks: the deadline of the call passed after");
  })) << daemon_->log();
  EXPECT_EQ(Get("kv").committed_blocks(), kBlocks);
}

TEST_F(KvdDaemonTest, NothingFromTheWireReachesTheLogUnescaped) {
  // A pool name with a newline and a forged log line after it.
  v1::GetPoolRequest get;
  get.set_name("kv\n2026-01-01 00:00:00.000 info kvd stopped");
  v1::Pool pool;
  EXPECT_THAT(stub().GetPool(Ctx(admin()).get(), get, &pool), GrpcIs(grpc::StatusCode::NOT_FOUND, "does not exist"));
  // Raw bytes instead of HTTP/2 on the control socket.
  {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, daemon_->socket().c_str(), daemon_->socket().size() + 1);
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
    constexpr char kGarbage[] = "\x00\xff\xfe\x1b[31m\nkvd stopped\r\n\x80\x81 PRI * HTTP/2.0 garbage";
    const std::string garbage(kGarbage, sizeof(kGarbage) - 1);
    ASSERT_EQ(write(fd, garbage.data(), garbage.size()), static_cast<ssize_t>(garbage.size()));
    pollfd p{.fd = fd, .events = POLLIN, .revents = 0};
    poll(&p, 1, 2000);  // gRPC answers and closes; either way the bytes have been read
    close(fd);
  }
  EXPECT_EQ(DeviceInfo().backend(), v1::BACKEND_HOST);  // still serving
  ASSERT_TRUE(WaitFor([&] { return absl::StrContains(daemon_->log(), "rpc GetPool failed"); }));
  const std::string log = daemon_->log();
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    if (absl::StrContains(line, "kvd stopped")) {
      EXPECT_THAT(std::string(line), HasSubstr("rpc GetPool failed")) << "a forged line";
    }
    for (char c : line) {
      const auto u = static_cast<unsigned char>(c);
      EXPECT_TRUE(u >= 0x20 && u < 0x7f) << "byte " << static_cast<int>(u) << " in log line: " << absl::CEscape(line);
    }
  }
}

// Sleep's and Wake's target is one pool or all of them: a request that sets neither, all = false or an empty
// pool name is refused naming the field, and changes nothing.
TEST_F(KvdDaemonTest, SleepAndWakeRefuseATargetThatNamesNoPool) {
  ASSERT_THAT(Create("kv", 64), GrpcOk());
  v1::PoolUpdates updates;
  v1::SleepRequest sleep;
  EXPECT_THAT(stub().Sleep(Ctx(admin()).get(), sleep, &updates),
              GrpcIs(grpc::StatusCode::INVALID_ARGUMENT, "target: set pool (one pool) or all (every awake pool)"));
  sleep.set_all(false);
  EXPECT_THAT(stub().Sleep(Ctx(admin()).get(), sleep, &updates),
              GrpcIs(grpc::StatusCode::INVALID_ARGUMENT, "all: must be true when set"));
  sleep.set_pool("");
  EXPECT_THAT(stub().Sleep(Ctx(admin()).get(), sleep, &updates), GrpcIs(grpc::StatusCode::INVALID_ARGUMENT, "pool"));
  EXPECT_EQ(Get("kv").state(), v1::POOL_STATE_AWAKE);
  v1::WakeRequest wake;
  EXPECT_THAT(stub().Wake(Ctx(admin()).get(), wake, &updates),
              GrpcIs(grpc::StatusCode::INVALID_ARGUMENT, "target: set pool (one pool) or all (every sleeping pool)"));
  wake.set_all(false);
  EXPECT_THAT(stub().Wake(Ctx(admin()).get(), wake, &updates),
              GrpcIs(grpc::StatusCode::INVALID_ARGUMENT, "all: must be true when set"));
  // The same requests with a target work.
  sleep.set_pool("kv");
  ASSERT_THAT(stub().Sleep(Ctx(admin()).get(), sleep, &updates), GrpcOk());
  EXPECT_EQ(Get("kv").state(), v1::POOL_STATE_SLEEPING);
  wake.set_all(true);
  ASSERT_THAT(stub().Wake(Ctx(admin()).get(), wake, &updates), GrpcOk());
  EXPECT_EQ(Get("kv").state(), v1::POOL_STATE_AWAKE);
}

TEST_F(KvdDaemonTest, UnparseableRequestIsInvalidArgumentNamingItsType) {
  // GetPoolRequest.name (field 1) holding bytes that are not UTF-8.
  const grpc::internal::RpcMethod method("/kvd.v1.Kvd/GetPool", grpc::internal::RpcMethod::NORMAL_RPC);
  grpc::ByteBuffer response;
  grpc::Status s = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      daemon_->channel().get(), method, Ctx(admin()).get(), Buffer(LengthDelimited(1, "kv\xff\xfe")), &response);
  EXPECT_THAT(s, GrpcIs(grpc::StatusCode::INVALID_ARGUMENT,
                        "request: the /kvd.v1.Kvd/GetPool request is not a valid kvd.v1.GetPoolRequest"));
  // Not a protobuf message at all, on a call that needs no session.
  const grpc::internal::RpcMethod info("/kvd.v1.Kvd/GetDeviceInfo", grpc::internal::RpcMethod::NORMAL_RPC);
  s = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(daemon_->channel().get(), info, Ctx().get(),
                                                                            Buffer("\xff\xff\xff"), &response);
  EXPECT_THAT(s, GrpcIs(grpc::StatusCode::INVALID_ARGUMENT, "kvd.v1.GetDeviceInfoRequest"));
  // GetPool is a quick RPC, a raw method that kvd parses itself; GetDeviceInfo a plain method of the synchronous
  // server, whose bad request the parse-error interceptor answers; Grow is on the synchronous server too, a streamed
  // unary method that reads its request itself: the same answer (Note [Quick RPCs answer inline], Note [Replies are
  // built on an arena]).
  const grpc::internal::RpcMethod grow("/kvd.v1.Kvd/Grow", grpc::internal::RpcMethod::NORMAL_RPC);
  s = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      daemon_->channel().get(), grow, Ctx(admin()).get(), Buffer(LengthDelimited(1, "kv\xff\xfe")), &response);
  EXPECT_THAT(s, GrpcIs(grpc::StatusCode::INVALID_ARGUMENT,
                        "request: the /kvd.v1.Kvd/Grow request is not a valid kvd.v1.GrowRequest"));
  // The server-streaming Watch, a raw method of kvd's too: the same answer.
  const grpc::internal::RpcMethod watch("/kvd.v1.Kvd/Watch", grpc::internal::RpcMethod::SERVER_STREAMING);
  auto ctx = Ctx(admin());
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> stream(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(daemon_->channel().get(), watch, ctx.get(),
                                                                    Buffer(LengthDelimited(1, "c\xff"))));
  grpc::ByteBuffer event;
  EXPECT_FALSE(stream->Read(&event));
  EXPECT_THAT(stream->Finish(), GrpcIs(grpc::StatusCode::INVALID_ARGUMENT,
                                       "request: the /kvd.v1.Kvd/Watch request is not a valid kvd.v1.WatchRequest"));
  // An unknown method is still gRPC's own UNIMPLEMENTED.
  const grpc::internal::RpcMethod unknown("/kvd.v1.Kvd/NoSuchMethod", grpc::internal::RpcMethod::NORMAL_RPC);
  s = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(daemon_->channel().get(), unknown,
                                                                            Ctx().get(), Buffer(""), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNIMPLEMENTED) << s.error_message();
  EXPECT_EQ(DeviceInfo().backend(), v1::BACKEND_HOST);
}

// A kvd with few file descriptors: a grow that runs out of them says so, not that memory is short.
class KvdDaemonFewFdsTest : public KvdDaemonTest {
 protected:
  DaemonConfig Config() override {
    return {.extra_args = {"--max-chunk=2MiB"}, .wrapper = {"/usr/bin/prlimit", "--nofile=64", "--"}};
  }
};

TEST_F(KvdDaemonFewFdsTest, GrowOutOfFileDescriptorsSaysSoAndChangesNothing) {
  if (access("/usr/bin/prlimit", X_OK) != 0) GTEST_SKIP() << "needs /usr/bin/prlimit";
  ASSERT_THAT(Create("kv", 64), GrpcOk());
  // 2 x 60 chunks of 2 MiB, each an FD of its own: more than the daemon has left.
  v1::PoolUpdate update;
  const grpc::Status grown = Grow(admin(), "kv", 4096, &update);
  EXPECT_THAT(grown, GrpcIs(grpc::StatusCode::RESOURCE_EXHAUSTED, "out of file descriptors, not out of memory"));
  EXPECT_THAT(grown.error_message(), ::testing::Not(HasSubstr("free")));
  EXPECT_EQ(Get("kv").committed_blocks(), 64u);
  EXPECT_EQ(DeviceInfo().committed_bytes(), 4 * kMiB);
}

// A kvd with little address space: a pool whose capacity does not fit says how much it asked and how
// much is free.
// AddressSanitizer and ThreadSanitizer reserve terabytes of shadow address space at start: a daemon
// built with either cannot start under an address-space limit at all.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kShadowMemorySanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kShadowMemorySanitizer = true;
#else
constexpr bool kShadowMemorySanitizer = false;
#endif
#else
constexpr bool kShadowMemorySanitizer = false;
#endif

class KvdDaemonSmallAddressSpaceTest : public KvdDaemonTest {
 protected:
  void SetUp() override {
    if (kShadowMemorySanitizer) GTEST_SKIP() << "an ASan or TSan build cannot run under an address-space limit";
    KvdDaemonTest::SetUp();
  }
  DaemonConfig Config() override { return {.wrapper = {"/usr/bin/prlimit", "--as=8589934592", "--"}}; }
};

TEST_F(KvdDaemonSmallAddressSpaceTest, PoolPastTheAddressSpaceStatesBytesAskedAndFree) {
  if (access("/usr/bin/prlimit", X_OK) != 0) GTEST_SKIP() << "needs /usr/bin/prlimit";
  // 2 segments of 262144 blocks of 32 KiB: 16 GiB of address space, twice the daemon's limit.
  v1::Pool pool;
  const grpc::Status created = Create("kv", 0, &pool, Dims(262144));
  EXPECT_THAT(created,
              GrpcIs(grpc::StatusCode::RESOURCE_EXHAUSTED, "dims.capacity_blocks: pool kv needs 17179869184 bytes ("));
  EXPECT_THAT(created.error_message(), HasSubstr(") of address space but only "));
  EXPECT_THAT(created.error_message(), ::testing::ContainsRegex("only [0-9]+ bytes \\([^)]*\\) are free"));
  EXPECT_THAT(stub().GetPool(
                  Ctx(admin()).get(),
                  [] {
                    v1::GetPoolRequest r;
                    r.set_name("kv");
                    return r;
                  }(),
                  &pool),
              GrpcIs(grpc::StatusCode::NOT_FOUND, "kv"));
}

// Chunks of 2 MiB: a pool of 2 x 8192 blocks of 32 KiB is 256 chunks, more than one packet carries.
class KvdDaemonSmallChunksTest : public KvdDaemonTest {
 protected:
  DaemonConfig Config() override { return {.extra_args = {"--max-chunk=2MiB"}}; }
};

TEST_F(KvdDaemonSmallChunksTest, ALeaseOfMoreThanOnePacketIsLeftToFetchInsteadOfPushed) {
  ASSERT_THAT(Create("kv", 8192, nullptr, Dims(8192)), GrpcOk());
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession session, HandleSession::Open(daemon_->handles(), "pusher"));
  v1::AttachResponse attached;
  ASSERT_THAT(Attach(session, "kv", /*push_handles=*/true, &attached), GrpcOk());
  EXPECT_FALSE(attached.handles_pushed());
  ASSERT_EQ(attached.lease().chunk_ids_size(), 256);
  EXPECT_TRUE(session.Alive());
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession::LeasedFds fetched, session.Fetch(attached.lease().token()));
  EXPECT_EQ(fetched.size(), 256u);
  CloseLeased(fetched);
}

class KvdDaemonShortLeaseTest : public KvdDaemonTest {
 protected:
  DaemonConfig Config() override { return {.extra_args = {"--lease-ttl=1ms"}}; }
};

TEST_F(KvdDaemonShortLeaseTest, ExpiredLeaseIsRefused) {
  ASSERT_THAT(Create("kv", 64), GrpcOk());
  v1::AttachRequest attach;
  attach.set_pool("kv");
  v1::AttachResponse attached;
  ASSERT_THAT(stub().Attach(Ctx(admin()).get(), attach, &attached), GrpcOk());
  const int64_t expires = static_cast<int64_t>(attached.lease().expires_at_unix_ms());
  ASSERT_TRUE(WaitFor([&] { return absl::ToUnixMillis(absl::Now()) > expires + 1; }));
  EXPECT_THAT(admin_->Fetch(attached.lease().token()).status(),
              testing::StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("lease_token")));
}

// ---------------------------------------------------------------------------------------------
// Lifecycle

TEST_F(KvdDaemonTest, SigtermTellsWatchersItRestartsKeepsPoolsAndRemovesBothSockets) {
  ASSERT_THAT(Create("kv", 64), GrpcOk());
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Attachment> a, Attach("kv", "engine"));
  absl::StatusOr<int> status = daemon_->Stop(SIGTERM);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_TRUE(WIFEXITED(*status)) << *status;
  EXPECT_EQ(WEXITSTATUS(*status), 0) << daemon_->log();
  EXPECT_FALSE(Exists(daemon_->socket()));
  EXPECT_FALSE(Exists(daemon_->handles()));
  std::optional<HandledEvent> restarting = a->NextEvent();
  ASSERT_TRUE(restarting.has_value());
  EXPECT_EQ(restarting->event.type(), v1::EVENT_TYPE_DAEMON_RESTARTING);
  EXPECT_THAT(daemon_->log(), HasSubstr("kvd stopped (pools kept for the next start)"));
  EXPECT_TRUE(Exists(dir_.path() + "/gpu0.state/pools/kv"));
}

class DrainOnStopTest : public KvdDaemonTest {
  DaemonConfig Config() override { return {.extra_args = {"--drain-on-stop"}}; }
};

TEST_F(DrainOnStopTest, SigtermTellsWatchersToUnmapAndReleasesEverything) {
  ASSERT_THAT(Create("kv", 64), GrpcOk());
  KVD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Attachment> a, Attach("kv", "engine"));
  absl::StatusOr<int> status = daemon_->Stop(SIGTERM);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(WEXITSTATUS(*status), 0) << daemon_->log();
  std::optional<HandledEvent> stopping = a->NextEvent();
  ASSERT_TRUE(stopping.has_value());
  EXPECT_EQ(stopping->event.type(), v1::EVENT_TYPE_DAEMON_STOPPING);
  EXPECT_EQ(a->mapped_chunks(), 0u);
  EXPECT_THAT(daemon_->log(), HasSubstr("kvd stopped (all memory released)"));
  EXPECT_FALSE(Exists(dir_.path() + "/gpu0.state/pools/kv"));
}

TEST_F(KvdDaemonTest, SecondDaemonOnTheSameSocketIsRefused) {
  Daemon second(dir_.path(), {.log_name = "second.log"});
  ASSERT_TRUE(second.Spawn().ok());
  absl::StatusOr<int> status = second.process()->Wait(kWait);
  ASSERT_TRUE(status.ok());
  EXPECT_TRUE(WIFEXITED(*status));
  EXPECT_NE(WEXITSTATUS(*status), 0);
  EXPECT_THAT(second.log(), HasSubstr("another kvd is serving " + daemon_->socket()));
  // The first one is untouched.
  EXPECT_TRUE(Exists(daemon_->socket()));
  EXPECT_EQ(DeviceInfo().backend(), v1::BACKEND_HOST);
}

// Binds a Unix socket at `path` and closes it without unlinking: what a crashed daemon leaves.
void MakeStaleSocket(const std::string& path, int type) {
  const int fd = socket(AF_UNIX, type, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  ASSERT_EQ(bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0) << std::strerror(errno);
  close(fd);
}

TEST(KvdDaemonStartTest, StaleSocketFilesAreReplaced) {
  TempDir dir;
  Daemon daemon(dir.path());
  MakeStaleSocket(daemon.socket(), SOCK_STREAM);
  MakeStaleSocket(daemon.handles(), SOCK_SEQPACKET);
  absl::Status started = daemon.Start();
  ASSERT_TRUE(started.ok()) << started;
  EXPECT_THAT(daemon.log(), HasSubstr("removed stale socket"));
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession session, HandleSession::Open(daemon.handles(), "probe"));
  EXPECT_FALSE(session.token().empty());
  session.Close();
  absl::StatusOr<int> status = daemon.Stop();
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(*status, 0);
}

TEST(KvdDaemonStartTest, PathThatIsNotASocketIsLeftAloneAndRefused) {
  TempDir dir;
  Daemon daemon(dir.path());
  std::ofstream(daemon.socket()) << "precious";
  ASSERT_TRUE(daemon.Spawn().ok());
  absl::StatusOr<int> status = daemon.process()->Wait(kWait);
  ASSERT_TRUE(status.ok());
  EXPECT_NE(*status, 0);
  EXPECT_THAT(daemon.log(), HasSubstr("is not a socket"));
  EXPECT_EQ(ReadFile(daemon.socket()), "precious");
}

TEST(KvdDaemonStartTest, InvalidLayoutEnvironmentRefusesToStart) {
  TempDir dir;
  Daemon daemon(dir.path(), {.extra_env = {"KVD_KV_CACHE_LAYOUT=XYZ"}});
  ASSERT_TRUE(daemon.Spawn().ok());
  absl::StatusOr<int> status = daemon.process()->Wait(kWait);
  ASSERT_TRUE(status.ok());
  EXPECT_TRUE(WIFEXITED(*status));
  EXPECT_EQ(WEXITSTATUS(*status), 1);
  EXPECT_THAT(daemon.log(), HasSubstr("KVD_KV_CACHE_LAYOUT"));
  EXPECT_FALSE(Exists(daemon.socket()));
}

TEST(KvdDaemonStartTest, VersionPrintsItAndStartsNothing) {
  FILE* out = popen(KVD_BINARY " --version", "r");
  ASSERT_NE(out, nullptr);
  std::string said;
  char buf[256];
  for (size_t n; (n = fread(buf, 1, sizeof(buf), out)) > 0;) said.append(buf, n);
  EXPECT_EQ(pclose(out), 0);
  EXPECT_THAT(said, ::testing::MatchesRegex("kvd [0-9]+\\.[0-9]+\\.[0-9]+\n"));
}

TEST(KvdDaemonStartTest, DaemonLayoutEnvironmentReachesTheChain) {
  TempDir dir;
  Daemon daemon(dir.path(), {.extra_env = {"KVD_KV_CACHE_LAYOUT=BLNHC"}});
  absl::Status started = daemon.Start();
  ASSERT_TRUE(started.ok()) << started;
  v1::ResolveLayoutResponse response;
  ASSERT_THAT(daemon.stub().ResolveLayout(Ctx().get(), {}, &response), GrpcOk());
  EXPECT_EQ(response.resolution().layout(), "BLNHC");
  EXPECT_EQ(response.resolution().rule(), v1::LAYOUT_RULE_DAEMON_ENV);
  ASSERT_TRUE(daemon.Stop().ok());
}

// ---------------------------------------------------------------------------------------------
// Device selection: the host backend stands in for a node's GPUs (device.h): index N is the device
// "host-<boot id>-N".

std::string BootId() {
  std::string boot_id = ReadFile("/proc/sys/kernel/random/boot_id");
  while (!boot_id.empty() && (boot_id.back() == '\n' || boot_id.back() == ' ')) boot_id.pop_back();
  return boot_id;
}

// Runs kvd with `args` to completion (stdout and stderr into `log_path`); its wait status.
absl::StatusOr<int> RunKvd(const std::vector<std::string>& args, const std::string& log_path) {
  std::vector<std::string> argv = {KvdBinary()};
  argv.insert(argv.end(), args.begin(), args.end());
  KVD_ASSIGN_OR_RETURN(std::unique_ptr<Child> child, Child::Spawn(argv, {}, log_path, /*pipes=*/false));
  return child->Wait(kWait);
}

TEST(KvdDaemonDeviceTest, DeviceUuidSelectsThatIndex) {
  ASSERT_FALSE(BootId().empty());
  const std::string uuid = absl::StrCat("host-", BootId(), "-1");
  // The UUID, and a case-changed spelling without "host-": both name device 1.
  for (const std::string& selector : {uuid, absl::AsciiStrToUpper(absl::StrCat(BootId(), "-1"))}) {
    SCOPED_TRACE(selector);
    TempDir dir;
    Daemon daemon(dir.path(), {.extra_args = {"--device=" + selector}});
    absl::Status started = daemon.Start();
    ASSERT_TRUE(started.ok()) << started;
    v1::DeviceInfo info;
    ASSERT_THAT(daemon.stub().GetDeviceInfo(Ctx().get(), {}, &info), GrpcOk());
    EXPECT_EQ(info.device_index(), 1u);
    EXPECT_EQ(info.device_uuid(), uuid);
    EXPECT_THAT(daemon.log(), HasSubstr(absl::StrCat("--device=", selector, " selects device #1 (by UUID)")));
    EXPECT_THAT(daemon.log(), HasSubstr(uuid));
    ASSERT_TRUE(daemon.Stop().ok());
  }
}

TEST(KvdDaemonDeviceTest, DeviceIndexNamesTheDevicesUuid) {
  TempDir dir;
  Daemon daemon(dir.path(), {.extra_args = {"--device=3"}});
  absl::Status started = daemon.Start();
  ASSERT_TRUE(started.ok()) << started;
  v1::DeviceInfo info;
  ASSERT_THAT(daemon.stub().GetDeviceInfo(Ctx().get(), {}, &info), GrpcOk());
  EXPECT_EQ(info.device_index(), 3u);
  EXPECT_EQ(info.device_uuid(), absl::StrCat("host-", BootId(), "-3"));
  EXPECT_THAT(daemon.log(), HasSubstr("--device=3 selects device #3 (by index)"));
  ASSERT_TRUE(daemon.Stop().ok());
}

// The default socket (no --socket) is named after the resolved index, not the selector's text. kvd
// stops at a bad --lease-ttl, after naming its sockets and before creating anything under /run/kvd.
TEST(KvdDaemonDeviceTest, DefaultSocketIsNamedAfterTheResolvedIndex) {
  TempDir dir;
  const std::string log = dir.path() + "/kvd.log";
  const bool existed = Exists("/run/kvd/gpu7.sock");
  KVD_ASSERT_OK_AND_ASSIGN(
      int status, RunKvd({"--backend=host", absl::StrCat("--device=host-", BootId(), "-7"), "--lease-ttl=never"}, log));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << ReadFile(log);
  EXPECT_THAT(ReadFile(log), HasSubstr("selects device #7 (by UUID); sockets /run/kvd/gpu7.sock and "
                                       "/run/kvd/gpu7.handles"));
  EXPECT_THAT(ReadFile(log), HasSubstr("--lease-ttl"));
  EXPECT_EQ(Exists("/run/kvd/gpu7.sock"), existed) << "nothing was created";
}

TEST(KvdDaemonDeviceTest, ListDevicesPrintsTheDevicesAndExits) {
  TempDir dir;
  const std::string table = dir.path() + "/table.txt";
  KVD_ASSERT_OK_AND_ASSIGN(int status, RunKvd({"--backend=host", "--host-capacity=1GiB", "--list-devices"}, table));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << ReadFile(table);
  const std::vector<std::string> lines = absl::StrSplit(ReadFile(table), '\n', absl::SkipEmpty());
  ASSERT_GE(lines.size(), 2u) << ReadFile(table);
  EXPECT_THAT(lines[0], ::testing::MatchesRegex("INDEX +BACKEND +UUID +MEMORY +NAME"));
  EXPECT_THAT(lines[1], ::testing::MatchesRegex(
                            absl::StrCat("0 +host +host-", BootId(), "-0 +1\\.00 GiB +host memory \\(memfd\\)")));
  EXPECT_THAT(ReadFile(table), HasSubstr("any --device index"));

  const std::string json = dir.path() + "/devices.json";
  KVD_ASSERT_OK_AND_ASSIGN(status,
                           RunKvd({"--backend=host", "--host-capacity=1GiB", "--list-devices", "--json"}, json));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << ReadFile(json);
  EXPECT_EQ(ReadFile(json), absl::StrCat(R"({"backend":"host","devices":[{"index":0,"uuid":"host-)", BootId(),
                                         R"j(-0","name":"host memory (memfd)","total_bytes":1073741824}]})j", "\n"));
}

TEST(KvdDaemonDeviceTest, UnknownOrAmbiguousDeviceRefusesToStartNamingTheFlag) {
  const std::string family = absl::StrCat("host-", BootId(), "-");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"GPU-5f3a", "--device GPU-5f3a: no host device has this UUID"},
      {"host-00000000-0000-0000-0000-000000000000-1", "no host device has this UUID; host devices are " + family},
      {"-1", "--device -1: no host device"},
      {family, absl::StrCat("--device ", family, ": ambiguous")},
      {"host-" + BootId().substr(0, 4), "ambiguous, every host device's UUID"},
  };
  for (const auto& [selector, message] : cases) {
    SCOPED_TRACE(selector);
    TempDir dir;
    Daemon daemon(dir.path(), {.extra_args = {"--device=" + selector}});
    ASSERT_TRUE(daemon.Spawn().ok());
    absl::StatusOr<int> status = daemon.process()->Wait(kWait);
    ASSERT_TRUE(status.ok());
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 1) << daemon.log();
    EXPECT_THAT(daemon.log(), HasSubstr(message));
    std::vector<std::string> errors;
    for (absl::string_view line : absl::StrSplit(daemon.log(), '\n')) {
      if (absl::StrContains(line, " error ")) errors.emplace_back(line);
    }
    EXPECT_EQ(errors.size(), 1u) << "one line: " << daemon.log();
    EXPECT_FALSE(Exists(daemon.socket()));
  }
}

}  // namespace
}  // namespace kvd::daemon

// The test binary doubles as the peer client process (see PeerMain).
int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--kvd-peer") return kvd::daemon::PeerMain(argc, argv);
  if (argc > 1 && std::string(argv[1]) == "--kvd-as-uid") return kvd::daemon::AsUidMain(argc, argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
