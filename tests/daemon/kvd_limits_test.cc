// Tenant safety on the real kvd (issue 13; docs/operations.md, "Limits"): each attack of one user of the
// sockets against the others fails cleanly for the attacker, with RESOURCE_EXHAUSTED naming the limit and
// its flag, and costs the other tenants and the operator nothing. The limits are scaled down by flags so
// that each attack takes a handful of requests.
//
// Ordinary tenants are other uids: this test (run as root) starts them with setpriv as uids 1000, 1001,
// ...: kvctl, and this binary itself as a peer (`kvd_limits_test --peer SOCKET op...`) that opens
// sessions and attaches, prints one line per step and holds everything until its stdin closes. Root,
// an operator uid, talks to the daemon from the test process. Without root the tests skip, visibly.
//
// Every wait is bounded and waits for a condition; no test asserts on wall-clock time.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/handle_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvd/v1/kvd.grpc.pb.h"
#include "kvd/v1/kvd.pb.h"
#include "tests/testing/kvd_process.h"

extern char** environ;

#ifndef KVD_BINARY
#define KVD_BINARY "kvd"
#endif
#ifndef KVCTL_BINARY
#define KVCTL_BINARY "kvctl"
#endif

namespace kvd::daemon {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr absl::Duration kWait = absl::Seconds(30);

std::string SelfExe() {
  std::error_code ec;
  return std::filesystem::read_symlink("/proc/self/exe", ec).string();
}

std::string HandlesOf(const std::string& socket) { return socket.substr(0, socket.size() - 5) + ".handles"; }

std::unique_ptr<grpc::ClientContext> Ctx(const std::string& session) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  if (!session.empty()) ctx->AddMetadata("kvd-session", session);
  ctx->set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(kWait));
  return ctx;
}

// "CODE: message" of a failed status, "OK" otherwise: what the peer prints.
std::string Line(const absl::Status& s) {
  return s.ok() ? "OK" : absl::StrCat(absl::StatusCodeToString(s.code()), ": ", s.message());
}
std::string Line(const grpc::Status& s) {
  return Line(absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message()));
}

// The LimitExceeded of a refusal's status details (a kvd.v1.RpcStatus whose code and message are the
// status's own); nullopt when there is none.
std::optional<v1::LimitExceeded> RefusalOf(const grpc::Status& s) {
  v1::RpcStatus rich;
  if (s.error_details().empty() || !rich.ParseFromString(s.error_details())) return std::nullopt;
  EXPECT_EQ(rich.code(), static_cast<int>(s.error_code()));
  EXPECT_EQ(rich.message(), s.error_message());
  v1::LimitExceeded refusal;
  if (rich.details_size() != 1 || !rich.details(0).UnpackTo(&refusal)) return std::nullopt;
  return refusal;
}

// "limit uid allowed used asked", to compare in one line.
std::string Numbers(const std::optional<v1::LimitExceeded>& r) {
  return r.has_value() ? absl::StrCat(r->limit(), " uid ", r->uid(), ": ", r->allowed(), " allowed, ", r->used(),
                                      " used, ", r->asked(), " asked")
                       : "no LimitExceeded";
}

// OpenSession on a raw handle-channel connection: the HandleChannelError of a refusal (empty if it opened).
v1::HandleChannelError RawOpenSession(const std::string& handles, std::vector<int>* kept) {
  v1::HandleChannelError error;
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, handles.data(), std::min(handles.size(), sizeof(addr.sun_path) - 1));
  if (fd < 0 || connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    error.set_message(absl::StrCat("connect: ", std::strerror(errno)));
    return error;
  }
  kept->push_back(fd);
  v1::HandleChannelRequest request;
  request.mutable_open_session()->set_client_name("raw");
  const std::string bytes = request.SerializeAsString();
  char reply[4096];
  const ssize_t n = send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) < 0 ? -1 : recv(fd, reply, sizeof(reply), 0);
  v1::HandleChannelReply parsed;
  if (n <= 0 || !parsed.ParseFromArray(reply, static_cast<int>(n))) error.set_message("no reply");
  return parsed.has_error() ? parsed.error() : error;
}

// ---------------------------------------------------------------------------------------------
// The peer: another uid's client process

// One more raw connection to the control socket, kept in `*kept`: "OK" once gRPC's server preface (its
// SETTINGS frame, sent as soon as gRPC has the connection) arrives, "CLOSED" when kvd closes it instead.
std::string ConnectRaw(const std::string& path, std::vector<int>* kept) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), std::min(path.size(), sizeof(addr.sun_path) - 1));
  if (fd < 0 || connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    return absl::StrCat("ERROR ", std::strerror(errno));
  }
  kept->push_back(fd);
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(kWait))) <= 0) return "NOTHING";
  char buf[256];
  const ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
  if (n > 0) return "OK";
  return n == 0 || errno == ECONNRESET ? "CLOSED" : absl::StrCat("ERROR ", std::strerror(errno));
}

// kvd_limits_test --peer SOCKET op...: `session` opens one more session (kept); `attach:POOL` attaches
// POOL through the first session; `connect` opens one more raw connection to the control socket (kept,
// ConnectRaw); `rpc` calls GetDeviceInfo on a new gRPC channel of its own (one more connection, kept).
// One line per op, then "ready"; exits when stdin closes.
int PeerMain(int argc, char** argv) {
  const std::string socket = argv[2];
  std::vector<HandleSession> sessions;
  std::vector<int> raw;
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  auto stub = kvd::v1::Kvd::NewStub(grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()));
  for (int i = 3; i < argc; ++i) {
    const std::string op = argv[i];
    if (op == "session") {
      absl::StatusOr<HandleSession> s = HandleSession::Open(HandlesOf(socket), "peer");
      std::printf("session %s\n", Line(s.status()).c_str());
      if (s.ok()) sessions.push_back(*std::move(s));
    } else if (absl::StartsWith(op, "attach:")) {
      v1::AttachRequest req;
      req.set_pool(op.substr(7));
      v1::AttachResponse resp;
      const grpc::Status s = stub->Attach(Ctx(sessions.empty() ? "" : sessions.front().token()).get(), req, &resp);
      std::printf("attach %s\n",
                  s.ok() ? absl::StrCat("OK ", resp.pool().client_count(), " ", resp.pool().clients_size()).c_str()
                         : Line(s).c_str());
    } else if (op == "connect") {
      std::printf("connect %s\n", ConnectRaw(socket, &raw).c_str());
    } else if (op == "rpc") {
      grpc::ChannelArguments args;
      args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection of its own
      channels.push_back(grpc::CreateCustomChannel("unix:" + socket, grpc::InsecureChannelCredentials(), args));
      v1::DeviceInfo info;
      const grpc::Status s =
          v1::Kvd::NewStub(channels.back())->GetDeviceInfo(Ctx("").get(), v1::GetDeviceInfoRequest(), &info);
      std::printf("rpc %s\n",
                  s.ok() ? "OK" : absl::StatusCodeToString(static_cast<absl::StatusCode>(s.error_code())).c_str());
    }
    std::fflush(stdout);
  }
  std::printf("ready\n");
  std::fflush(stdout);
  char byte;
  while (read(0, &byte, 1) > 0) {
  }
  return 0;
}

// A command run as `uid` (setpriv), its output collected, or a peer process held until destroyed.
class AsUid {
 public:
  AsUid() = default;
  AsUid(const AsUid&) = delete;
  AsUid& operator=(const AsUid&) = delete;
  ~AsUid() {
    if (in_ >= 0) close(in_);
    if (out_ >= 0) close(out_);
    if (pid_ > 0) {
      int status = 0;
      waitpid(pid_, &status, 0);
    }
  }

  // Starts `argv` as uid (and gid) `uid`; its stdout and stderr go to a pipe.
  absl::Status Start(uint32_t uid, std::vector<std::string> argv) {
    std::vector<std::string> full = {"/usr/bin/setpriv", absl::StrCat("--reuid=", uid), absl::StrCat("--regid=", uid),
                                     "--clear-groups"};
    full.insert(full.end(), argv.begin(), argv.end());
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) return absl::InternalError("pipe");
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, in[0], 0);
    posix_spawn_file_actions_adddup2(&actions, out[1], 1);
    posix_spawn_file_actions_adddup2(&actions, out[1], 2);
    std::vector<char*> cargv;
    for (std::string& a : full) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    const int rc = posix_spawn(&pid_, cargv[0], &actions, nullptr, cargv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    close(in[0]);
    close(out[1]);
    in_ = in[1];
    out_ = out[0];
    if (rc != 0) {
      pid_ = -1;
      return absl::InternalError(absl::StrCat("posix_spawn setpriv: ", rc));
    }
    return absl::OkStatus();
  }

  // Lines of output until "ready" (a peer) or EOF (a command).
  std::vector<std::string> ReadLines() {
    std::string text;
    char buf[4096];
    while (!absl::StrContains(text, "ready\n")) {
      const ssize_t n = read(out_, buf, sizeof(buf));
      if (n <= 0) break;
      text.append(buf, static_cast<size_t>(n));
    }
    std::vector<std::string> lines = absl::StrSplit(text, '\n', absl::SkipEmpty());
    return lines;
  }

  // Waits for a command to end: its exit status.
  int Wait() {
    close(in_);
    in_ = -1;
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

 private:
  pid_t pid_ = -1;
  int in_ = -1;
  int out_ = -1;
};

// kvctl as `uid`: its exit status and output.
struct Ran {
  int code = -1;
  std::string output;
};

class LimitsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "needs root: the tenants are other uids (setpriv)";
  }

  // Starts kvd with `flags` and opens its sockets to every uid (the tenants are other users).
  void StartKvd(std::vector<std::string> flags) {
    const char* binary = std::getenv("KVD_BINARY");  // another kvd to test, else the build's
    ASSERT_TRUE(kvd_.Start(binary != nullptr && *binary != '\0' ? binary : KVD_BINARY, 0, std::move(flags)).ok())
        << kvd_.log();
    chmod(kvd_.dir().c_str(), 0755);
    chmod(kvd_.socket().c_str(), 0666);
    chmod(HandlesOf(kvd_.socket()).c_str(), 0666);
    stub_ = v1::Kvd::NewStub(grpc::CreateChannel("unix:" + kvd_.socket(), grpc::InsecureChannelCredentials()));
    absl::StatusOr<HandleSession> root = HandleSession::Open(HandlesOf(kvd_.socket()), "operator");
    ASSERT_TRUE(root.ok()) << root.status();
    root_.emplace(*std::move(root));
  }

  Ran Kvctl(uint32_t uid, std::vector<std::string> args) {
    std::vector<std::string> argv = {KVCTL_BINARY, "--socket=" + kvd_.socket()};
    argv.insert(argv.end(), args.begin(), args.end());
    AsUid run;
    Ran ran;
    if (!run.Start(uid, argv).ok()) return ran;
    ran.output = absl::StrJoin(run.ReadLines(), "\n");
    ran.code = run.Wait();
    return ran;
  }

  // kvctl create NAME as `uid`: a pool of `layers` segments of one 2 MiB granule each (2 MiB reserved
  // per layer), no blocks committed.
  Ran Create(uint32_t uid, const std::string& name, int layers = 1, std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"create",
                                     name,
                                     absl::StrCat("--layers=", layers),
                                     "--capacity-blocks=16",
                                     "--heads=1",
                                     "--block-tokens=16",
                                     "--channels=64",
                                     "--element-bytes=2"};
    args.insert(args.end(), extra.begin(), extra.end());
    return Kvctl(uid, args);
  }

  // A peer process of `uid` running `ops`, held until the returned object goes; its lines in `*lines`.
  std::unique_ptr<AsUid> Peer(uint32_t uid, std::vector<std::string> ops, std::vector<std::string>* lines) {
    std::vector<std::string> argv = {SelfExe(), "--peer", kvd_.socket()};
    argv.insert(argv.end(), ops.begin(), ops.end());
    auto peer = std::make_unique<AsUid>();
    if (!peer->Start(uid, argv).ok()) return nullptr;
    *lines = peer->ReadLines();
    return peer;
  }

  grpc::Status RootCreate(const std::string& name, int layers = 1, uint64_t capacity = 16,
                          std::vector<uint32_t> allowed = {}) {
    v1::CreatePoolRequest req;
    req.set_name(name);
    v1::PoolDims* d = req.mutable_dims();
    d->set_layers(layers);
    d->set_capacity_blocks(capacity);
    d->set_heads(1);
    d->set_block_tokens(16);
    d->set_channels(64);
    d->set_element_bytes(2);
    for (uint32_t uid : allowed) req.add_allowed_uids(uid);
    v1::Pool pool;
    return stub_->CreatePool(Ctx(root_->token()).get(), req, &pool);
  }

  const std::string& root() const { return root_->token(); }

  testing::KvdProcess kvd_;
  std::unique_ptr<v1::Kvd::Stub> stub_;
  std::optional<HandleSession> root_;
};

// Item 1: pools without bound exhausted the daemon's memory mappings. Now pools are limited per uid and
// in total (with the operator's share), and attach + fetch bursts still work once the limits are hit.
TEST_F(LimitsTest, PoolsAreLimitedPerUidAndInTotalAndRootStillGetsIn) {
  StartKvd({"--max-pools=8", "--max-pools-per-uid=2"});
  EXPECT_EQ(Create(1000, "a1").code, 0);
  EXPECT_EQ(Create(1000, "a2").code, 0);
  Ran third = Create(1000, "a3");
  EXPECT_NE(third.code, 0);
  EXPECT_THAT(third.output, HasSubstr("RESOURCE_EXHAUSTED: pools of uid 1000: 2 of 2 (--max-pools-per-uid)"));

  // A deleted pool frees its slot.
  EXPECT_EQ(Kvctl(1000, {"delete", "a2"}).code, 0);
  EXPECT_EQ(Create(1000, "a2").code, 0);

  // All uids together: 8 less the operator's 5% (1) = 7 for ordinary uids.
  EXPECT_EQ(Create(1001, "b1").code, 0);
  EXPECT_EQ(Create(1001, "b2").code, 0);
  EXPECT_EQ(Create(1002, "c1").code, 0);
  EXPECT_EQ(Create(1002, "c2").code, 0);
  EXPECT_EQ(Create(1003, "d1").code, 0);  // 7 pools now
  Ran total = Create(1003, "d2");
  EXPECT_NE(total.code, 0);
  EXPECT_THAT(total.output,
              HasSubstr("RESOURCE_EXHAUSTED: pools of all uids: 7 of 7 for uid 1003 (--max-pools=8, less 1 kept for "
                        "root and uid 0 by --operator-reserve=5%)"));

  // Root takes the operator's share, and is bound only by the total.
  ASSERT_TRUE(RootCreate("root1").ok());
  const grpc::Status refused = RootCreate("root2");
  EXPECT_THAT(Line(refused), HasSubstr("RESOURCE_EXHAUSTED: pools of all uids: 8 of 8 for uid 0 (--max-pools)"));
  // The same in numbers, in the status details (docs/api.md, "Errors").
  EXPECT_EQ(Numbers(RefusalOf(refused)), "max-pools uid 0: 8 allowed, 8 used, 1 asked");

  // A burst of attaches and fetches from several threads after the refusals: all served.
  std::vector<std::thread> burst;
  std::atomic<int> served{0};
  for (int i = 0; i < 16; ++i) {
    burst.emplace_back([&] {
      v1::AttachRequest req;
      req.set_pool("root1");
      v1::AttachResponse resp;
      if (!stub_->Attach(Ctx(root()).get(), req, &resp).ok()) return;
      absl::StatusOr<std::vector<std::pair<uint64_t, int>>> fds = root_->Fetch(resp.lease().token());
      if (fds.ok()) ++served;
    });
  }
  for (std::thread& t : burst) t.join();
  EXPECT_EQ(served.load(), 16);
  EXPECT_EQ(Kvctl(0, {"status"}).code, 0);
}

// Item 5: 48 pools reserved all the address space. Now reserved address space is limited per uid and
// in total, checked before anything is reserved.
TEST_F(LimitsTest, ReservedAddressSpaceIsLimitedPerUidAndInTotal) {
  StartKvd({"--max-reserved=40MiB", "--max-reserved-per-uid=16MiB"});
  EXPECT_EQ(Create(1000, "a1", 6).code, 0);  // 12 MiB
  Ran second = Create(1000, "a2", 6);
  EXPECT_NE(second.code, 0);
  EXPECT_THAT(second.output,
              HasSubstr("RESOURCE_EXHAUSTED: reserved address space (pool a2) of uid 1000: 12582912 bytes (12.0 MiB) "
                        "asked but only 4194304 bytes (4.00 MiB) of 16.0 MiB are free (--max-reserved-per-uid)"));
  EXPECT_EQ(Create(1000, "a2", 2).code, 0);  // 16 MiB: exactly the per-uid limit
  // All uids: 40 MiB less the operator's 5% (2 MiB) = 38 MiB.
  EXPECT_EQ(Create(1001, "b1", 6).code, 0);  // 28 MiB
  Ran total = Create(1002, "c1", 6);
  EXPECT_NE(total.code, 0);
  EXPECT_THAT(total.output, HasSubstr("reserved address space (pool c1) of all uids (for uid 1002): 12582912 bytes "
                                      "(12.0 MiB) asked but only 10485760 bytes (10.0 MiB) of 38.0 MiB are free "
                                      "(--max-reserved=40.0 MiB, less 2.00 MiB kept for root and uid 0 by "
                                      "--operator-reserve=5%)"));
  // The operator's share is root's.
  EXPECT_TRUE(RootCreate("root1", 6).ok());  // 40 MiB
  const grpc::Status refused = RootCreate("root2", 1);
  EXPECT_THAT(Line(refused), HasSubstr("(--max-reserved)"));
  EXPECT_EQ(Numbers(RefusalOf(refused)),
            absl::StrCat("max-reserved uid 0: ", 40 << 20, " allowed, ", 40 << 20, " used, ", 2 << 20, " asked"));
}

// Sessions: one uid cannot hold every session; root's `kvctl status` still works.
TEST_F(LimitsTest, SessionsAreLimitedPerUidAndInTotal) {
  StartKvd({"--max-sessions=8", "--max-sessions-per-uid=3"});
  std::vector<std::string> lines;
  std::unique_ptr<AsUid> a = Peer(1000, {"session", "session", "session", "session"}, &lines);
  ASSERT_NE(a, nullptr);
  ASSERT_EQ(lines.size(), 5u) << absl::StrJoin(lines, "\n");
  EXPECT_EQ(lines[2], "session OK");
  EXPECT_EQ(lines[3], "session RESOURCE_EXHAUSTED: sessions of uid 1000: 3 of 3 (--max-sessions-per-uid)");
  // 8 less the operator's 1 = 7 for ordinary uids, root's included (the fixture's session): 4 open.
  std::unique_ptr<AsUid> b = Peer(1001, {"session", "session"}, &lines);
  ASSERT_EQ(lines.size(), 3u) << absl::StrJoin(lines, "\n");
  EXPECT_EQ(lines[1], "session OK");
  std::unique_ptr<AsUid> c = Peer(1002, {"session", "session"}, &lines);
  ASSERT_EQ(lines.size(), 3u) << absl::StrJoin(lines, "\n");
  EXPECT_EQ(lines[0], "session OK");
  EXPECT_EQ(lines[1],
            "session RESOURCE_EXHAUSTED: sessions of all uids: 7 of 7 for uid 1002 (--max-sessions=8, less 1 kept "
            "for root and uid 0 by --operator-reserve=5%)");
  // The operator and the liveness probe get in.
  Ran status = Kvctl(0, {"status"});
  EXPECT_EQ(status.code, 0) << status.output;
  // Root takes the operator's share, the 8th session; the 9th is refused, in words and in numbers.
  std::vector<int> raw;
  EXPECT_EQ(RawOpenSession(HandlesOf(kvd_.socket()), &raw).message(), "");
  const v1::HandleChannelError refused = RawOpenSession(HandlesOf(kvd_.socket()), &raw);
  EXPECT_EQ(refused.code(), static_cast<int>(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(refused.message(), "sessions of all uids: 8 of 8 for uid 0 (--max-sessions)");
  v1::LimitExceeded numbers;
  ASSERT_EQ(refused.details_size(), 1);
  ASSERT_TRUE(refused.details(0).UnpackTo(&numbers));
  EXPECT_EQ(Numbers(numbers), "max-sessions uid 0: 8 allowed, 8 used, 1 asked");
  for (int fd : raw) close(fd);
  // A tenant's sessions end with its process: its slots are free again.
  a.reset();
  std::unique_ptr<AsUid> d;
  for (const absl::Time deadline = absl::Now() + kWait; absl::Now() < deadline;
       absl::SleepFor(absl::Milliseconds(20))) {
    d = Peer(1003, {"session"}, &lines);
    if (!lines.empty() && lines.front() == "session OK") break;
  }
  ASSERT_FALSE(lines.empty());
  EXPECT_EQ(lines.front(), "session OK");
}

// Item 3: one uid took all 1024 handle-channel slots, and root's `kvctl status` (the liveness probe)
// was refused. Now connections are limited per uid, and the operator keeps a share of the total.
TEST_F(LimitsTest, HandleChannelConnectionsAreLimitedPerUidAndTheProbeStillGetsIn) {
  StartKvd({"--max-handle-connections=8", "--max-handle-connections-per-uid=3"});
  std::vector<std::string> lines;
  std::unique_ptr<AsUid> a = Peer(1000, {"session", "session", "session", "session"}, &lines);
  ASSERT_EQ(lines.size(), 5u) << absl::StrJoin(lines, "\n");
  EXPECT_EQ(lines[2], "session OK");
  EXPECT_EQ(lines[3],
            "session RESOURCE_EXHAUSTED: handle-channel connections of uid 1000: 3 of 3 "
            "(--max-handle-connections-per-uid)");
  // 8 less the operator's 1 = 7 for ordinary uids, root's included (the fixture's session): 4 open.
  std::unique_ptr<AsUid> b = Peer(1001, {"session", "session", "session"}, &lines);
  ASSERT_EQ(lines.size(), 4u) << absl::StrJoin(lines, "\n");
  EXPECT_EQ(lines[2], "session OK");
  std::unique_ptr<AsUid> c = Peer(1002, {"session"}, &lines);
  ASSERT_EQ(lines.size(), 2u) << absl::StrJoin(lines, "\n");
  EXPECT_EQ(lines[0],
            "session RESOURCE_EXHAUSTED: handle-channel connections of all uids: 7 of 7 for uid 1002 "
            "(--max-handle-connections=8, less 1 kept for root and uid 0 by --operator-reserve)");
  Ran status = Kvctl(0, {"status"});
  EXPECT_EQ(status.code, 0) << status.output;
}

// The control socket, like the handle channel: connections are limited per uid and in total, the
// operator keeps a share of the total, a refused connection is closed before gRPC reads it (a client's
// RPC fails UNAVAILABLE) and logged, and a connection its client closes stops counting.
TEST_F(LimitsTest, ControlConnectionsAreLimitedPerUidAndInTotalAndTheProbeStillGetsIn) {
  StartKvd({"--max-control-connections=8", "--max-control-connections-per-uid=3"});
  std::vector<std::string> lines;
  std::unique_ptr<AsUid> a = Peer(1000, {"connect", "connect", "connect", "connect", "rpc"}, &lines);
  ASSERT_EQ(lines.size(), 6u) << absl::StrJoin(lines, "\n");
  EXPECT_EQ(lines[2], "connect OK");
  EXPECT_EQ(lines[3], "connect CLOSED");
  EXPECT_EQ(lines[4], "rpc UNAVAILABLE");
  EXPECT_THAT(kvd_.log(), HasSubstr("control socket: refused a connection: control-socket connections of uid 1000: "
                                    "3 of 3 (--max-control-connections-per-uid)"));
  // 8 less the operator's 1 = 7 for ordinary uids.
  std::unique_ptr<AsUid> b = Peer(1001, {"connect", "connect", "connect"}, &lines);
  ASSERT_EQ(lines.size(), 4u) << absl::StrJoin(lines, "\n");
  EXPECT_EQ(lines[2], "connect OK");
  std::unique_ptr<AsUid> c = Peer(1002, {"connect", "connect"}, &lines);
  ASSERT_EQ(lines.size(), 3u) << absl::StrJoin(lines, "\n");
  EXPECT_EQ(lines[0], "connect OK");
  EXPECT_EQ(lines[1], "connect CLOSED");
  // Root (the liveness probe) takes the operator's share.
  Ran status = Kvctl(0, {"status"});
  EXPECT_EQ(status.code, 0) << status.output;

  // uid 1000's process ends: its connections close, and once gRPC has closed them they stop counting.
  a.reset();
  std::string again;
  for (const absl::Time until = absl::Now() + kWait; absl::Now() < until && again != "connect OK";
       absl::SleepFor(absl::Milliseconds(50))) {
    std::unique_ptr<AsUid> retry = Peer(1000, {"connect"}, &lines);
    again = lines.empty() ? "" : lines[0];
  }
  EXPECT_EQ(again, "connect OK");
}

// Item 8 (the daemon side): clients per pool are limited; Attach's reply counts the clients instead of
// listing them, GetPool lists them.
TEST_F(LimitsTest, ClientsPerPoolAreLimitedAndAttachRepliesDoNotListThem) {
  StartKvd({"--max-clients-per-pool=3"});
  ASSERT_TRUE(RootCreate("shared", 1, 16, {1000}).ok());
  std::vector<std::string> lines;
  // 3 less the operator's 1 = 2 for ordinary uids.
  std::unique_ptr<AsUid> a = Peer(1000, {"session", "attach:shared", "attach:shared", "attach:shared"}, &lines);
  ASSERT_EQ(lines.size(), 5u) << absl::StrJoin(lines, "\n");
  EXPECT_EQ(lines[1], "attach OK 1 0");
  EXPECT_EQ(lines[2], "attach OK 2 0");
  EXPECT_EQ(lines[3],
            "attach RESOURCE_EXHAUSTED: clients of pool shared of all uids: 2 of 2 for uid 1000 "
            "(--max-clients-per-pool=3, less 1 kept for root and uid 0 by --operator-reserve=5%)");
  v1::AttachRequest attach;
  attach.set_pool("shared");
  v1::AttachResponse attached;
  ASSERT_TRUE(stub_->Attach(Ctx(root()).get(), attach, &attached).ok());
  EXPECT_EQ(attached.pool().client_count(), 3u);
  EXPECT_EQ(attached.pool().clients_size(), 0);
  const grpc::Status refused = stub_->Attach(Ctx(root()).get(), attach, &attached);
  EXPECT_THAT(Line(refused),
              HasSubstr("clients of pool shared of all uids: 3 of 3 for uid 0 (--max-clients-per-pool)"));
  EXPECT_EQ(Numbers(RefusalOf(refused)), "max-clients-per-pool uid 0: 3 allowed, 3 used, 1 asked");
  v1::GetPoolRequest get;
  get.set_name("shared");
  v1::Pool pool;
  ASSERT_TRUE(stub_->GetPool(Ctx(root()).get(), get, &pool).ok());
  EXPECT_EQ(pool.clients_size(), 3);
  EXPECT_EQ(pool.client_count(), 3u);
}

// Item 6 (the count): the block ids of one request are bounded before any work.
TEST_F(LimitsTest, BlockIdsPerRequestAreLimited) {
  StartKvd({"--max-block-ids=4"});
  v1::CreatePoolRequest create;
  create.set_name("kv");
  v1::PoolDims* d = create.mutable_dims();
  d->set_layers(2);
  d->set_capacity_blocks(64);
  d->set_heads(1);
  d->set_block_tokens(16);
  d->set_channels(64);
  d->set_element_bytes(2);
  create.set_initial_blocks(64);
  v1::Pool pool;
  ASSERT_TRUE(stub_->CreatePool(Ctx(root()).get(), create, &pool).ok());

  v1::ZeroBlocksRequest zero;
  zero.set_pool("kv");
  for (uint64_t b : {1, 2, 3, 4}) zero.add_block_ids(b);
  v1::ZeroBlocksResponse zeroed;
  EXPECT_TRUE(stub_->ZeroBlocks(Ctx(root()).get(), zero, &zeroed).ok());
  zero.add_block_ids(5);
  const grpc::Status refused = stub_->ZeroBlocks(Ctx(root()).get(), zero, &zeroed);
  EXPECT_EQ(Line(refused), "RESOURCE_EXHAUSTED: block_ids: 5 in one request, more than 4 (--max-block-ids)");
  EXPECT_EQ(Numbers(RefusalOf(refused)), "max-block-ids uid 0: 4 allowed, 0 used, 5 asked");

  v1::CopyBlocksRequest copy;
  copy.set_pool("kv");
  for (uint64_t b = 0; b < 5; ++b) {
    v1::BlockCopy* c = copy.add_copies();
    c->set_src(b);
    c->set_dst(b + 10);
  }
  v1::CopyBlocksResponse copied;
  EXPECT_EQ(Line(stub_->CopyBlocks(Ctx(root()).get(), copy, &copied)),
            "RESOURCE_EXHAUSTED: copies: 5 in one request, more than 4 (--max-block-ids)");

  v1::DescribeTransferRequest describe;
  describe.set_pool("kv");
  for (uint64_t b = 0; b < 5; ++b) describe.add_block_ids(b);
  v1::DescribeTransferResponse described;
  EXPECT_EQ(Line(stub_->DescribeTransfer(Ctx(root()).get(), describe, &described)),
            "RESOURCE_EXHAUSTED: block_ids: 5 in one request, more than 4 (--max-block-ids)");
}

// Request size: gRPC refuses a request past --max-request-bytes before any handler runs.
TEST_F(LimitsTest, RequestsPastTheSizeLimitAreRefused) {
  StartKvd({"--max-request-bytes=8KiB"});
  v1::CreatePoolRequest create;
  create.set_name("big");
  for (uint32_t uid = 100000; uid < 104000; ++uid) create.add_allowed_uids(uid);  // ~12 KiB
  v1::Pool pool;
  const grpc::Status refused = stub_->CreatePool(Ctx(root()).get(), create, &pool);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << Line(refused);
  EXPECT_TRUE(RootCreate("small").ok());
}

// The daemon's peak resident memory, from /proc.
absl::StatusOr<uint64_t> PeakRss(const std::string& log) {
  const size_t at = log.rfind(", pid ");
  uint64_t pid = 0;
  if (at == std::string::npos ||
      !absl::SimpleAtoi(log.substr(at + 6, log.find_first_not_of("0123456789", at + 6) - at - 6), &pid)) {
    return absl::NotFoundError("no pid in kvd's ready line");
  }
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    absl::string_view rest = line;
    uint64_t kib = 0;
    if (absl::ConsumePrefix(&rest, "VmHWM:") &&
        absl::SimpleAtoi(absl::StripSuffix(absl::StripAsciiWhitespace(rest), " kB"), &kib)) {
      return kib << 10;
    }
  }
  return absl::NotFoundError("no VmHWM");
}

// Item 6: a 6-byte Grow of a pool with a huge capacity built its whole chunk plan (hundreds of MiB)
// before the budget refused it. Now the budget is checked from arithmetic first.
TEST_F(LimitsTest, AGrowPastTheBudgetIsRefusedBeforeItsChunkPlanIsBuilt) {
  // 1024 segments of 32 GiB each (32 TiB reserved): with 2 MiB chunks the plan of a grow to capacity
  // has 16.7 million chunks (~400 MiB); the budget is 512 MiB.
  StartKvd({"--max-chunk=2MiB"});
  const grpc::Status created = RootCreate("huge", 1024, uint64_t{16} << 20);  // 2 KiB blocks: 32 GiB per segment
  ASSERT_TRUE(created.ok()) << created.error_code() << ": " << created.error_message();
  absl::StatusOr<uint64_t> before = PeakRss(kvd_.log());
  ASSERT_TRUE(before.ok()) << before.status();
  v1::GrowRequest grow;
  grow.set_pool("huge");
  grow.set_target_blocks(uint64_t{16} << 20);
  v1::PoolUpdate update;
  const grpc::Status refused = stub_->Grow(Ctx(root()).get(), grow, &update);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(refused.error_message(), HasSubstr("needs 35184372088832 bytes (32.0 TiB) but only"));
  absl::StatusOr<uint64_t> after = PeakRss(kvd_.log());
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_LT(*after - *before, uint64_t{64} << 20) << "peak RSS grew from " << *before << " to " << *after;
}

// Item 8: listings are paginated; kvctl and libkvd follow the pages.
TEST_F(LimitsTest, ListPoolsIsPaginatedAndKvctlFollowsThePages) {
  StartKvd({});
  for (int i = 0; i < 105; ++i) ASSERT_TRUE(RootCreate(absl::StrCat("p", 1000 + i)).ok());
  // Root sees every pool; uid 1000 only its own.
  ASSERT_EQ(Create(1000, "mine").code, 0);

  std::vector<std::string> names;
  v1::ListPoolsRequest req;
  req.set_page_size(40);
  int pages = 0;
  do {
    v1::ListPoolsResponse resp;
    ASSERT_TRUE(stub_->ListPools(Ctx(root()).get(), req, &resp).ok());
    EXPECT_LE(resp.pools_size(), 40);
    for (const v1::Pool& p : resp.pools()) names.push_back(p.name());
    req.set_page_token(resp.next_page_token());
    ++pages;
  } while (!req.page_token().empty());
  EXPECT_EQ(pages, 3);
  ASSERT_EQ(names.size(), 106u);
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()).size(), 106u);

  // Default page: 100.
  v1::ListPoolsResponse first;
  ASSERT_TRUE(stub_->ListPools(Ctx(root()).get(), v1::ListPoolsRequest(), &first).ok());
  EXPECT_EQ(first.pools_size(), 100);
  EXPECT_FALSE(first.next_page_token().empty());

  v1::ListPoolsRequest bad;
  bad.set_page_token("not a token!");
  v1::ListPoolsResponse none;
  EXPECT_THAT(Line(stub_->ListPools(Ctx(root()).get(), bad, &none)), StartsWith("INVALID_ARGUMENT: page_token: "));

  Ran listed = Kvctl(0, {"pools"});
  ASSERT_EQ(listed.code, 0);
  EXPECT_EQ(std::vector<std::string>(absl::StrSplit(listed.output, '\n', absl::SkipEmpty())).size(), 107u);  // + header
  Ran json = Kvctl(0, {"--json", "pools"});
  ASSERT_EQ(json.code, 0);
  EXPECT_THAT(json.output, HasSubstr("\"name\": \"p1104\""));
  EXPECT_THAT(json.output, HasSubstr("\"name\": \"mine\""));
  Ran theirs = Kvctl(1000, {"pools"});
  EXPECT_EQ(std::vector<std::string>(absl::StrSplit(theirs.output, '\n', absl::SkipEmpty())).size(), 2u);
}

}  // namespace
}  // namespace kvd::daemon

int main(int argc, char** argv) {
  if (argc > 2 && std::string(argv[1]) == "--peer") return kvd::daemon::PeerMain(argc, argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
