#include "kvd/fd_passing.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace kvd {
namespace {

using ::kvd::testing::IsOk;
using ::kvd::testing::StatusIs;

class FdPassingTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds_), 0); }
  void TearDown() override {
    for (int fd : fds_) {
      if (fd >= 0) close(fd);
    }
  }
  int fds_[2] = {-1, -1};
};

ino_t Inode(int fd) {
  struct stat st {};
  EXPECT_EQ(fstat(fd, &st), 0);
  return st.st_ino;
}

TEST_F(FdPassingTest, AFullBatchArrivesAsNewFdsToTheSameFiles) {
  std::vector<int> pipes;
  for (size_t i = 0; i < kMaxFdsPerMessage / 2; ++i) {
    int p[2];
    ASSERT_EQ(pipe(p), 0);
    pipes.push_back(p[0]);
    pipes.push_back(p[1]);
  }
  ASSERT_THAT(SendWithFds(fds_[0], "batch 1", pipes), IsOk());
  KVD_ASSERT_OK_AND_ASSIGN(MessageWithFds got, ReceiveWithFds(fds_[1], 64));
  EXPECT_EQ(got.payload, "batch 1");
  ASSERT_EQ(got.fds.size(), pipes.size());
  for (size_t i = 0; i < pipes.size(); ++i) {
    EXPECT_NE(got.fds[i], pipes[i]);
    EXPECT_EQ(Inode(got.fds[i]), Inode(pipes[i]));
    close(got.fds[i]);
    close(pipes[i]);
  }
}

TEST_F(FdPassingTest, RefusesTooManyFdsAndEmptyPayloads) {
  std::vector<int> too_many(kMaxFdsPerMessage + 1, 0);
  EXPECT_THAT(SendWithFds(fds_[0], "x", too_many),
              StatusIs(absl::StatusCode::kInvalidArgument, "fds: 251 exceed 250 per message"));
  EXPECT_THAT(SendWithFds(fds_[0], "", {}), StatusIs(absl::StatusCode::kInvalidArgument, "payload: must not be empty"));
}

TEST_F(FdPassingTest, AClosedPeerIsUnavailableBothWays) {
  close(fds_[1]);
  fds_[1] = -1;
  EXPECT_THAT(SendWithFds(fds_[0], "hello", {}), StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
  int p[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, p), 0);
  close(p[0]);
  EXPECT_THAT(ReceiveWithFds(p[1], 16), StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
  close(p[1]);
}

TEST_F(FdPassingTest, ALongPayloadIsNotTruncatedSilently) {
  const std::string big(4096, 'k');
  ASSERT_THAT(SendWithFds(fds_[0], big, {}), IsOk());
  EXPECT_THAT(ReceiveWithFds(fds_[1], 100), IsOk());  // a stream socket: the first 100 bytes, the rest stays queued
  int d[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, d), 0);
  ASSERT_THAT(SendWithFds(d[0], big, {}), IsOk());
  EXPECT_THAT(ReceiveWithFds(d[1], 100), StatusIs(absl::StatusCode::kDataLoss, ::testing::_));
  close(d[0]);
  close(d[1]);
}

TEST_F(FdPassingTest, ReceiveMessageOwnsTheFdsOfATruncatedPacket) {
  int d[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, d), 0);
  int p[2];
  ASSERT_EQ(pipe(p), 0);
  const MessageIo sent = SendMessage(d[0], "a packet longer than the buffer", {p[0]}, 0);
  ASSERT_EQ(sent.error, 0);
  EXPECT_EQ(sent.bytes, 31u);
  close(p[0]);
  char buffer[4];
  std::vector<UniqueFd> fds;
  const MessageIo got = ReceiveMessage(d[1], absl::MakeSpan(buffer), 0, &fds);
  EXPECT_EQ(got.error, 0);
  EXPECT_EQ(got.bytes, 4u);
  EXPECT_NE(got.flags & MSG_TRUNC, 0);
  ASSERT_EQ(fds.size(), 1u);
  EXPECT_EQ(Inode(fds[0].get()), Inode(p[1]));
  EXPECT_NE(fcntl(fds[0].get(), F_GETFD) & FD_CLOEXEC, 0);
  fds.clear();
  // The pipe's last read end is closed now: writing to it breaks.
  signal(SIGPIPE, SIG_IGN);
  EXPECT_EQ(write(p[1], "x", 1), -1);
  EXPECT_EQ(errno, EPIPE);
  close(p[1]);
  close(d[0]);
  close(d[1]);
}

TEST_F(FdPassingTest, SendMessageWithDontWaitSaysWhenTheQueueIsFull) {
  int d[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, d), 0);
  const std::string packet(4096, 'k');
  MessageIo io;
  for (int i = 0; i < 100000 && io.error == 0; ++i) io = SendMessage(d[0], packet, {}, MSG_DONTWAIT);
  EXPECT_EQ(io.error, EAGAIN);
  std::vector<UniqueFd> fds;
  char buffer[8];
  EXPECT_EQ(ReceiveMessage(d[1], absl::MakeSpan(buffer), MSG_DONTWAIT, &fds).error, 0);
  close(d[1]);  // with packets unread: the peer's next send is ECONNRESET, else EPIPE
  EXPECT_THAT(SendMessage(d[0], packet, {}, MSG_DONTWAIT).error, ::testing::AnyOf(EPIPE, ECONNRESET));
  close(d[0]);
}

}  // namespace
}  // namespace kvd
