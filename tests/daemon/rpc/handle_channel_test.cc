// The handle channel over real sockets and real FDs: the server (daemon/rpc/handle_channel.h) with an
// in-test backend, spoken to by the client (client/handle_client.h) and by raw SOCK_SEQPACKET sockets
// where a test needs to see packets or misbehave. The PoolManager-backed channel is tested end to end
// by the daemon's integration tests.
#include "daemon/rpc/handle_channel.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/handle_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvd/fd_passing.h"
#include "kvd/v1/kvd.pb.h"
#include "tests/testing/status_matchers.h"

namespace kvd::daemon {
namespace {

using ::kvd::testing::IsOk;
using ::kvd::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;

// A backend with leases of real FDs: RedeemLease hands out duplicates (the channel closes those) and
// records their numbers; the test keeps and closes the originals.
class FakeBackend : public HandleChannelBackend {
 public:
  struct SessionInfo {
    uint32_t uid = 0;
    int32_t pid = 0;
    std::string name;
  };

  absl::StatusOr<std::string> OpenSession(uint32_t uid, int32_t pid, std::string name) override {
    absl::MutexLock lock(&mu_);
    std::string token = absl::StrCat("session-", ++next_session_);
    sessions_[token] = SessionInfo{uid, pid, std::move(name)};
    return token;
  }

  void CloseSession(absl::string_view session) override {
    absl::MutexLock lock(&mu_);
    closed_.emplace_back(session);
  }

  absl::StatusOr<std::vector<LeasedFd>> RedeemLease(absl::string_view session, absl::string_view lease,
                                                    uint32_t peer_uid, bool skip_released) override {
    absl::MutexLock lock(&mu_);
    ++redeems_;
    skips_.push_back(skip_released);
    auto known = sessions_.find(std::string(session));
    if (known == sessions_.end()) return absl::UnauthenticatedError(absl::StrCat("session ", session, ": unknown"));
    if (known->second.uid != peer_uid) return absl::PermissionDeniedError("peer uid differs from the session's");
    if (auto error = errors_.find(std::string(lease)); error != errors_.end()) return error->second;
    if (lease == gated_lease_) {
      mu_.Unlock();
      gate_->WaitForNotification();
      mu_.Lock();
    }
    auto found = leases_.find(std::string(lease));
    if (found == leases_.end()) return absl::NotFoundError(absl::StrCat("lease ", lease, ": unknown"));
    std::vector<LeasedFd> out;
    for (const auto& [chunk_id, fd] : found->second) {
      const int dup = fcntl(fd, F_DUPFD_CLOEXEC, 0);
      if (dup < 0) {
        for (const LeasedFd& l : out) close(l.fd);
        return absl::InternalError("dup failed");
      }
      out.push_back({chunk_id, dup});
      handed_.push_back(dup);
    }
    return out;
  }

  // Adopts every FD it is given (and closes it), reporting their chunk ids back.
  absl::StatusOr<v1::HandlesReturned> ReturnHandles(absl::string_view session, uint32_t peer_uid, absl::string_view,
                                                    std::vector<std::pair<uint64_t, UniqueFd>> fds) override {
    absl::MutexLock lock(&mu_);
    auto known = sessions_.find(std::string(session));
    if (known == sessions_.end()) return absl::UnauthenticatedError(absl::StrCat("session ", session, ": unknown"));
    if (known->second.uid != peer_uid) return absl::PermissionDeniedError("peer uid differs from the session's");
    v1::HandlesReturned out;
    for (const auto& [id, fd] : fds) {
      if (!fd.valid()) return absl::InvalidArgumentError("an invalid FD");
      out.add_adopted_chunk_ids(id);
    }
    out.set_state(v1::POOL_STATE_AWAKE);
    return out;
  }

  void AddLease(std::string lease, std::vector<std::pair<uint64_t, int>> chunks) {
    absl::MutexLock lock(&mu_);
    leases_[std::move(lease)] = std::move(chunks);
  }
  void AddError(std::string lease, absl::Status status) {
    absl::MutexLock lock(&mu_);
    errors_[std::move(lease)] = std::move(status);
  }
  // RedeemLease(`lease`) waits for `gate` before handing out the FDs.
  void GateLease(std::string lease, absl::Notification* gate) {
    absl::MutexLock lock(&mu_);
    gated_lease_ = std::move(lease);
    gate_ = gate;
  }

  std::vector<std::string> closed() const {
    absl::MutexLock lock(&mu_);
    return closed_;
  }
  std::map<std::string, SessionInfo> sessions() const {
    absl::MutexLock lock(&mu_);
    return sessions_;
  }
  int redeems() const {
    absl::MutexLock lock(&mu_);
    return redeems_;
  }
  // Each redemption's skip_released, in order.
  std::vector<bool> skips() const {
    absl::MutexLock lock(&mu_);
    return skips_;
  }
  std::vector<int> handed() const {
    absl::MutexLock lock(&mu_);
    return handed_;
  }

 private:
  mutable absl::Mutex mu_;
  int next_session_ = 0;
  int redeems_ = 0;
  std::vector<bool> skips_;
  std::map<std::string, SessionInfo> sessions_;
  std::vector<std::string> closed_;
  std::map<std::string, std::vector<std::pair<uint64_t, int>>> leases_;
  std::map<std::string, absl::Status> errors_;
  std::vector<int> handed_;
  std::string gated_lease_;
  absl::Notification* gate_ = nullptr;
};

// Polls `done` until it holds or `timeout` passes; returns its last value.
bool WaitFor(const std::function<bool()>& done, absl::Duration timeout = absl::Seconds(10)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!done()) {
    if (absl::Now() > deadline) return done();
    absl::SleepFor(absl::Milliseconds(2));
  }
  return true;
}

size_t OpenFdCount() {
  size_t count = 0;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return 0;
  while (dirent* entry = readdir(dir)) {
    if (entry->d_name[0] != '.') ++count;
  }
  closedir(dir);
  return count;  // includes the directory's own FD, as every call does
}

bool IsOpen(int fd) { return fcntl(fd, F_GETFD) != -1; }

ino_t Inode(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0) return 0;
  return st.st_ino;
}

std::string Contents(int fd) {
  char buffer[64];
  const ssize_t n = pread(fd, buffer, sizeof(buffer), 0);
  return n > 0 ? std::string(buffer, static_cast<size_t>(n)) : std::string();
}

int RawConnect(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

bool RawSend(int fd, const std::string& bytes) {
  return send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
}

std::string FetchRequest(const std::string& session, const std::string& lease) {
  v1::HandleChannelRequest request;
  request.mutable_fetch_handles()->set_session_token(session);
  request.mutable_fetch_handles()->set_lease_token(lease);
  return request.SerializeAsString();
}

std::string OpenRequest(const std::string& name) {
  v1::HandleChannelRequest request;
  request.mutable_open_session()->set_client_name(name);
  return request.SerializeAsString();
}

struct RawReply {
  bool eof = false;
  v1::HandleChannelReply reply;
  std::vector<int> fds;  // the test closes them
};

// The next packet on a raw connection, or eof.
absl::StatusOr<RawReply> ReadRaw(int fd, absl::Duration timeout = absl::Seconds(10)) {
  pollfd polled{fd, POLLIN, 0};
  const int ready = poll(&polled, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout)));
  if (ready <= 0) return absl::DeadlineExceededError("no packet");
  RawReply out;
  absl::StatusOr<MessageWithFds> packet = ReceiveWithFds(fd, 64 * 1024);
  if (absl::IsUnavailable(packet.status())) {
    out.eof = true;
    return out;
  }
  if (!packet.ok()) return packet.status();
  out.fds = std::move(packet->fds);
  if (!out.reply.ParseFromString(packet->payload)) return absl::DataLossError("not a HandleChannelReply");
  return out;
}

// Reads the connection's reply: one HandleChannelError followed by EOF. Returns it as a status.
absl::Status ReadErrorThenEof(int fd) {
  absl::StatusOr<RawReply> got = ReadRaw(fd);
  if (!got.ok()) return absl::InternalError(absl::StrCat("reading the error: ", got.status().ToString()));
  if (got->eof || !got->reply.has_error()) return absl::InternalError("expected a HandleChannelError");
  absl::StatusOr<RawReply> eof = ReadRaw(fd);
  if (!eof.ok() || !eof->eof) return absl::InternalError("expected EOF after the error");
  return absl::Status(static_cast<absl::StatusCode>(got->reply.error().code()), got->reply.error().message());
}

class HandleChannelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = ::testing::TempDir() + "kvd_hc_XXXXXX";
    ASSERT_NE(mkdtemp(templ.data()), nullptr) << std::strerror(errno);
    dir_ = templ;
    path_ = dir_ + "/gpu0.handles";
  }

  void TearDown() override {
    channel_.reset();
    for (int fd : files_) close(fd);
    unlink(path_.c_str());
    rmdir(dir_.c_str());
  }

  void StartChannel(HandleChannel::Options options = {}) {
    absl::StatusOr<std::unique_ptr<HandleChannel>> channel = HandleChannel::Start(path_, &backend_, options);
    ASSERT_THAT(channel, IsOk());
    channel_ = *std::move(channel);
  }

  // `count` memfds holding "chunk <id>", ids first_id, first_id + 7, ...; registered as `lease`.
  std::vector<std::pair<uint64_t, int>> MakeLease(const std::string& lease, size_t count, uint64_t first_id = 1000) {
    std::vector<std::pair<uint64_t, int>> chunks;
    for (size_t i = 0; i < count; ++i) {
      const uint64_t id = first_id + 7 * i;
      const int fd = memfd_create("kvd-test-chunk", MFD_CLOEXEC);
      EXPECT_GE(fd, 0) << std::strerror(errno);
      const std::string text = absl::StrCat("chunk ", id);
      EXPECT_EQ(write(fd, text.data(), text.size()), static_cast<ssize_t>(text.size()));
      files_.push_back(fd);
      chunks.emplace_back(id, fd);
    }
    backend_.AddLease(lease, chunks);
    return chunks;
  }

  HandleClientOptions ClientOptions() const { return {.timeout = absl::Seconds(10)}; }

  std::string dir_;
  std::string path_;
  std::vector<int> files_;
  FakeBackend backend_;  // outlives channel_
  std::unique_ptr<HandleChannel> channel_;
};

TEST_F(HandleChannelTest, SessionReportsThePeersRealUidAndPid) {
  StartChannel();
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession session, HandleSession::Open(path_, "vllm-rank0", ClientOptions()));
  EXPECT_EQ(session.uid(), getuid());
  EXPECT_EQ(session.pid(), getpid());
  EXPECT_FALSE(session.token().empty());
  EXPECT_TRUE(session.is_open());

  std::map<std::string, FakeBackend::SessionInfo> sessions = backend_.sessions();
  ASSERT_EQ(sessions.count(session.token()), 1u);
  EXPECT_EQ(sessions[session.token()].uid, getuid());
  EXPECT_EQ(sessions[session.token()].pid, getpid());
  EXPECT_EQ(sessions[session.token()].name, "vllm-rank0");
  EXPECT_TRUE(WaitFor([&] { return channel_->open_sessions() == 1; }));
  EXPECT_EQ(channel_->stats().sessions_opened, 1u);
  EXPECT_THAT(backend_.closed(), ::testing::IsEmpty());
}

TEST_F(HandleChannelTest, ClosingTheClientSessionClosesItOnTheServer) {
  StartChannel();
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession session, HandleSession::Open(path_, "engine", ClientOptions()));
  const std::string token = session.token();
  ASSERT_TRUE(WaitFor([&] { return channel_->open_sessions() == 1; }));

  session.Close();
  EXPECT_FALSE(session.is_open());
  ASSERT_TRUE(WaitFor([&] { return !backend_.closed().empty(); }));
  EXPECT_THAT(backend_.closed(), ElementsAre(token));
  EXPECT_TRUE(WaitFor([&] { return channel_->open_sessions() == 0; }));
  EXPECT_EQ(channel_->stats().sessions_closed, 1u);
  EXPECT_THAT(session.Fetch("any"), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("closed")));
}

TEST_F(HandleChannelTest, DestroyingAMovedFromSessionLeavesTheSessionOpen) {
  StartChannel();
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession first, HandleSession::Open(path_, "engine", ClientOptions()));
  HandleSession second = std::move(first);
  { HandleSession gone = std::move(first); }  // NOLINT(bugprone-use-after-move): moved-from is closed
  ASSERT_TRUE(WaitFor([&] { return channel_->open_sessions() == 1; }));
  EXPECT_TRUE(second.is_open());
  EXPECT_THAT(backend_.closed(), ::testing::IsEmpty());
  second = HandleSession(std::move(second));
  EXPECT_TRUE(second.is_open());
}

TEST_F(HandleChannelTest, SixHundredFdsArriveInThreeOrderedBatchesOfTheSameFiles) {
  StartChannel();
  const std::vector<std::pair<uint64_t, int>> chunks = MakeLease("lease-600", 600);
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession session, HandleSession::Open(path_, "engine", ClientOptions()));

  // On the wire: 250, 250, 100 FDs, ids in order, last only on the final batch.
  const int raw = RawConnect(path_);
  ASSERT_GE(raw, 0);
  ASSERT_TRUE(RawSend(raw, FetchRequest(session.token(), "lease-600")));
  std::vector<size_t> sizes;
  std::vector<bool> lasts;
  std::vector<uint64_t> ids;
  while (true) {
    KVD_ASSERT_OK_AND_ASSIGN(RawReply got, ReadRaw(raw));
    ASSERT_FALSE(got.eof);
    ASSERT_TRUE(got.reply.has_handle_batch());
    const v1::HandleBatch& batch = got.reply.handle_batch();
    EXPECT_EQ(static_cast<size_t>(batch.chunk_ids_size()), got.fds.size());
    sizes.push_back(got.fds.size());
    lasts.push_back(batch.last());
    for (size_t i = 0; i < got.fds.size(); ++i) {
      const size_t at = ids.size();
      ids.push_back(batch.chunk_ids(static_cast<int>(i)));
      ASSERT_LT(at, chunks.size());
      EXPECT_EQ(Inode(got.fds[i]), Inode(chunks[at].second));
      close(got.fds[i]);
    }
    if (batch.last()) break;
  }
  KVD_ASSERT_OK_AND_ASSIGN(RawReply end, ReadRaw(raw));
  EXPECT_TRUE(end.eof);
  close(raw);
  EXPECT_THAT(sizes, ElementsAre(250, 250, 100));
  EXPECT_THAT(lasts, ElementsAre(false, false, true));
  ASSERT_EQ(ids.size(), chunks.size());
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(ids[i], chunks[i].first);

  // Through the client: the same, as (id, FD) pairs the caller owns, close-on-exec.
  KVD_ASSERT_OK_AND_ASSIGN(auto handles, session.Fetch("lease-600"));
  ASSERT_EQ(handles.size(), chunks.size());
  for (size_t i = 0; i < handles.size(); ++i) {
    EXPECT_EQ(handles[i].first, chunks[i].first);
    EXPECT_NE(handles[i].second, chunks[i].second);
    EXPECT_EQ(Contents(handles[i].second), absl::StrCat("chunk ", chunks[i].first));
    EXPECT_NE(fcntl(handles[i].second, F_GETFD) & FD_CLOEXEC, 0);
    close(handles[i].second);
  }
  EXPECT_TRUE(WaitFor([&] { return channel_->stats().fetches_served == 2; }));
  EXPECT_EQ(channel_->stats().fds_sent, 1200u);
}

// docs/api.md, "Pushed handles": a lease pushed on the session's own connection, read by TakePushed, which drops an
// earlier push whose reply never came; the session stays alive with a batch queued.
TEST_F(HandleChannelTest, APushedLeaseArrivesOnTheSessionsConnectionAndTheSessionStaysAlive) {
  StartChannel();
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession session, HandleSession::Open(path_, "engine", ClientOptions()));
  ASSERT_TRUE(WaitFor([&] { return channel_->open_sessions() == 1; }));
  const std::vector<std::pair<uint64_t, int>> stale = MakeLease("unused-stale", 2, 50);
  const std::vector<std::pair<uint64_t, int>> chunks = MakeLease("unused", 3);
  auto split = [](const std::vector<std::pair<uint64_t, int>>& leased) {
    std::pair<std::vector<uint64_t>, std::vector<int>> out;
    for (const auto& [id, fd] : leased) {
      out.first.push_back(id);
      out.second.push_back(fd);
    }
    return out;
  };
  const auto [stale_ids, stale_fds] = split(stale);
  const auto [ids, fds] = split(chunks);
  ASSERT_THAT(channel_->Push(session.token(), "lease-stale", stale_ids, stale_fds), IsOk());
  ASSERT_THAT(channel_->Push(session.token(), "lease-1", ids, fds), IsOk());
  EXPECT_TRUE(session.Alive());  // two batches queued on the connection: not its end
  EXPECT_EQ(channel_->stats().leases_pushed, 2u);
  EXPECT_EQ(channel_->stats().fds_sent, 5u);

  KVD_ASSERT_OK_AND_ASSIGN(HandleSession::LeasedFds got, session.TakePushed("lease-1"));
  ASSERT_EQ(got.size(), chunks.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].first, chunks[i].first);
    EXPECT_EQ(Contents(got[i].second), absl::StrCat("chunk ", chunks[i].first));
    EXPECT_NE(fcntl(got[i].second, F_GETFD) & FD_CLOEXEC, 0);
  }
  CloseLeased(got);
  EXPECT_TRUE(got.empty());
  EXPECT_TRUE(session.Alive());
  // Nothing pushed: a protocol error, not a wait.
  EXPECT_THAT(session.TakePushed("lease-2"), StatusIs(absl::StatusCode::kInternal, HasSubstr("holds no batch")));
  // The session's end: Push finds no connection, and the client sees the end of file.
  EXPECT_THAT(channel_->Push("session-none", "lease-3", ids, fds),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no open")));
  std::vector<uint64_t> many_ids(kMaxFdsPerMessage + 1, 1);
  std::vector<int> many_fds(kMaxFdsPerMessage + 1, fds[0]);
  EXPECT_THAT(channel_->Push(session.token(), "lease-4", many_ids, many_fds),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("more than one packet")));
  channel_->Stop();
  EXPECT_TRUE(WaitFor([&] { return !session.Alive(); }));
  EXPECT_THAT(channel_->Push(session.token(), "lease-5", ids, fds),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no open")));
}

TEST_F(HandleChannelTest, AnEmptyLeaseIsOneEmptyLastBatch) {
  StartChannel();
  MakeLease("empty", 0);
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession session, HandleSession::Open(path_, "engine", ClientOptions()));

  const int raw = RawConnect(path_);
  ASSERT_GE(raw, 0);
  ASSERT_TRUE(RawSend(raw, FetchRequest(session.token(), "empty")));
  KVD_ASSERT_OK_AND_ASSIGN(RawReply got, ReadRaw(raw));
  ASSERT_TRUE(got.reply.has_handle_batch());
  EXPECT_EQ(got.reply.handle_batch().chunk_ids_size(), 0);
  EXPECT_TRUE(got.reply.handle_batch().last());
  EXPECT_TRUE(got.fds.empty());
  KVD_ASSERT_OK_AND_ASSIGN(RawReply end, ReadRaw(raw));
  EXPECT_TRUE(end.eof);
  close(raw);

  KVD_ASSERT_OK_AND_ASSIGN(auto handles, session.Fetch("empty"));
  EXPECT_TRUE(handles.empty());
}

// FetchHandles.skip_released reaches the backend as the client sent it.
TEST_F(HandleChannelTest, SkipReleasedReachesTheBackend) {
  StartChannel();
  MakeLease("strict", 1);
  MakeLease("skipping", 1);
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession session, HandleSession::Open(path_, "engine", ClientOptions()));
  for (const auto& [lease, skip] : {std::pair<std::string, bool>{"strict", false}, {"skipping", true}}) {
    KVD_ASSERT_OK_AND_ASSIGN(auto handles, session.Fetch(lease, skip));
    ASSERT_EQ(handles.size(), 1u);
    close(handles[0].second);
  }
  EXPECT_EQ(backend_.skips(), (std::vector<bool>{false, true}));
}

TEST_F(HandleChannelTest, BackendErrorsArriveWithTheirCodeAndMessage) {
  StartChannel();
  backend_.AddError("forbidden", absl::PermissionDeniedError("uid 1000 may not attach pool kv0"));
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession session, HandleSession::Open(path_, "engine", ClientOptions()));

  EXPECT_THAT(session.Fetch("forbidden"),
              StatusIs(absl::StatusCode::kPermissionDenied, "uid 1000 may not attach pool kv0"));
  EXPECT_THAT(session.Fetch("no-such-lease"), StatusIs(absl::StatusCode::kNotFound, "lease no-such-lease: unknown"));

  // A lease redeemed with someone else's session token.
  const int raw = RawConnect(path_);
  ASSERT_GE(raw, 0);
  ASSERT_TRUE(RawSend(raw, FetchRequest("session-999", "forbidden")));
  EXPECT_THAT(ReadErrorThenEof(raw), StatusIs(absl::StatusCode::kUnauthenticated, "session session-999: unknown"));
  close(raw);
  EXPECT_TRUE(WaitFor([&] { return channel_->stats().errors == 3; }));
}

TEST_F(HandleChannelTest, MalformedRequestsAreRefusedAndTheServerKeepsServing) {
  HandleChannel::Options options;
  options.max_request_bytes = 1024;
  StartChannel(options);
  const size_t fds_before = OpenFdCount();

  struct Case {
    std::string name;
    std::function<bool(int)> send;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"garbage", [](int fd) { return RawSend(fd, "\xff\xff\xff\xff"); }, "not a serialized"},
      {"empty packet", [](int fd) { return RawSend(fd, ""); }, "request: empty packet"},
      {"oversized", [](int fd) { return RawSend(fd, OpenRequest(std::string(2000, 'a'))); },
       "request: larger than 1024 bytes"},
      {"no kind", [](int fd) { return RawSend(fd, std::string("\x18\x01", 2)); },
       "neither open_session nor fetch_handles"},
      {"bad client name", [](int fd) { return RawSend(fd, OpenRequest("no spaces/slashes")); },
       "open_session.client_name"},
      {"no lease token", [](int fd) { return RawSend(fd, FetchRequest("session-1", "")); },
       "fetch_handles.lease_token: must not be empty"},
      {"with an FD",
       [](int fd) {
         int pipe_fds[2];
         if (pipe2(pipe_fds, O_CLOEXEC) != 0) return false;
         const bool sent = SendWithFds(fd, OpenRequest("x"), {pipe_fds[0]}).ok();
         close(pipe_fds[0]);
         close(pipe_fds[1]);
         return sent;
       },
       "request: must carry no file descriptors"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const int raw = RawConnect(path_);
    ASSERT_GE(raw, 0);
    ASSERT_TRUE(c.send(raw));
    EXPECT_THAT(ReadErrorThenEof(raw), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)));
    close(raw);
  }
  EXPECT_EQ(channel_->stats().errors, cases.size());
  EXPECT_EQ(backend_.redeems(), 0);
  // The FD sent with a request was closed by the server too.
  EXPECT_TRUE(WaitFor([&] { return OpenFdCount() == fds_before; }));

  KVD_ASSERT_OK_AND_ASSIGN(HandleSession session, HandleSession::Open(path_, "still-serving", ClientOptions()));
  EXPECT_EQ(session.uid(), getuid());
}

TEST_F(HandleChannelTest, ASecondPacketOnASessionConnectionEndsTheSession) {
  StartChannel();
  const int raw = RawConnect(path_);
  ASSERT_GE(raw, 0);
  ASSERT_TRUE(RawSend(raw, OpenRequest("raw")));
  KVD_ASSERT_OK_AND_ASSIGN(RawReply opened, ReadRaw(raw));
  ASSERT_TRUE(opened.reply.has_session_opened());
  ASSERT_TRUE(RawSend(raw, OpenRequest("again")));
  EXPECT_THAT(ReadErrorThenEof(raw), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("one request")));
  close(raw);
  EXPECT_THAT(backend_.closed(), ElementsAre(opened.reply.session_opened().session_token()));
  EXPECT_EQ(channel_->open_sessions(), 0u);
}

TEST_F(HandleChannelTest, APeerThatSaysNothingIsDroppedAfterTheTimeout) {
  HandleChannel::Options options;
  options.first_request_timeout = absl::Milliseconds(100);
  StartChannel(options);
  const int raw = RawConnect(path_);
  ASSERT_GE(raw, 0);
  EXPECT_THAT(ReadErrorThenEof(raw), StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("no request within")));
  close(raw);
  EXPECT_EQ(channel_->stats().errors, 1u);
  channel_->Stop();
}

TEST_F(HandleChannelTest, StopReturnsPromptlyWhileAPeerSaysNothing) {
  HandleChannel::Options options;
  options.first_request_timeout = absl::Seconds(300);
  StartChannel(options);
  const int raw = RawConnect(path_);
  ASSERT_GE(raw, 0);
  // Connections are accepted in order: once a later one is served, the silent one has been accepted.
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession session, HandleSession::Open(path_, "engine", ClientOptions()));

  const absl::Time start = absl::Now();
  channel_->Stop();
  EXPECT_LT(absl::Now() - start, absl::Seconds(60));
  // The silent peer is told, then closed.
  EXPECT_THAT(ReadErrorThenEof(raw), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("stopping")));
  close(raw);
  EXPECT_THAT(backend_.closed(), ElementsAre(session.token()));
}

TEST_F(HandleChannelTest, FetchesBeyondTheWorkerLimitWaitTheirTurn) {
  HandleChannel::Options options;
  options.max_fetch_workers = 1;
  StartChannel(options);
  MakeLease("slow", 2);
  MakeLease("next", 3, 2000);
  absl::Notification gate;
  backend_.GateLease("slow", &gate);
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession session, HandleSession::Open(path_, "engine", ClientOptions()));
  // The one worker is held by "slow"; "next" waits in the queue, unredeemed, until it is free.
  std::optional<absl::StatusOr<std::vector<std::pair<uint64_t, int>>>> slow, next;
  std::thread first([&] { slow.emplace(session.Fetch("slow")); });
  ASSERT_TRUE(WaitFor([&] { return backend_.redeems() == 1; }));
  std::thread second([&] { next.emplace(session.Fetch("next")); });
  // Give the queued fetch every chance to be served early: it must not be.
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(backend_.redeems(), 1);
  gate.Notify();
  first.join();
  second.join();
  ASSERT_TRUE(slow->ok()) << slow->status();
  ASSERT_TRUE(next->ok()) << next->status();
  EXPECT_EQ((*slow)->size(), 2u);
  EXPECT_EQ((*next)->size(), 3u);
  for (const auto* fds : {&**slow, &**next}) {
    for (const auto& [chunk_id, fd] : *fds) close(fd);
  }
  EXPECT_EQ(backend_.redeems(), 2);
}

TEST_F(HandleChannelTest, StopClosesEverySessionAndUnlinksTheSocket) {
  StartChannel();
  std::vector<HandleSession> sessions;
  std::set<std::string> tokens;
  for (int i = 0; i < 3; ++i) {
    KVD_ASSERT_OK_AND_ASSIGN(HandleSession session,
                             HandleSession::Open(path_, absl::StrCat("engine-", i), ClientOptions()));
    tokens.insert(session.token());
    sessions.push_back(std::move(session));
  }
  ASSERT_TRUE(WaitFor([&] { return channel_->open_sessions() == 3; }));
  struct stat st {};
  ASSERT_EQ(stat(path_.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0660u);

  channel_->Stop();
  std::vector<std::string> closed = backend_.closed();
  EXPECT_EQ(std::set<std::string>(closed.begin(), closed.end()), tokens);
  EXPECT_EQ(closed.size(), 3u);
  EXPECT_EQ(channel_->open_sessions(), 0u);
  EXPECT_NE(stat(path_.c_str(), &st), 0);
  EXPECT_EQ(errno, ENOENT);
  channel_->Stop();  // idempotent
  EXPECT_EQ(backend_.closed().size(), 3u);
  EXPECT_THAT(HandleSession::Open(path_, "late", ClientOptions()),
              StatusIs(absl::StatusCode::kUnavailable, absl::StrCat("no kvd daemon at ", path_)));
}

TEST_F(HandleChannelTest, LeasedFdsAreClosedOnceSent) {
  StartChannel();
  MakeLease("lease", 300);
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession session, HandleSession::Open(path_, "engine", ClientOptions()));
  const size_t fds_before = OpenFdCount();

  KVD_ASSERT_OK_AND_ASSIGN(auto handles, session.Fetch("lease"));
  ASSERT_EQ(handles.size(), 300u);
  for (const auto& [chunk_id, fd] : handles) close(fd);
  ASSERT_TRUE(WaitFor([&] { return channel_->stats().fetches_served == 1; }));
  EXPECT_TRUE(WaitFor([&] { return OpenFdCount() == fds_before; }))
      << OpenFdCount() << " FDs open, " << fds_before << " before";
  const std::vector<int> handed = backend_.handed();
  ASSERT_EQ(handed.size(), 300u);
  for (int fd : handed) EXPECT_FALSE(IsOpen(fd)) << "leased FD " << fd << " is still open";
}

TEST_F(HandleChannelTest, ConnectionsBeyondTheLimitAreRefused) {
  HandleChannel::Options options;
  options.max_connections = 2;
  StartChannel(options);
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession first, HandleSession::Open(path_, "one", ClientOptions()));
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession second, HandleSession::Open(path_, "two", ClientOptions()));
  EXPECT_THAT(HandleSession::Open(path_, "three", ClientOptions()),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("2 of 2 for uid")));
  // Fetches count too.
  MakeLease("lease", 1);
  EXPECT_THAT(first.Fetch("lease"), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("2 of 2 for uid")));
  EXPECT_EQ(backend_.redeems(), 0);

  // A slot frees once a session ends.
  first.Close();
  std::optional<HandleSession> third;
  EXPECT_TRUE(WaitFor([&] {
    absl::StatusOr<HandleSession> opened = HandleSession::Open(path_, "three", ClientOptions());
    if (opened.ok()) third.emplace(*std::move(opened));
    return third.has_value();
  }));
  EXPECT_GE(channel_->stats().errors, 2u);
}

TEST_F(HandleChannelTest, AClientThatVanishesMidFetchLeaksNoFds) {
  StartChannel();
  MakeLease("slow", 600);
  MakeLease("big", 600, 5000);
  absl::Notification gate;
  backend_.GateLease("slow", &gate);
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession session, HandleSession::Open(path_, "engine", ClientOptions()));
  const size_t fds_before = OpenFdCount();

  // The client goes away while the daemon is redeeming its lease: the first send fails.
  const int raw = RawConnect(path_);
  ASSERT_GE(raw, 0);
  ASSERT_TRUE(RawSend(raw, FetchRequest(session.token(), "slow")));
  ASSERT_TRUE(WaitFor([&] { return backend_.redeems() == 1; }));
  close(raw);
  gate.Notify();
  EXPECT_TRUE(WaitFor([&] { return channel_->stats().errors == 1; }));
  EXPECT_EQ(channel_->stats().fetches_served, 0u);
  EXPECT_TRUE(WaitFor([&] { return OpenFdCount() == fds_before; }))
      << OpenFdCount() << " FDs open, " << fds_before << " before";

  // The client reads one batch of three and goes away.
  const int partial = RawConnect(path_);
  ASSERT_GE(partial, 0);
  ASSERT_TRUE(RawSend(partial, FetchRequest(session.token(), "big")));
  KVD_ASSERT_OK_AND_ASSIGN(RawReply first, ReadRaw(partial));
  ASSERT_TRUE(first.reply.has_handle_batch());
  EXPECT_EQ(first.fds.size(), kMaxFdsPerMessage);
  for (int fd : first.fds) close(fd);
  close(partial);
  EXPECT_TRUE(WaitFor([&] { return backend_.redeems() == 2 && OpenFdCount() == fds_before; }))
      << OpenFdCount() << " FDs open, " << fds_before << " before";
  for (int fd : backend_.handed()) EXPECT_FALSE(IsOpen(fd)) << "leased FD " << fd << " is still open";

  channel_->Stop();
  EXPECT_THAT(backend_.closed(), ElementsAre(session.token()));
}

TEST_F(HandleChannelTest, StartRefusesBadPathsAndLeavesNothingBehind) {
  EXPECT_THAT(HandleChannel::Start("", &backend_), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("path")));
  EXPECT_THAT(HandleChannel::Start(dir_ + "/" + std::string(200, 'x'), &backend_),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bytes exceed")));
  EXPECT_THAT(HandleChannel::Start(dir_ + "/missing/gpu0.handles", &backend_),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("bind")));
  EXPECT_THAT(HandleChannel::Start(path_, nullptr), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("backend")));

  StartChannel();
  const size_t fds_before = OpenFdCount();
  EXPECT_THAT(HandleChannel::Start(path_, &backend_), StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("bind")));
  EXPECT_EQ(OpenFdCount(), fds_before);
  struct stat st {};
  EXPECT_EQ(stat(path_.c_str(), &st), 0) << "a failed Start removed the running channel's socket";
  KVD_ASSERT_OK_AND_ASSIGN(HandleSession session, HandleSession::Open(path_, "engine", ClientOptions()));
}

TEST(HandleSessionTest, NoDaemonIsUnavailable) {
  const std::string path = ::testing::TempDir() + "kvd-no-such-daemon.handles";
  EXPECT_THAT(HandleSession::Open(path, "engine"),
              StatusIs(absl::StatusCode::kUnavailable, absl::StrCat("no kvd daemon at ", path)));
}

TEST(HandleSessionTest, ASilentDaemonIsDeadlineExceeded) {
  // A listening socket that never answers.
  std::string dir = ::testing::TempDir() + "kvd_hs_XXXXXX";
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  const std::string path = dir + "/silent.handles";
  const int listener = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  ASSERT_GE(listener, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  ASSERT_EQ(bind(listener, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(listener, 8), 0);
  EXPECT_THAT(HandleSession::Open(path, "engine", {.timeout = absl::Milliseconds(100)}),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("no reply within")));
  close(listener);
  unlink(path.c_str());
  rmdir(dir.c_str());
}

TEST(HandleSessionTest, ADaemonThatGoesAwayBeforeAcceptingIsUnavailable) {
  std::string dir = ::testing::TempDir() + "kvd_hs_XXXXXX";
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  const std::string path = dir + "/vanishing.handles";
  const int listener = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  ASSERT_GE(listener, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  ASSERT_EQ(bind(listener, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(listener, 8), 0);

  absl::Status opened;
  std::thread client([&] { opened = HandleSession::Open(path, "engine", {.timeout = absl::Seconds(30)}).status(); });
  // Once the client's connection waits in the backlog, the "daemon" closes without accepting it.
  pollfd polled{listener, POLLIN, 0};
  EXPECT_EQ(poll(&polled, 1, 10000), 1);
  close(listener);
  client.join();
  EXPECT_THAT(opened, StatusIs(absl::StatusCode::kUnavailable, HasSubstr(path)));
  unlink(path.c_str());
  rmdir(dir.c_str());
}

}  // namespace
}  // namespace kvd::daemon
