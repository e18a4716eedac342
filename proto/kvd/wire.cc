#include "kvd/wire.h"

#include <cstdlib>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace kvd::wire {
namespace {

// The variable's value, or `fallback` when it is unset or empty.
std::string EnvOr(const char* name, std::string fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? std::string(value) : std::move(fallback);
}

}  // namespace

std::string DefaultSocket(int device, absl::string_view directory) {
  return absl::StrCat(directory, "/", kSocketPrefix, device, kSocketSuffix);
}

std::string HandlesPathFor(absl::string_view socket) {
  const absl::string_view suffix = kSocketSuffix;
  if (socket.size() > suffix.size() && absl::EndsWith(socket, suffix)) {
    return absl::StrCat(socket.substr(0, socket.size() - suffix.size()), kHandlesSuffix);
  }
  return absl::StrCat(socket, kHandlesSuffix);
}

bool IsSocketName(absl::string_view file_name) { return absl::EndsWith(file_name, kSocketSuffix); }

std::string DefaultSocketDirFromEnvironment() { return EnvOr(kDraIpcDirEnv, std::string(kDefaultSocketDir)); }

std::string SocketFromEnvironment(int device) {
  return EnvOr(kSocketEnv, DefaultSocket(device, DefaultSocketDirFromEnvironment()));
}

std::string SocketDirFromEnvironment() { return EnvOr(kSocketDirEnv, DefaultSocketDirFromEnvironment()); }

}  // namespace kvd::wire
