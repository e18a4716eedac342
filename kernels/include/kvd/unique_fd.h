// UniqueFd: the one owner of a file descriptor. Move-only; closes the FD when destroyed or reset.
// Use it wherever kvd owns an FD (a memfd, an exported chunk, a socket, an eventfd) so that every
// early return closes it; hand the raw FD on with get() (borrowed) or release() (ownership passes).
// Thread-compatible, like a unique_ptr.
#pragma once

#include <unistd.h>

#include <utility>

namespace kvd {

class UniqueFd {
 public:
  UniqueFd() = default;
  // Takes ownership of `fd` (-1: empty).
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  explicit operator bool() const { return valid(); }

  // Gives up ownership: the caller closes the returned FD.
  [[nodiscard]] int release() { return std::exchange(fd_, -1); }

  // Closes the owned FD (if any) and takes `fd`. close()'s result is ignored: Linux releases the FD
  // number even when close reports EINTR or EIO, so there is nothing to retry.
  void reset(int fd = -1) {
    const int old = std::exchange(fd_, fd);
    if (old >= 0) ::close(old);
  }

 private:
  int fd_ = -1;
};

}  // namespace kvd
