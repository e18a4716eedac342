// Tests UniqueFd (kvd/unique_fd.h): it closes what it owns exactly once, and never what it gave away.
#include "kvd/unique_fd.h"

#include <fcntl.h>
#include <unistd.h>

#include <utility>

#include "gtest/gtest.h"

namespace kvd {
namespace {

bool IsOpen(int fd) { return fcntl(fd, F_GETFD) >= 0; }

int NewFd() { return open("/dev/null", O_RDONLY | O_CLOEXEC); }

TEST(UniqueFdTest, ClosesWhatItOwnsWhenDestroyed) {
  int raw = -1;
  {
    UniqueFd fd(NewFd());
    raw = fd.get();
    ASSERT_TRUE(fd.valid());
    EXPECT_TRUE(static_cast<bool>(fd));
    EXPECT_TRUE(IsOpen(raw));
  }
  EXPECT_FALSE(IsOpen(raw));
}

TEST(UniqueFdTest, EmptyByDefaultAndAfterRelease) {
  UniqueFd empty;
  EXPECT_FALSE(empty.valid());
  EXPECT_EQ(empty.get(), -1);
  UniqueFd fd(NewFd());
  const int raw = fd.release();
  EXPECT_FALSE(fd);
  EXPECT_TRUE(IsOpen(raw)) << "released FDs are the caller's";
  close(raw);
}

TEST(UniqueFdTest, MovingTransfersOwnershipOnce) {
  UniqueFd a(NewFd());
  const int raw = a.get();
  UniqueFd b(std::move(a));
  EXPECT_FALSE(a.valid());  // NOLINT(bugprone-use-after-move): a moved-from UniqueFd is empty
  EXPECT_EQ(b.get(), raw);
  UniqueFd c(NewFd());
  const int other = c.get();
  c = std::move(b);
  EXPECT_FALSE(IsOpen(other)) << "assignment closes what the target held";
  EXPECT_EQ(c.get(), raw);
  EXPECT_TRUE(IsOpen(raw));
}

TEST(UniqueFdTest, ResetClosesTheOldFdAndTakesTheNewOne) {
  UniqueFd fd(NewFd());
  const int first = fd.get();
  const int second = NewFd();
  fd.reset(second);
  EXPECT_FALSE(IsOpen(first));
  EXPECT_EQ(fd.get(), second);
  fd.reset();
  EXPECT_FALSE(IsOpen(second));
  EXPECT_FALSE(fd.valid());
}

}  // namespace
}  // namespace kvd
