// restart_peer: an engine in its own process, for tests/client/python/restart_test.py. It attaches a pool
// through libkvd and owns the pattern of the layers l with l % 2 == PARITY: it writes them (every byte of
// every committed block) and keeps rewriting them on a thread while kvd restarts; it checks every layer,
// its own and the other peer's (restart_peer.py, the Python package, owns the other parity). The byte k
// of element row (b, h, n) of layer l, counted as i = ((b*H + h)*N + n)*C*e + k, is
// (7*i + 13*l + 29*b) % 251 + 1: never zero, and the same formula as restart_peer.py.
//
// Lines on stdout: "ready <epoch>" once attached and written; "restarted epoch=<E> lost=<N> lost_bytes=<B>
// returned=<R> restarts=<n>" for the command wait_restart; "probe <CODE>" for probe (a DeviceInfo call:
// OK, or UNAVAILABLE while kvd is away); "checked <bytes> bytes, <bad> differ" for check; "lost <status>"
// whenever on_lost runs. Commands on stdin, one a line: wait_restart, probe, check, quit.
//
// Usage: restart_peer SOCKET POOL PARITY
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvd/client.h"

namespace {

void Say(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

uint8_t PatternByte(uint64_t l, uint64_t b, uint64_t i) {
  return static_cast<uint8_t>((7 * i + 13 * l + 29 * b) % 251 + 1);
}

// Writes (or checks, counting the bytes that differ) layer l's committed blocks.
uint64_t Pass(const kvd::Mapping& m, uint64_t l, uint64_t blocks, bool write) {
  const kvd::LayerView v = m.layer(l);
  const kvd::PoolDims& d = v.dims;
  const uint64_t row = d.channels * d.element_bytes;  // C*e contiguous bytes (stride_c == e)
  uint64_t bad = 0;
  for (uint64_t b = 0; b < blocks; ++b) {
    for (uint64_t h = 0; h < d.heads; ++h) {
      for (uint64_t n = 0; n < d.block_tokens; ++n) {
        uint8_t* p = static_cast<uint8_t*>(v.data) + b * v.stride_b + h * v.stride_h + n * v.stride_n;
        const uint64_t first = ((b * d.heads + h) * d.block_tokens + n) * row;
        for (uint64_t k = 0; k < row; ++k) {
          const uint8_t want = PatternByte(l, b, first + k);
          if (write) {
            p[k] = want;
          } else if (p[k] != want) {
            ++bad;
          }
        }
      }
    }
  }
  return bad;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: restart_peer SOCKET POOL PARITY\n");
    return 2;
  }
  const std::string socket = argv[1], pool = argv[2];
  const uint64_t parity = std::stoul(argv[3]);
  absl::StatusOr<std::unique_ptr<kvd::Client>> client =
      kvd::Client::Connect({.socket = socket, .client_name = "restart-peer", .timeout = absl::Seconds(5)});
  if (!client.ok()) {
    Say(absl::StrCat("error ", client.status().ToString()));
    return 1;
  }
  absl::Mutex mu;
  int restarts = 0;
  kvd::DaemonRestart last;
  kvd::AttachOptions options;
  options.on_restart = [&](const kvd::DaemonRestart& r) {
    absl::MutexLock lock(&mu);
    ++restarts;
    last = r;
  };
  options.on_lost = [](const absl::Status& why) { Say(absl::StrCat("lost ", why.ToString())); };
  absl::StatusOr<std::unique_ptr<kvd::Mapping>> mapping = (*client)->Attach(pool, options);
  if (!mapping.ok()) {
    Say(absl::StrCat("error ", mapping.status().ToString()));
    return 1;
  }
  const kvd::Mapping& m = **mapping;
  const uint64_t layers = m.geometry().dims.layers;
  const uint64_t blocks = m.committed_blocks();
  for (uint64_t l = parity; l < layers; l += 2) Pass(m, l, blocks, /*write=*/true);
  Say(absl::StrCat("ready ", m.epoch()));

  // The engine keeps using its cache while kvd is away: rewrite the own layers until told to check.
  std::atomic<bool> writing = true;
  std::thread writer([&] {
    while (writing.load()) {
      for (uint64_t l = parity; l < layers && writing.load(); l += 2) Pass(m, l, blocks, /*write=*/true);
    }
  });

  std::string command;
  while (std::getline(std::cin, command)) {
    if (command == "wait_restart") {
      absl::MutexLock lock(&mu);
      mu.AwaitWithTimeout(absl::Condition(
                              +[](int* n) { return *n > 0; }, &restarts),
                          absl::Seconds(60));
      Say(absl::StrCat("restarted epoch=", last.epoch, " lost=", last.lost_chunk_ids.size(), " lost_bytes=",
                       last.lost_bytes, " returned=", last.returned_chunk_ids.size(), " restarts=", restarts));
    } else if (command == "probe") {
      absl::StatusOr<kvd::DeviceStatus> info = (*client)->DeviceInfo();
      Say(absl::StrCat("probe ", absl::StatusCodeToString(info.status().code())));
    } else if (command == "check") {
      writing = false;
      writer.join();
      uint64_t bad = 0, bytes = 0;
      for (uint64_t l = 0; l < layers; ++l) bad += Pass(m, l, blocks, /*write=*/false);
      const kvd::PoolDims& d = m.geometry().dims;
      bytes = layers * blocks * d.heads * d.block_tokens * d.channels * d.element_bytes;
      Say(absl::StrCat("checked ", bytes, " bytes, ", bad, " differ"));
    } else if (command == "quit") {
      break;
    }
  }
  if (writer.joinable()) {
    writing = false;
    writer.join();
  }
  return 0;
}
