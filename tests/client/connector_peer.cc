// connector_peer: a KV connector in its own process, for tests/client/connectors_test.cc. It attaches a
// pool through libkvd, exports every committed range (ExportRanges), maps each range FD at its fd_offset
// (host memfds) as a stand-in for an RDMA registration, and prints one line per fact on stdout:
//   handle <segment> <offset> <bytes> <fd_offset> <fnv64 of the bytes>     one per exported handle
//   exported <n> in <ms> ms                                                after each export (the time of
//                                                                          ExportRanges and the fetch)
//   added <segment> <offset> <bytes>       from on_ranges_added (new bytes after a grow)
//   released <segment> <offset> <bytes>    from on_ranges_released, before the follower acknowledges;
//                                          every registration overlapping it is unmapped and closed first
//   deregistered <n>                       after a release: registrations dropped
// Commands on stdin, one per line: "export-added" (export the ranges of the last added event), "quit".
//
// With --fdinfo (GPU pools, whose DMA-BUFs cannot be mapped on the CPU) each FD is kept open, not mapped,
// and described by its /proc/self/fdinfo instead of a checksum:
//   dmabuf <segment> <offset> <bytes> <fd_offset> <fdinfo size> <fdinfo exp_name>
//
// Usage: connector_peer [--fdinfo] SOCKET POOL
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "kvd/client.h"

namespace {

uint64_t Fnv64(const unsigned char* p, uint64_t n) {
  uint64_t h = 1469598103934665603ull;
  for (uint64_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

struct Registration {
  uint64_t offset = 0;
  uint64_t bytes = 0;
  void* map = nullptr;
  uint64_t map_bytes = 0;
  int fd = -1;
};

bool fdinfo_mode = false;
absl::Mutex mu;
std::vector<Registration> registrations ABSL_GUARDED_BY(mu);
std::vector<kvd::ByteRange> last_added ABSL_GUARDED_BY(mu);

void Say(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

// "<key>:\t<value>" of /proc/self/fdinfo/<fd>; "-" when missing.
std::string FdInfo(int fd, const std::string& key) {
  std::ifstream in("/proc/self/fdinfo/" + std::to_string(fd));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + ":", 0) == 0) {
      std::string v = line.substr(key.size() + 1);
      v.erase(0, v.find_first_not_of(" \t"));
      return v;
    }
  }
  return "-";
}

int Export(kvd::Client& client, const kvd::Mapping& mapping, const std::vector<kvd::ByteRange>& ranges) {
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<kvd::RangeExport> exported = client.ExportRanges(mapping, ranges);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  if (!exported.ok()) {
    Say("error " + exported.status().ToString());
    return 1;
  }
  for (const kvd::RangeHandle& h : exported->handles) {
    if (fdinfo_mode) {
      Say("dmabuf " + std::to_string(h.segment) + " " + std::to_string(h.offset) + " " + std::to_string(h.bytes) + " " +
          std::to_string(h.fd_offset) + " " + FdInfo(h.fd, "size") + " " + FdInfo(h.fd, "exp_name"));
      absl::MutexLock lock(&mu);
      registrations.push_back({h.offset, h.bytes, nullptr, 0, h.fd});
      continue;
    }
    // Map the FD over its stated range: what an RDMA registration of (fd, fd_offset, bytes) would pin.
    void* p = mmap(nullptr, h.bytes, PROT_READ, MAP_SHARED, h.fd, static_cast<off_t>(h.fd_offset));
    if (p == MAP_FAILED) {
      Say("error mmap of a range FD failed");
      close(h.fd);
      return 1;
    }
    Say("handle " + std::to_string(h.segment) + " " + std::to_string(h.offset) + " " + std::to_string(h.bytes) + " " +
        std::to_string(h.fd_offset) + " " + std::to_string(Fnv64(static_cast<unsigned char*>(p), h.bytes)));
    absl::MutexLock lock(&mu);
    registrations.push_back({h.offset, h.bytes, p, h.bytes, h.fd});
  }
  Say("exported " + std::to_string(exported->handles.size()) + " in " + std::to_string(ms) + " ms");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 4 && std::string(argv[1]) == "--fdinfo") {
    fdinfo_mode = true;
    ++argv;
    --argc;
  }
  if (argc != 3) {
    std::fprintf(stderr, "usage: connector_peer [--fdinfo] SOCKET POOL\n");
    return 2;
  }
  absl::StatusOr<std::unique_ptr<kvd::Client>> client =
      kvd::Client::Connect({.socket = argv[1], .client_name = "connector-peer"});
  if (!client.ok()) {
    Say("error " + client.status().ToString());
    return 1;
  }
  kvd::AttachOptions options;
  options.client_name = "connector-peer";
  options.on_ranges_added = [](const std::vector<kvd::ByteRange>& ranges) {
    absl::MutexLock lock(&mu);
    last_added = ranges;
    for (const kvd::ByteRange& r : ranges) {
      Say("added " + std::to_string(r.segment) + " " + std::to_string(r.offset) + " " + std::to_string(r.bytes));
    }
  };
  // Pausable: the engine's shrinks and sleeps pause it first (docs/api.md, "Releases and running engines").
  // A connector's pause is its deregistration: on_ranges_released runs just before on_pause.
  options.on_pause = [](const std::vector<kvd::ByteRange>&) {};
  options.on_ranges_released = [](const std::vector<kvd::ByteRange>& ranges) {
    absl::MutexLock lock(&mu);
    for (const kvd::ByteRange& r : ranges) {
      Say("released " + std::to_string(r.segment) + " " + std::to_string(r.offset) + " " + std::to_string(r.bytes));
    }
    int dropped = 0;
    std::vector<Registration> kept;
    for (Registration& reg : registrations) {
      bool overlaps = false;
      for (const kvd::ByteRange& r : ranges) {
        overlaps |= reg.offset < r.offset + r.bytes && r.offset < reg.offset + reg.bytes;
      }
      if (overlaps) {
        if (reg.map != nullptr) munmap(reg.map, reg.map_bytes);
        close(reg.fd);
        ++dropped;
      } else {
        kept.push_back(reg);
      }
    }
    registrations.swap(kept);
    Say("deregistered " + std::to_string(dropped));
  };
  absl::StatusOr<std::unique_ptr<kvd::Mapping>> mapping = (*client)->Attach(argv[2], options);
  if (!mapping.ok()) {
    Say("error " + mapping.status().ToString());
    return 1;
  }
  if (Export(**client, **mapping, {}) != 0) return 1;
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line == "quit") break;
    if (line == "export-added") {
      std::vector<kvd::ByteRange> ranges;
      {
        absl::MutexLock lock(&mu);
        ranges = last_added;
      }
      if (Export(**client, **mapping, ranges) != 0) return 1;
    }
  }
  absl::MutexLock lock(&mu);
  for (Registration& reg : registrations) {
    if (reg.map != nullptr) munmap(reg.map, reg.map_bytes);
    close(reg.fd);
  }
  return 0;
}
