// device_peer: the other process of the device conformance suite (device_conformance_test.cc).
//
// Started by the test with posix_spawn (a real exec'd process, so it also works for GPU backends,
// whose drivers do not survive a bare fork) with one end of a SOCK_SEQPACKET socket pair as
// --socket_fd. It opens the same backend (device --index, default 0; a different index than the test's
// makes it a peer device of the owner) and answers one text command per message:
//
//   PEER <owner_uuid>
//       Device::CheckPeerAccess(owner_uuid) of its device.                       -> "PEER_OK <own uuid>"
//   IMPORT <bytes> <verify_bytes> <write_bytes> <parent_seed> <peer_seed>   (with one FD)
//       imports the FD as a chunk of <bytes>, closes the FD at once, reserves and maps the chunk,
//       checks that its first <verify_bytes> bytes hold the pattern <parent_seed>, then writes the
//       pattern <peer_seed> over its first <write_bytes> bytes.                  -> "MAPPED"
//   RELEASE
//       unmaps, releases and frees what IMPORT took.                             -> "RELEASED"
//
// Any failure answers "ERROR <status>". The peer exits 0 when the test closes its end of the socket.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "kvd/device.h"
#include "kvd/fd_passing.h"
#include "kvd/status.h"

namespace kvd {
namespace {

// The byte at offset `i` of pattern `seed`. device_conformance_test.cc computes the same bytes.
uint8_t PatternByte(uint64_t seed, uint64_t i) {
  uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull + seed * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 31;
  return static_cast<uint8_t>(x >> 24);
}

class Peer {
 public:
  explicit Peer(Device* device) : device_(device) {}

  // Closes every FD of `message` that it did not import.
  absl::StatusOr<std::string> Handle(MessageWithFds& message) {
    absl::Cleanup close_fds = [&message] {
      for (int fd : message.fds) {
        if (fd >= 0) close(fd);
      }
    };
    std::vector<absl::string_view> words = absl::StrSplit(message.payload, ' ');
    if (words[0] == "IMPORT") return Import(words, message.fds);
    if (words[0] == "PEER" && words.size() == 2) {
      KVD_RETURN_IF_ERROR(device_->CheckPeerAccess(words[1]));
      KVD_ASSIGN_OR_RETURN(DeviceInfo info, device_->Info());
      return absl::StrCat("PEER_OK ", info.uuid);
    }
    if (words[0] == "RELEASE") {
      KVD_RETURN_IF_ERROR(Release());
      return std::string("RELEASED");
    }
    return absl::InvalidArgumentError(absl::StrCat("unknown command \"", message.payload, "\""));
  }

  absl::Status Release() {
    if (!chunk_) return absl::FailedPreconditionError("RELEASE: nothing imported");
    KVD_RETURN_IF_ERROR(device_->Unmap(va_, chunk_->bytes));
    KVD_RETURN_IF_ERROR(device_->Release(*chunk_));
    KVD_RETURN_IF_ERROR(device_->Free(va_, chunk_->bytes));
    chunk_.reset();
    return absl::OkStatus();
  }

 private:
  absl::StatusOr<std::string> Import(const std::vector<absl::string_view>& words, std::vector<int>& fds) {
    uint64_t bytes, verify, write, parent_seed, peer_seed;
    if (words.size() != 6 || !absl::SimpleAtoi(words[1], &bytes) || !absl::SimpleAtoi(words[2], &verify) ||
        !absl::SimpleAtoi(words[3], &write) || !absl::SimpleAtoi(words[4], &parent_seed) ||
        !absl::SimpleAtoi(words[5], &peer_seed) || verify > bytes || write > bytes) {
      return absl::InvalidArgumentError("IMPORT: expected <bytes> <verify_bytes> <write_bytes> <seed> <seed>");
    }
    if (fds.size() != 1) return absl::InvalidArgumentError(absl::StrCat("IMPORT: ", fds.size(), " FDs, expected 1"));
    if (chunk_) return absl::FailedPreconditionError("IMPORT: a chunk is already imported");
    // The importer closes the FD right after importing it (Note [FD hygiene] in docs/architecture.md).
    absl::StatusOr<Chunk> chunk = device_->Import(fds[0], bytes);
    close(fds[0]);
    fds[0] = -1;
    if (!chunk.ok()) return chunk.status();
    absl::StatusOr<uint64_t> va = device_->Reserve(bytes);
    if (!va.ok()) {
      device_->Release(*chunk).IgnoreError();
      return va.status();
    }
    if (absl::Status mapped = device_->Map(*va, *chunk, Access::kReadWrite); !mapped.ok()) {
      device_->Release(*chunk).IgnoreError();
      device_->Free(*va, bytes).IgnoreError();
      return mapped;
    }
    chunk_ = *chunk;
    va_ = *va;

    std::vector<uint8_t> buffer(std::max(verify, write));
    KVD_RETURN_IF_ERROR(device_->CopyToHost(buffer.data(), va_, verify));
    for (uint64_t i = 0; i < verify; ++i) {
      if (buffer[i] != PatternByte(parent_seed, i)) {
        return absl::DataLossError(
            absl::StrCat("IMPORT: byte ", i, " is ", buffer[i], ", the parent wrote ", PatternByte(parent_seed, i)));
      }
    }
    for (uint64_t i = 0; i < write; ++i) buffer[i] = PatternByte(peer_seed, i);
    KVD_RETURN_IF_ERROR(device_->CopyFromHost(va_, buffer.data(), write));
    return std::string("MAPPED");
  }

  Device* device_;
  std::optional<Chunk> chunk_;
  uint64_t va_ = 0;
};

int Run(int argc, char** argv) {
  DeviceOptions options{.backend = "host"};
  int socket = -1;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (absl::ConsumePrefix(&arg, "--backend=")) {
      options.backend = std::string(arg);
    } else if (absl::ConsumePrefix(&arg, "--index=") && absl::SimpleAtoi(arg, &options.index)) {
    } else if (absl::ConsumePrefix(&arg, "--socket_fd=") && absl::SimpleAtoi(arg, &socket)) {
    } else {
      std::fprintf(stderr, "device_peer: unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  absl::StatusOr<std::unique_ptr<Device>> device = OpenDevice(options);
  std::optional<Peer> peer;
  if (device.ok()) peer.emplace(device->get());
  for (;;) {
    absl::StatusOr<MessageWithFds> message = ReceiveWithFds(socket, 1024);
    if (absl::IsUnavailable(message.status())) return 0;  // the test closed its end
    if (!message.ok()) {
      std::fprintf(stderr, "device_peer: %s\n", message.status().ToString().c_str());
      return 1;
    }
    absl::StatusOr<std::string> reply =
        device.ok() ? peer->Handle(*message) : absl::StatusOr<std::string>(device.status());
    if (!device.ok()) {
      for (int fd : message->fds) close(fd);
    }
    if (absl::Status sent =
            SendWithFds(socket, reply.ok() ? *reply : absl::StrCat("ERROR ", reply.status().ToString()), {});
        !sent.ok()) {
      std::fprintf(stderr, "device_peer: %s\n", sent.ToString().c_str());
      return 1;
    }
  }
}

}  // namespace
}  // namespace kvd

int main(int argc, char** argv) { return kvd::Run(argc, argv); }
