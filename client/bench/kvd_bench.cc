// kvd_bench: the whole path an engine sees, against the bare calls, in one run (docs/benchmarks.md).
//
// It starts a kvd (or connects to one with --socket) and a second process (this program re-executed
// with --child-fd, talking over a SOCK_SEQPACKET pair), and measures, interleaved A/B with everything
// released between repetitions:
//   kvd   libkvd against the daemon: Grow, a second process's Attach, Sleep, Wake, Shrink;
//   raw   the same chunk plan (the daemon's own chunk table) through kvd::Device in a bare pair of
//         processes: create + map + export here, FDs over SCM_RIGHTS, import + map + read there;
//   in-process  the peers an engine would use instead (torch_memory_saver): one allocation of all the
//         bytes, and one per segment, created, mapped and released in this process, nothing shared.
// Each lifecycle op runs "after_release" (right after the previous release: the driver may still be
// scrubbing) and "after_pause" (--pause-ms first). Then the fragmented shape, Compact of a pool grown in
// many steps and an exact Shrink to half (each with a pausable second process checking a pattern, against
// the bare calls of the same reshape: create, Device::CopyRange, release, remap), control-RPC latency
// (idle, during another pool's grow, next to a bare gRPC ping served by the second process), resizes
// of several pools at once against one pool at a time, the daemon's bookkeeping per chunk and per pool,
// and the alternatives: one handle per granule and (CUDA, when importable) torch.zeros.
// --chunk-sweep instead times the device calls alone (create, map, export, import, map, release) against
// the chunk size, with no kvd. A table goes to stdout; with --json one JSON document goes to stdout and
// the table to stderr.
// A line that cannot run says why ("skipped"); no number is ever made up.
#include <dirent.h>
#include <fcntl.h>
#include <linux/kcmp.h>
#include <malloc.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/base/thread_annotations.h"
#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "client/handle_client.h"
#include "client/phase_marks.h"
#include "grpcpp/grpcpp.h"
#include "kvd/client.h"
#include "kvd/device.h"
#include "kvd/fd_passing.h"
#include "kvd/status.h"
#include "kvd/unique_fd.h"
#include "kvd/units.h"
#include "kvd/v1/kvd.grpc.pb.h"
#include "kvd/wire.h"
#ifdef KVD_WITH_CUDA
#include "cuda/cuda_driver.h"
#endif

extern char** environ;

namespace kvd {
namespace {

using Clock = std::chrono::steady_clock;

// steady_clock is CLOCK_MONOTONIC: one time line for both processes.
int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}
double MsSince(int64_t start_ns) { return (NowNs() - start_ns) / 1e6; }

// Nearest rank: with 5 samples p99 is the largest.
double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const size_t rank = static_cast<size_t>(std::ceil(q * v.size()));
  return v[std::min(v.size(), std::max<size_t>(rank, 1)) - 1];
}
double P50(const std::vector<double>& v) { return Percentile(v, 0.5); }
double P99(const std::vector<double>& v) { return Percentile(v, 0.99); }

constexpr size_t kMaxMessage = 64 * 1024;

// 8 KV heads x 16 tokens x 128 channels x bf16: 32 KiB a layer and block; one segment per layer.
constexpr PoolDims kDims{
    .layers = 0, .capacity_blocks = 0, .heads = 8, .block_tokens = 16, .channels = 128, .element_bytes = 2};
constexpr uint64_t kLayerBlockBytes = 8 * 16 * 128 * 2;

// ---------------------------------------------------------------------------------------------------
// "Accessible": reading one word of device memory at an address this process mapped.

class Reader {
 public:
  static absl::StatusOr<std::unique_ptr<Reader>> Open(const std::string& backend, int device) {
    auto r = std::unique_ptr<Reader>(new Reader());
    if (backend == "host") return r;
#ifdef KVD_WITH_CUDA
    if (backend == "cuda") {
      KVD_ASSIGN_OR_RETURN(r->cuda_, LoadCudaDriver());
      const CudaDriver& d = *r->cuda_;
      CUdevice dev = 0;
      CUcontext ctx = nullptr;
      KVD_RETURN_IF_ERROR(CudaStatus(d, d.cuInit_(0), "cuInit"));
      KVD_RETURN_IF_ERROR(CudaStatus(d, d.cuDeviceGet_(&dev, device), "cuDeviceGet"));
      KVD_RETURN_IF_ERROR(CudaStatus(d, d.cuDevicePrimaryCtxRetain_(&ctx, dev), "cuDevicePrimaryCtxRetain"));
      KVD_RETURN_IF_ERROR(CudaStatus(d, d.cuCtxSetCurrent_(ctx), "cuCtxSetCurrent"));
      return r;
    }
#endif
    (void)device;
    return absl::UnimplementedError(absl::StrCat("kvd_bench: no reader for backend ", backend));
  }
  // On the thread that opened it.
  absl::Status ReadWord(uint64_t va, uint64_t* out) { return Read(va, out, sizeof(*out)); }
  absl::Status Read(uint64_t va, void* out, uint64_t bytes) {
#ifdef KVD_WITH_CUDA
    if (cuda_ != nullptr) return CudaStatus(*cuda_, cuda_->cuMemcpyDtoH_(out, va, bytes), "cuMemcpyDtoH");
#endif
    std::memcpy(out, reinterpret_cast<const void*>(va), bytes);
    return absl::OkStatus();
  }
  absl::Status Write(uint64_t va, const void* in, uint64_t bytes) {
#ifdef KVD_WITH_CUDA
    if (cuda_ != nullptr) return CudaStatus(*cuda_, cuda_->cuMemcpyHtoD_(va, in, bytes), "cuMemcpyHtoD");
#endif
    std::memcpy(reinterpret_cast<void*>(va), in, bytes);
    return absl::OkStatus();
  }

 private:
  Reader() = default;
#ifdef KVD_WITH_CUDA
  const CudaDriver* cuda_ = nullptr;
#endif
};

// ---------------------------------------------------------------------------------------------------
// The second process. One request at a time: a line of words, FDs with "chunks" messages; the reply
// is "ok [done_ns]" or "error <status>".

// The bare server: answers GetPool with the name asked (the control_rpc idle baseline) or, given a reply,
// with that reply (the informative bare_kvd_reply line: a bare server sending kvd's bytes).
class PingService final : public kvd::v1::Kvd::Service {
 public:
  explicit PingService(std::optional<kvd::v1::Pool> reply = std::nullopt) : reply_(std::move(reply)) {}

  grpc::Status GetPool(grpc::ServerContext*, const kvd::v1::GetPoolRequest* request, kvd::v1::Pool* reply) override {
    if (reply_.has_value()) {
      *reply = *reply_;
    } else {
      reply->set_name(request->name());
    }
    return grpc::Status::OK;
  }

 private:
  const std::optional<kvd::v1::Pool> reply_;
};

// The same answers from a server with GetPool on gRPC's callback API, answered inline, beside synchronous methods,
// with gRPC's health service on: kvd's shape until it left the callback API (Note [No callback API] in
// docs/architecture.md), kept to measure what that API costs.
class MixedPingService final : public kvd::v1::Kvd::WithCallbackMethod_GetPool<kvd::v1::Kvd::Service> {
 public:
  explicit MixedPingService(kvd::v1::Pool reply) : reply_(std::move(reply)) {}

  grpc::ServerUnaryReactor* GetPool(grpc::CallbackServerContext* context, const kvd::v1::GetPoolRequest*,
                                    kvd::v1::Pool* reply) override {
    *reply = reply_;
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

 private:
  const kvd::v1::Pool reply_;
};

// libkvd's phase marks (client/phase_marks.h) in the second process, in the order they were passed.
absl::Mutex g_marks_mu;
std::vector<std::pair<const char*, int64_t>>& Marks() ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_marks_mu) {
  static auto* marks = new std::vector<std::pair<const char*, int64_t>>();
  return *marks;
}
void RecordMark(const char* phase) {
  const int64_t now = NowNs();
  absl::MutexLock lock(&g_marks_mu);
  Marks().emplace_back(phase, now);
}
// "name=NS ..." of every mark since the last call (the latest time of each name), and forgets them.
std::string TakeMarks() {
  absl::MutexLock lock(&g_marks_mu);
  std::map<std::string, int64_t> latest;
  for (const auto& [phase, ns] : Marks()) latest[phase] = ns;
  Marks().clear();
  std::string out;
  for (const auto& [phase, ns] : latest) absl::StrAppend(&out, " ", phase, "=", ns);
  return out;
}

// ---------------------------------------------------------------------------------------------------
// Patterns: bytes a client writes through its Mapping before a reshape (Compact, a Shrink that replaces
// chunks) and reads back after it, at samples of 4 KiB: the first, middle and last 4 KiB of every chunk
// (the seams a reshape copies across) and, at every sixteenth of each segment's committed blocks, the
// last 4 KiB of the block before it and the first and last 4 KiB of the block there (around a shrink's
// target).

constexpr uint64_t kSampleBytes = 4096;

struct PatternSample {
  uint64_t offset = 0;          // from the pool's base
  uint64_t end_in_segment = 0;  // where the sample ends, from its segment's start
};

// The word at pool offset `offset` (a multiple of 8) of pattern `seed`.
uint64_t PatternWord(uint64_t seed, uint64_t offset) {
  uint64_t x = (offset + 1) * 0x9E3779B97F4A7C15ull ^ (seed + 1) * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 31;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 29);
}

std::vector<uint64_t> PatternBytes(uint64_t seed, uint64_t offset) {
  std::vector<uint64_t> words(kSampleBytes / 8);
  for (size_t i = 0; i < words.size(); ++i) words[i] = PatternWord(seed, offset + 8 * i);
  return words;
}

// Whether [offset, offset + bytes) lies inside one of `chunks`.
bool InsideAChunk(const std::vector<ChunkInfo>& chunks, uint64_t offset, uint64_t bytes) {
  for (const ChunkInfo& c : chunks) {
    if (offset >= c.offset && offset + bytes <= c.offset + c.bytes) return true;
  }
  return false;
}

std::vector<PatternSample> PatternSamples(const Mapping& m) {
  const std::vector<ChunkInfo> chunks = m.chunks();
  std::map<uint64_t, uint64_t> segment_start;  // segment -> its lowest chunk offset
  for (const ChunkInfo& c : chunks) {
    auto [it, inserted] = segment_start.try_emplace(c.segment, c.offset);
    if (!inserted) it->second = std::min(it->second, c.offset);
  }
  const uint64_t committed = m.committed_blocks(), stride = m.geometry().stride_b;
  std::map<uint64_t, uint64_t> samples;  // offset -> segment
  for (const ChunkInfo& c : chunks) {
    if (c.bytes < kSampleBytes) continue;
    for (uint64_t at :
         {c.offset, c.offset + c.bytes / 2 / kSampleBytes * kSampleBytes, c.offset + c.bytes - kSampleBytes}) {
      samples.emplace(at, c.segment);
    }
  }
  if (stride >= kSampleBytes && stride % 8 == 0) {
    for (const auto& [segment, start] : segment_start) {
      for (uint64_t k = 0; k < 16 && committed > 0; ++k) {
        const uint64_t b = committed * k / 16;
        if (b > 0) samples.emplace(start + b * stride - kSampleBytes, segment);  // the end of block b - 1
        samples.emplace(start + b * stride, segment);
        samples.emplace(start + (b + 1) * stride - kSampleBytes, segment);
      }
      if (committed > 0) samples.emplace(start + committed * stride - kSampleBytes, segment);
    }
  }
  std::vector<PatternSample> out;
  for (const auto& [offset, segment] : samples) {
    if (!InsideAChunk(chunks, offset, kSampleBytes)) continue;
    out.push_back({.offset = offset, .end_in_segment = offset + kSampleBytes - segment_start[segment]});
  }
  return out;
}

struct ChildState {
  std::string backend;
  int device = 0;
  uint64_t granularity = 0;
  std::unique_ptr<Reader> reader;
  std::map<std::string, std::unique_ptr<Client>> clients;  // by socket
  std::unique_ptr<Mapping> mapping;
  std::atomic<int> pauses{0};  // on_pause calls of the pausable Mapping
  uint64_t pattern_seed = 0;
  std::vector<PatternSample> samples;  // written by kvd-pattern-write
  std::unique_ptr<Device> raw;         // the bare importer
  uint64_t raw_va = 0, raw_bytes = 0;
  std::vector<std::pair<uint64_t, Chunk>> raw_chunks;  // offset, imported chunk (mapped)
  std::vector<std::unique_ptr<grpc::Service>> pings;
  std::vector<std::unique_ptr<grpc::Server>> ping_servers;
};

// Unmaps and releases every imported chunk, one after the other; `ns` (if given) gets the time spent in
// each kind of call.
absl::Status RawRelease(ChildState& c, int64_t* unmap_ns = nullptr, int64_t* release_ns = nullptr) {
  int64_t unmapping = 0, releasing = 0;
  for (const auto& [offset, chunk] : c.raw_chunks) {
    const int64_t t = NowNs();
    KVD_RETURN_IF_ERROR(c.raw->Unmap(c.raw_va + offset, chunk.bytes));
    const int64_t unmapped = NowNs();
    KVD_RETURN_IF_ERROR(c.raw->Release(chunk));
    unmapping += unmapped - t;
    releasing += NowNs() - unmapped;
  }
  c.raw_chunks.clear();
  if (unmap_ns != nullptr) *unmap_ns = unmapping;
  if (release_ns != nullptr) *release_ns = releasing;
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> RssAnonBytes(pid_t pid);

// raw-book RESERVE N, then "chunks off:bytes..." messages of N chunks in all: in a process that has done nothing
// else (a fresh second process), the device layer alone creates, maps and exports them in four equal parts.
// "ok RSS0 RSS1 RSS2 RSS3 RSS4": the process's RssAnon before and after each part. The lists the plan and the
// handles are kept in are sized before the first sample: what is measured is the device layer's (and the
// driver's), as the daemon's bookkeeping line subtracts it.
absl::StatusOr<std::string> RawBookkeeping(ChildState& c, int socket, uint64_t reserve, uint64_t n) {
  std::vector<std::pair<uint64_t, uint64_t>> plan;  // offset, bytes
  plan.reserve(n);
  while (plan.size() < n) {
    KVD_ASSIGN_OR_RETURN(MessageWithFds m, ReceiveWithFds(socket, kMaxMessage));
    for (int fd : m.fds) close(fd);
    std::vector<std::string> parts = absl::StrSplit(m.payload, ' ', absl::SkipEmpty());
    if (parts.empty() || parts[0] != "chunks") return absl::InvalidArgumentError("raw-book: expected chunks");
    for (size_t i = 1; i < parts.size(); ++i) {
      std::pair<std::string, std::string> kv = absl::StrSplit(parts[i], ':');
      uint64_t off = 0, bytes = 0;
      if (!absl::SimpleAtoi(kv.first, &off) || !absl::SimpleAtoi(kv.second, &bytes)) {
        return absl::InvalidArgumentError(absl::StrCat("raw-book: bad chunk ", parts[i]));
      }
      plan.emplace_back(off, bytes);
    }
  }
  if (plan.size() != n || n % 4 != 0) return absl::InvalidArgumentError("raw-book: N chunks, a multiple of 4");
  DeviceOptions o{.backend = c.backend, .index = c.device, .host_granularity = c.granularity};
  KVD_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, OpenDevice(o));
  KVD_ASSIGN_OR_RETURN(const uint64_t va, device->Reserve(reserve));
  std::vector<Chunk> chunks;
  std::vector<UniqueFd> fds;
  chunks.reserve(n);
  fds.reserve(n);
  // Even a fresh process has free heap (what its start allocated and freed), resident, that the device layer's
  // first allocations would fill unseen: given back first, so that they show as the pages they take.
  malloc_trim(0);
  absl::Cleanup release = [&] {
    fds.clear();
    for (size_t i = 0; i < chunks.size(); ++i) {
      device->Unmap(va + plan[i].first, plan[i].second).IgnoreError();
      device->Release(chunks[i]).IgnoreError();
    }
    device->Free(va, reserve).IgnoreError();
  };
  std::string reply = "ok";
  for (size_t q = 0; q <= 4; ++q) {
    if (q > 0) {
      for (size_t i = (q - 1) * n / 4; i < q * n / 4; ++i) {
        KVD_ASSIGN_OR_RETURN(Chunk chunk, device->Create(plan[i].second));
        if (absl::Status s = device->Map(va + plan[i].first, chunk, Access::kReadWrite); !s.ok()) {
          device->Release(chunk).IgnoreError();
          return s;
        }
        chunks.push_back(chunk);
        KVD_ASSIGN_OR_RETURN(int fd, device->Export(chunk));
        fds.emplace_back(fd);
      }
    }
    KVD_ASSIGN_OR_RETURN(const uint64_t rss, RssAnonBytes(getpid()));
    absl::StrAppend(&reply, " ", rss);
  }
  return reply;
}

absl::StatusOr<std::string> ChildRequest(ChildState& c, int socket, const std::vector<std::string>& w) {
  if (c.reader == nullptr) {
    KVD_ASSIGN_OR_RETURN(c.reader, Reader::Open(c.backend, c.device));
  }
  const std::string& op = w[0];
  // kvd-attach SOCKET POOL EXPECTED_BYTES [pausable]
  if (op == "kvd-attach" && (w.size() == 4 || (w.size() == 5 && w[4] == "pausable"))) {
    uint64_t expected = 0;
    if (!absl::SimpleAtoi(w[3], &expected)) return absl::InvalidArgumentError("bad bytes");
    std::unique_ptr<Client>& client = c.clients[w[1]];
    if (client == nullptr) {
      KVD_ASSIGN_OR_RETURN(client, Client::Connect({.socket = w[1], .client_name = "kvd-bench-importer"}));
    }
    // Always pausable: the bench's shrinks and sleeps come from another session, which pauses it first
    // (docs/api.md, "Releases and running engines"); an engine would synchronise its streams here, this
    // process touches the pool only between requests. `pausable` is kept for the compaction lines' words.
    AttachOptions options;
    options.on_pause = [&c](const std::vector<ByteRange>&) { ++c.pauses; };
    options.on_resume = [](bool) {};
    c.mapping.reset();
    c.pauses = 0;
    TakeMarks();
    const int64_t received = NowNs();
    KVD_ASSIGN_OR_RETURN(c.mapping, client->Attach(w[2], std::move(options)));
    const int64_t attached = NowNs();
    uint64_t seen = 0, word = 0;
    const uint64_t base = reinterpret_cast<uint64_t>(c.mapping->base());
    for (const ChunkInfo& chunk : c.mapping->chunks()) {
      KVD_RETURN_IF_ERROR(c.reader->ReadWord(base + chunk.offset, &word));
      seen += chunk.bytes;
    }
    const int64_t done = NowNs();
    if (seen != expected) return absl::InternalError(absl::StrCat("mapped ", seen, " bytes, expected ", expected));
    // "ok DONE received=NS attached=NS read=NS" and libkvd's marks (attach.*, lease.fetched).
    return absl::StrCat("ok ", done, " received=", received, " attached=", attached, " read=", done, TakeMarks());
  }
  // kvd-wait BYTES: once the follower has mapped exactly BYTES, "ok DONE" (when it was seen, looked at
  // every 0.1 ms).
  if (op == "kvd-wait" && w.size() == 2) {
    uint64_t expected = 0;
    if (!absl::SimpleAtoi(w[1], &expected) || c.mapping == nullptr) return absl::InvalidArgumentError("kvd-wait");
    const int64_t start = NowNs();
    while (NowNs() - start < int64_t{60'000'000'000}) {
      uint64_t seen = 0;
      for (const ChunkInfo& chunk : c.mapping->chunks()) seen += chunk.bytes;
      if (seen == expected) return absl::StrCat("ok ", NowNs());
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    return absl::DeadlineExceededError("the importer's follower did not map the pool within 60 s");
  }
  if (op == "kvd-pattern-write" && w.size() == 2) {  // kvd-pattern-write SEED: "ok SAMPLES"
    if (!absl::SimpleAtoi(w[1], &c.pattern_seed) || c.mapping == nullptr) {
      return absl::InvalidArgumentError("kvd-pattern-write");
    }
    c.samples = PatternSamples(*c.mapping);
    const uint64_t base = reinterpret_cast<uint64_t>(c.mapping->base());
    for (const PatternSample& sample : c.samples) {
      const std::vector<uint64_t> words = PatternBytes(c.pattern_seed, sample.offset);
      KVD_RETURN_IF_ERROR(c.reader->Write(base + sample.offset, words.data(), kSampleBytes));
    }
    return absl::StrCat("ok ", c.samples.size());
  }
  // kvd-pattern-check KEPT_BYTES CHUNKS: once the Mapping maps CHUNKS chunks (0: any), every sample written
  // that ends within the first KEPT_BYTES of its segment is mapped and reads back as written.
  // "ok CHECKED pauses=N": N is how often on_pause ran since the attach.
  if (op == "kvd-pattern-check" && w.size() == 3) {
    uint64_t kept = 0, chunks = 0;
    if (!absl::SimpleAtoi(w[1], &kept) || !absl::SimpleAtoi(w[2], &chunks) || c.mapping == nullptr) {
      return absl::InvalidArgumentError("kvd-pattern-check");
    }
    std::vector<ChunkInfo> mapped = c.mapping->chunks();
    for (int i = 0; i < 60000 && chunks != 0 && mapped.size() != chunks; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      mapped = c.mapping->chunks();
    }
    if (chunks != 0 && mapped.size() != chunks) {
      return absl::DeadlineExceededError(
          absl::StrCat("the Mapping maps ", mapped.size(), " chunks 60 s after the change, not ", chunks));
    }
    const uint64_t base = reinterpret_cast<uint64_t>(c.mapping->base());
    uint64_t checked = 0;
    std::vector<uint64_t> got(kSampleBytes / 8);
    for (const PatternSample& sample : c.samples) {
      if (sample.end_in_segment > kept) continue;
      if (!InsideAChunk(mapped, sample.offset, kSampleBytes)) {
        return absl::InternalError(absl::StrCat("pattern: pool offset ", sample.offset, " is no longer mapped"));
      }
      KVD_RETURN_IF_ERROR(c.reader->Read(base + sample.offset, got.data(), kSampleBytes));
      if (got != PatternBytes(c.pattern_seed, sample.offset)) {
        return absl::DataLossError(absl::StrCat("pattern: the 4 KiB at pool offset ", sample.offset,
                                                " do not read back as written before the change"));
      }
      ++checked;
    }
    return absl::StrCat("ok ", checked, " pauses=", c.pauses.load());
  }
  if (op == "kvd-marks") return absl::StrCat("ok", TakeMarks());
  if (op == "kvd-detach") {
    c.mapping.reset();
    return std::string("ok");
  }
  if (op == "raw-attach" && w.size() == 3) {  // raw-attach RESERVE_BYTES N, then "chunks off:bytes..." + FDs
    uint64_t reserve = 0, n = 0;
    if (!absl::SimpleAtoi(w[1], &reserve) || !absl::SimpleAtoi(w[2], &n)) return absl::InvalidArgumentError("bad");
    if (c.raw == nullptr) {
      DeviceOptions o{.backend = c.backend, .index = c.device, .host_granularity = c.granularity};
      KVD_ASSIGN_OR_RETURN(c.raw, OpenDevice(o));
    }
    const int64_t received = NowNs();
    if (c.raw_va == 0) {
      KVD_ASSIGN_OR_RETURN(c.raw_va, c.raw->Reserve(reserve));
      c.raw_bytes = reserve;
    }
    const int64_t reserved = NowNs();
    // Each message's FDs are imported (and closed) before the next is received: at most
    // kMaxFdsPerMessage FDs are open here at once, whatever the number of chunks.
    int64_t receive_ns = 0, import_map_ns = 0, import_ns = 0, map_ns = 0;
    uint64_t imported = 0;
    while (imported < n) {
      int64_t t = NowNs();
      KVD_ASSIGN_OR_RETURN(MessageWithFds m, ReceiveWithFds(socket, kMaxMessage));
      receive_ns += NowNs() - t;
      t = NowNs();
      std::vector<int>& fds = m.fds;
      absl::Cleanup close_fds = [&] {
        for (int fd : fds) {
          if (fd >= 0) close(fd);
        }
      };
      std::vector<std::string> parts = absl::StrSplit(m.payload, ' ', absl::SkipEmpty());
      if (parts.size() != fds.size() + 1) return absl::InvalidArgumentError("plan and FDs differ");
      for (size_t i = 0; i < fds.size(); ++i) {
        std::pair<std::string, std::string> kv = absl::StrSplit(parts[i + 1], ':');
        uint64_t off = 0, bytes = 0;
        if (!absl::SimpleAtoi(kv.first, &off) || !absl::SimpleAtoi(kv.second, &bytes)) {
          return absl::InvalidArgumentError(absl::StrCat("bad chunk ", parts[i + 1]));
        }
        const int64_t start = NowNs();
        KVD_ASSIGN_OR_RETURN(Chunk chunk, c.raw->Import(fds[i], bytes));
        close(fds[i]);
        fds[i] = -1;
        const int64_t got = NowNs();
        if (absl::Status s = c.raw->Map(c.raw_va + off, chunk, Access::kReadWrite); !s.ok()) {
          c.raw->Release(chunk).IgnoreError();
          return s;
        }
        import_ns += got - start;
        map_ns += NowNs() - got;
        c.raw_chunks.emplace_back(off, chunk);
      }
      imported += fds.size();
      import_map_ns += NowNs() - t;
    }
    const int64_t mapped = NowNs();
    uint64_t word = 0;
    for (const auto& [offset, chunk] : c.raw_chunks) KVD_RETURN_IF_ERROR(c.reader->ReadWord(c.raw_va + offset, &word));
    const int64_t done = NowNs();
    return absl::StrCat("ok ", done, " received=", received, " reserve_ms=", (reserved - received) / 1e6,
                        " fd_receive_ms=", receive_ns / 1e6, " import_map_ms=", import_map_ns / 1e6,
                        " import_ms=", import_ns / 1e6, " map_ms=", map_ns / 1e6, " read_ms=", (done - mapped) / 1e6);
  }
  if (op == "raw-book" && w.size() == 3) {
    uint64_t reserve = 0, n = 0;
    if (!absl::SimpleAtoi(w[1], &reserve) || !absl::SimpleAtoi(w[2], &n)) return absl::InvalidArgumentError("bad");
    return RawBookkeeping(c, socket, reserve, n);
  }
  if (op == "raw-release") {  // "ok DONE unmap_ms=MS release_ms=MS"
    int64_t unmap_ns = 0, release_ns = 0;
    KVD_RETURN_IF_ERROR(RawRelease(c, &unmap_ns, &release_ns));
    return absl::StrCat("ok ", NowNs(), " unmap_ms=", unmap_ns / 1e6, " release_ms=", release_ns / 1e6);
  }
  if (op == "raw-detach") {
    KVD_RETURN_IF_ERROR(RawRelease(c));
    if (c.raw_va != 0) KVD_RETURN_IF_ERROR(c.raw->Free(c.raw_va, c.raw_bytes));
    c.raw_va = 0;
    return std::string("ok");
  }
  // "ping-serve PATH [REPLY]": a bare synchronous gRPC server on PATH; REPLY, a base64 kvd.v1.Pool, is what it
  // answers. "ping-serve-mixed PATH REPLY": the same answers from a server on gRPC's callback API (MixedPingService).
  if ((op == "ping-serve" && (w.size() == 2 || w.size() == 3)) || (op == "ping-serve-mixed" && w.size() == 3)) {
    std::optional<kvd::v1::Pool> reply;
    if (w.size() == 3) {
      std::string bytes;
      reply.emplace();
      if (!absl::Base64Unescape(w[2], &bytes) || !reply->ParseFromString(bytes)) {
        return absl::InvalidArgumentError(absl::StrCat(op, ": the reply is not a base64 kvd.v1.Pool"));
      }
    }
    const bool mixed = op == "ping-serve-mixed";
    if (mixed) {
      c.pings.push_back(std::make_unique<MixedPingService>(*std::move(reply)));
    } else {
      c.pings.push_back(std::make_unique<PingService>(std::move(reply)));
    }
    grpc::EnableDefaultHealthCheckService(mixed);  // read when the server is built
    grpc::ServerBuilder builder;
    builder.AddListeningPort(absl::StrCat("unix:", w[1]), grpc::InsecureServerCredentials());
    builder.RegisterService(c.pings.back().get());
    c.ping_servers.push_back(builder.BuildAndStart());
    if (c.ping_servers.back() == nullptr) return absl::UnavailableError(absl::StrCat("cannot serve on ", w[1]));
    return std::string("ok");
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown request \"", absl::StrJoin(w, " "), "\""));
}

int ChildMain(int socket, const std::string& backend, int device, uint64_t granularity) {
  internal::SetPhaseHook(&RecordMark);
  ChildState c{.backend = backend, .device = device, .granularity = granularity};
  while (true) {
    absl::StatusOr<MessageWithFds> m = ReceiveWithFds(socket, kMaxMessage);
    if (!m.ok()) {
      for (const std::unique_ptr<grpc::Server>& server : c.ping_servers) server->Shutdown();
      RawRelease(c).IgnoreError();
      return absl::IsUnavailable(m.status()) ? 0 : 1;  // UNAVAILABLE: the parent is done
    }
    for (int fd : m->fds) close(fd);
    std::vector<std::string> w = absl::StrSplit(m->payload, ' ', absl::SkipEmpty());
    absl::StatusOr<std::string> reply = w.empty() ? absl::InvalidArgumentError("empty") : ChildRequest(c, socket, w);
    std::string text = reply.ok() ? *reply : absl::StrCat("error ", reply.status().ToString());
    if (text.size() > 4000) text.resize(4000);
    if (!SendWithFds(socket, text, {}).ok()) return 1;
  }
}

// The parent's end of the second process.
class Child {
 public:
  static absl::StatusOr<std::unique_ptr<Child>> Spawn(const std::string& backend, int device, uint64_t granularity) {
    int pair[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET, 0, pair) != 0) return ErrnoStatus(errno, "socketpair");
    if (fcntl(pair[0], F_SETFD, FD_CLOEXEC) != 0) return ErrnoStatus(errno, "fcntl(FD_CLOEXEC)");
    std::vector<std::string> args = {"/proc/self/exe", absl::StrCat("--child-fd=", pair[1]),
                                     absl::StrCat("--backend=", backend), absl::StrCat("--device=", device),
                                     absl::StrCat("--child-granularity=", granularity)};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = 0;
    const int err = posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv.data(), environ);
    close(pair[1]);
    if (err != 0) {
      close(pair[0]);
      return ErrnoStatus(err, "posix_spawn(/proc/self/exe)");
    }
    return std::unique_ptr<Child>(new Child(pair[0], pid));
  }
  ~Child() {
    close(socket_);
    int status = 0;
    waitpid(pid_, &status, 0);
  }
  int socket() const { return socket_; }
  pid_t pid() const { return pid_; }
  // Sends a request, returns the words of an "ok" reply after "ok".
  absl::StatusOr<std::vector<std::string>> Call(absl::string_view request) {
    KVD_RETURN_IF_ERROR(SendWithFds(socket_, request, {}));
    return Reply(request);
  }
  absl::StatusOr<std::vector<std::string>> Reply(absl::string_view request) {
    KVD_ASSIGN_OR_RETURN(MessageWithFds m, ReceiveWithFds(socket_, kMaxMessage));
    for (int fd : m.fds) close(fd);
    std::vector<std::string> w = absl::StrSplit(m.payload, ' ', absl::SkipEmpty());
    if (w.empty() || w[0] != "ok") {
      return absl::InternalError(absl::StrCat("second process, ", request, ": ", m.payload));
    }
    w.erase(w.begin());
    return w;
  }
  // The reply's "done" time minus `start_ns`, in ms; `rest` (if given) gets the reply's "key=value" words.
  absl::StatusOr<double> TimedReply(absl::string_view request, int64_t start_ns,
                                    std::map<std::string, std::string>* rest = nullptr) {
    KVD_ASSIGN_OR_RETURN(std::vector<std::string> w, Reply(request));
    int64_t done = 0;
    if (w.empty() || !absl::SimpleAtoi(w[0], &done)) return absl::InternalError("no done time in the reply");
    if (rest != nullptr) *rest = KeyValues(w);
    return (done - start_ns) / 1e6;
  }
  static std::map<std::string, std::string> KeyValues(const std::vector<std::string>& words) {
    std::map<std::string, std::string> out;
    for (const std::string& word : words) {
      if (size_t eq = word.find('='); eq != std::string::npos) out[word.substr(0, eq)] = word.substr(eq + 1);
    }
    return out;
  }

 private:
  Child(int socket, pid_t pid) : socket_(socket), pid_(pid) {}
  int socket_;
  pid_t pid_;
};

// ---------------------------------------------------------------------------------------------------
// The raw side's exporter: the daemon's chunk plan through kvd::Device in this process.

struct PlanChunk {
  uint64_t offset = 0;
  uint64_t bytes = 0;
  uint64_t segment = 0;
};
struct Plan {
  uint64_t reserve_bytes = 0;
  std::vector<PlanChunk> chunks;
  uint64_t bytes() const {
    uint64_t b = 0;
    for (const PlanChunk& c : chunks) b += c.bytes;
    return b;
  }
};

Plan PlanOf(const PoolInfo& pool) {
  Plan p{.reserve_bytes = pool.geometry.reserved_bytes};
  for (const ChunkInfo& c : pool.chunks) p.chunks.push_back({c.offset, c.bytes, c.segment});
  return p;
}

class RawExporter {
 public:
  RawExporter(Device* device, Plan plan) : d_(device), plan_(std::move(plan)) {}
  ~RawExporter() {
    Release().IgnoreError();
    if (va_ != 0) d_->Free(va_, plan_.reserve_bytes).IgnoreError();
  }
  const Plan& plan() const { return plan_; }
  absl::Status Reserve() {
    if (va_ == 0) {
      KVD_ASSIGN_OR_RETURN(va_, d_->Reserve(plan_.reserve_bytes));
    }
    return absl::OkStatus();
  }
  // Create, map (+ access) and export every chunk of the plan: what a grow does in the daemon. The time of
  // each kind of call, summed over the chunks, in grow_phases_ms().
  absl::Status Grow() {
    KVD_RETURN_IF_ERROR(Reserve());
    int64_t create_ns = 0, map_ns = 0, export_ns = 0;
    for (const PlanChunk& c : plan_.chunks) {
      int64_t t = NowNs();
      KVD_ASSIGN_OR_RETURN(Chunk chunk, d_->Create(c.bytes));
      chunks_.push_back(chunk);
      const int64_t created = NowNs();
      KVD_RETURN_IF_ERROR(d_->Map(va_ + c.offset, chunk, Access::kReadWrite));
      mapped_.push_back(c);
      const int64_t mapped = NowNs();
      KVD_ASSIGN_OR_RETURN(int fd, d_->Export(chunk));
      fds_.push_back(fd);
      create_ns += created - t;
      map_ns += mapped - created;
      export_ns += NowNs() - mapped;
    }
    grow_phases_ms_ = {{"create", create_ns / 1e6}, {"map", map_ns / 1e6}, {"export", export_ns / 1e6}};
    return absl::OkStatus();
  }
  const std::vector<std::pair<std::string, double>>& grow_phases_ms() const { return grow_phases_ms_; }
  // Grow and SendAttach in batches of kMaxFdsPerMessage chunks: create, map and export a batch, send it,
  // close its FDs, next batch; the second process imports each batch as it arrives. A few hundred FDs
  // are open at once on either side, however many chunks (the granule design has one per 2 MiB). The
  // reply ("raw-attach") is awaited by the caller.
  absl::Status GrowAndSendInBatches(Child& child) {
    KVD_RETURN_IF_ERROR(Reserve());
    const uint64_t n = plan_.chunks.size();
    KVD_RETURN_IF_ERROR(SendWithFds(child.socket(), absl::StrCat("raw-attach ", plan_.reserve_bytes, " ", n), {}));
    for (uint64_t i = 0; i < n; i += kMaxFdsPerMessage) {
      const uint64_t end = std::min<uint64_t>(n, i + kMaxFdsPerMessage);
      std::string text = "chunks";
      for (uint64_t j = i; j < end; ++j) {
        const PlanChunk& c = plan_.chunks[j];
        KVD_ASSIGN_OR_RETURN(Chunk chunk, d_->Create(c.bytes));
        chunks_.push_back(chunk);
        KVD_RETURN_IF_ERROR(d_->Map(va_ + c.offset, chunk, Access::kReadWrite));
        mapped_.push_back(c);
        KVD_ASSIGN_OR_RETURN(int fd, d_->Export(chunk));
        fds_.push_back(fd);
        absl::StrAppend(&text, " ", c.offset, ":", c.bytes);
      }
      const absl::Status sent = SendWithFds(child.socket(), text, fds_);
      for (int fd : fds_) close(fd);
      fds_.clear();
      KVD_RETURN_IF_ERROR(sent);
    }
    return absl::OkStatus();
  }
  // Hands the FDs to the second process's importer ("raw-attach"); the reply is awaited by the caller.
  absl::Status SendAttach(Child& child) {
    const uint64_t n = fds_.size();
    KVD_RETURN_IF_ERROR(SendWithFds(child.socket(), absl::StrCat("raw-attach ", plan_.reserve_bytes, " ", n), {}));
    for (uint64_t i = 0; i < n; i += kMaxFdsPerMessage) {
      const size_t count = std::min<uint64_t>(kMaxFdsPerMessage, n - i);
      std::string text = "chunks";
      for (size_t j = i; j < i + count; ++j)
        absl::StrAppend(&text, " ", plan_.chunks[j].offset, ":", plan_.chunks[j].bytes);
      KVD_RETURN_IF_ERROR(SendWithFds(child.socket(), text, absl::MakeConstSpan(fds_).subspan(i, count)));
    }
    return absl::OkStatus();
  }
  absl::Status Release() {
    for (int fd : fds_) close(fd);
    fds_.clear();
    for (const PlanChunk& c : mapped_) KVD_RETURN_IF_ERROR(d_->Unmap(va_ + c.offset, c.bytes));
    mapped_.clear();
    for (const Chunk& c : chunks_) KVD_RETURN_IF_ERROR(d_->Release(c));
    chunks_.clear();
    return absl::OkStatus();
  }

 private:
  Device* d_;
  std::vector<std::pair<std::string, double>> grow_phases_ms_;  // of the last Grow
  Plan plan_;
  uint64_t va_ = 0;
  std::vector<Chunk> chunks_;
  std::vector<PlanChunk> mapped_;
  std::vector<int> fds_;
};

// ---------------------------------------------------------------------------------------------------
// The in-process peers (docs/benchmarks.md, "Against the in-process allocators"): what torch_memory_saver
// does for every tensor it may pause, in this one process and with nothing to share. The VA is reserved
// once; an allocation (and a resume) is create + map + set access, a pause is unmap + release with the VA
// kept. On CUDA these are the driver calls themselves, through the table the CUDA backend loads
// (cuMemCreate of pinned device memory with no shareable handle type and gpuDirectRDMACapable where the
// device supports it, as torch_memory_saver asks); on host a memfd (memfd_create + ftruncate + fallocate)
// mapped MAP_SHARED | MAP_FIXED over a PROT_NONE reservation: the host backend's calls without its checks
// and its export. Every call runs on the thread that opened it (the benchmark's main thread).

class InProcess {
 public:
  virtual ~InProcess() = default;
  // UNIMPLEMENTED for a backend without an in-process counterpart here.
  static absl::StatusOr<std::unique_ptr<InProcess>> Open(const std::string& backend, int device);
  virtual absl::StatusOr<uint64_t> Reserve(uint64_t bytes) = 0;
  virtual absl::Status Free(uint64_t va, uint64_t bytes) = 0;
  // A handle to `bytes` of physical memory, allocated now.
  virtual absl::StatusOr<uint64_t> Create(uint64_t bytes) = 0;
  // Maps the whole allocation at `va` and makes it readable and writable by this device.
  virtual absl::Status Map(uint64_t va, uint64_t handle, uint64_t bytes) = 0;
  virtual absl::Status Unmap(uint64_t va, uint64_t bytes) = 0;
  virtual absl::Status Release(uint64_t handle) = 0;
};

class HostInProcess final : public InProcess {
 public:
  absl::StatusOr<uint64_t> Reserve(uint64_t bytes) override {
    void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return ErrnoStatus(errno, "mmap(PROT_NONE)");
    return reinterpret_cast<uint64_t>(p);
  }
  absl::Status Free(uint64_t va, uint64_t bytes) override {
    if (munmap(reinterpret_cast<void*>(va), bytes) != 0) return ErrnoStatus(errno, "munmap");
    return absl::OkStatus();
  }
  absl::StatusOr<uint64_t> Create(uint64_t bytes) override {
    UniqueFd fd(memfd_create("kvd-bench-in-process", MFD_CLOEXEC));
    if (!fd) return ErrnoStatus(errno, "memfd_create");
    if (ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) return ErrnoStatus(errno, "ftruncate");
    int rc;
    do {
      rc = fallocate(fd.get(), 0, 0, static_cast<off_t>(bytes));
    } while (rc != 0 && errno == EINTR);
    if (rc != 0) return ErrnoStatus(errno, absl::StrCat("fallocate(", bytes, " bytes)"));
    return static_cast<uint64_t>(fd.release());
  }
  absl::Status Map(uint64_t va, uint64_t handle, uint64_t bytes) override {
    void* p = mmap(reinterpret_cast<void*>(va), bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                   static_cast<int>(handle), 0);
    if (p == MAP_FAILED) return ErrnoStatus(errno, "mmap(MAP_SHARED | MAP_FIXED)");
    return absl::OkStatus();
  }
  absl::Status Unmap(uint64_t va, uint64_t bytes) override {
    void* p = mmap(reinterpret_cast<void*>(va), bytes, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return ErrnoStatus(errno, "mmap(PROT_NONE | MAP_FIXED)");
    return absl::OkStatus();
  }
  absl::Status Release(uint64_t handle) override {
    if (close(static_cast<int>(handle)) != 0) return ErrnoStatus(errno, "close(memfd)");
    return absl::OkStatus();
  }
};

#ifdef KVD_WITH_CUDA
class CudaInProcess final : public InProcess {
 public:
  static absl::StatusOr<std::unique_ptr<InProcess>> Open(int ordinal) {
    KVD_ASSIGN_OR_RETURN(const CudaDriver* driver, LoadCudaDriver());
    const CudaDriver& d = *driver;
    auto p = std::unique_ptr<CudaInProcess>(new CudaInProcess(d));
    KVD_RETURN_IF_ERROR(CudaStatus(d, d.cuInit_(0), "cuInit"));
    KVD_RETURN_IF_ERROR(CudaStatus(d, d.cuDeviceGet_(&p->device_, ordinal), "cuDeviceGet"));
    KVD_RETURN_IF_ERROR(
        CudaStatus(d, d.cuDevicePrimaryCtxRetain_(&p->context_, p->device_), "cuDevicePrimaryCtxRetain"));
    KVD_RETURN_IF_ERROR(CudaStatus(d, d.cuCtxSetCurrent_(p->context_), "cuCtxSetCurrent"));
    int rdma = 0;
    KVD_RETURN_IF_ERROR(CudaStatus(
        d, d.cuDeviceGetAttribute_(&rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, p->device_),
        "cuDeviceGetAttribute(GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)"));
    p->prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p->prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p->prop_.location.id = p->device_;
    p->prop_.allocFlags.gpuDirectRDMACapable = rdma ? 1 : 0;
    p->access_.location = p->prop_.location;
    p->access_.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    return p;
  }
  ~CudaInProcess() override {
    if (context_ != nullptr) (void)d_.cuDevicePrimaryCtxRelease_(device_);
  }
  absl::StatusOr<uint64_t> Reserve(uint64_t bytes) override {
    CUdeviceptr va = 0;
    KVD_RETURN_IF_ERROR(CudaStatus(d_, d_.cuMemAddressReserve_(&va, bytes, 0, 0, 0), "cuMemAddressReserve"));
    return static_cast<uint64_t>(va);
  }
  absl::Status Free(uint64_t va, uint64_t bytes) override {
    return CudaStatus(d_, d_.cuMemAddressFree_(va, bytes), "cuMemAddressFree");
  }
  absl::StatusOr<uint64_t> Create(uint64_t bytes) override {
    CUmemGenericAllocationHandle handle = 0;
    KVD_RETURN_IF_ERROR(CudaStatusLazy(d_, d_.cuMemCreate_(&handle, bytes, &prop_, 0),
                                       [&] { return absl::StrCat("cuMemCreate(", bytes, " bytes)"); }));
    return static_cast<uint64_t>(handle);
  }
  absl::Status Map(uint64_t va, uint64_t handle, uint64_t bytes) override {
    KVD_RETURN_IF_ERROR(CudaStatus(d_, d_.cuMemMap_(va, bytes, 0, handle, 0), "cuMemMap"));
    if (absl::Status s = CudaStatus(d_, d_.cuMemSetAccess_(va, bytes, &access_, 1), "cuMemSetAccess"); !s.ok()) {
      (void)d_.cuMemUnmap_(va, bytes);
      return s;
    }
    return absl::OkStatus();
  }
  absl::Status Unmap(uint64_t va, uint64_t bytes) override {
    return CudaStatus(d_, d_.cuMemUnmap_(va, bytes), "cuMemUnmap");
  }
  absl::Status Release(uint64_t handle) override { return CudaStatus(d_, d_.cuMemRelease_(handle), "cuMemRelease"); }

 private:
  explicit CudaInProcess(const CudaDriver& d) : d_(d) {}
  const CudaDriver& d_;
  CUdevice device_ = 0;
  CUcontext context_ = nullptr;
  CUmemAllocationProp prop_{};
  CUmemAccessDesc access_{};
};
#endif

absl::StatusOr<std::unique_ptr<InProcess>> InProcess::Open(const std::string& backend, int device) {
  if (backend == "host") return std::unique_ptr<InProcess>(new HostInProcess());
#ifdef KVD_WITH_CUDA
  if (backend == "cuda") return CudaInProcess::Open(device);
#endif
  (void)device;
  return absl::UnimplementedError(absl::StrCat("no in-process allocator for backend ", backend, " in this build"));
}

// One in-process peer of the lifecycle: its allocations (one for the whole pool, or one per segment, at
// the offsets of the pool's chunks) in a reservation of its own, made once.
struct InProcessSide {
  std::string name;  // "single", "per_segment"
  Plan plan;
  uint64_t va = 0;
  std::vector<uint64_t> handles;  // created, in plan order
  size_t mapped = 0;              // the first `mapped` of them are mapped
};

// The allocations of the in-process peers for the pool whose chunks are `pool`: one allocation of all its
// bytes, or one per segment spanning that segment's chunks (a segment's committed prefix is contiguous).
Plan SinglePlan(const Plan& pool) {
  Plan p{.reserve_bytes = pool.bytes()};
  p.chunks.push_back({.offset = 0, .bytes = pool.bytes(), .segment = 0});
  return p;
}
Plan PerSegmentPlan(const Plan& pool) {
  std::map<uint64_t, PlanChunk> by_segment;
  for (const PlanChunk& c : pool.chunks) {
    auto [it, inserted] = by_segment.try_emplace(c.segment, c);
    if (inserted) continue;
    const uint64_t end = std::max(it->second.offset + it->second.bytes, c.offset + c.bytes);
    it->second.offset = std::min(it->second.offset, c.offset);
    it->second.bytes = end - it->second.offset;
  }
  Plan p{.reserve_bytes = pool.reserve_bytes};
  for (const auto& [segment, c] : by_segment) p.chunks.push_back(c);
  return p;
}

// ---------------------------------------------------------------------------------------------------
// Results.

// The phases of the bare calls of a reshape (Bench::RawReshape), in ms.
struct ReshapeTimes {
  double create_map = 0, copy = 0, release_old = 0, remap = 0, free_wait = 0;
  double total() const { return create_map + copy + release_old + remap + free_wait; }
};

// An in-process peer's column of a lifecycle line.
struct Peer {
  std::string name;  // "single", "per_segment"
  std::string what;
  uint64_t allocations = 0;
  std::vector<double> ms;
  std::string target;  // on kvd p50 / this p50
  double ratio = NAN;
  std::string skipped;
};

struct Line {
  std::string name;
  std::string variant;
  std::string kvd_what, base_what;
  std::vector<double> kvd, base;  // ms
  std::string ratio_means = "kvd/raw p50";
  double ratio = NAN;
  std::string target;  // "<= 1.10", ">= 40", empty: none
  std::string skipped;
  std::string note;
  // Per-phase breakdown (ms), in the order the phases happen; the same sample count as kvd/base.
  std::vector<std::pair<std::string, std::vector<double>>> kvd_phases, base_phases;
  // The lifecycle lines' in-process peers (or why there are none): kvd against each as well.
  std::vector<Peer> peers;
  std::string peers_skipped;
  bool lifecycle = false;
  Peer& PeerNamed(const std::string& peer) {
    for (Peer& p : peers) {
      if (p.name == peer) return p;
    }
    peers.push_back(Peer{.name = peer});
    return peers.back();
  }
};

void AddPhase(std::vector<std::pair<std::string, std::vector<double>>>& phases, const std::string& name, double ms) {
  for (auto& [n, v] : phases) {
    if (n == name) {
      v.push_back(ms);
      return;
    }
  }
  phases.push_back({name, {ms}});
}

void AddReshapePhases(std::vector<std::pair<std::string, std::vector<double>>>& phases, const ReshapeTimes& t) {
  AddPhase(phases, "create_map", t.create_map);
  AddPhase(phases, "copy", t.copy);
  AddPhase(phases, "release_old", t.release_old);
  AddPhase(phases, "remap", t.remap);
  AddPhase(phases, "free_wait", t.free_wait);
}

// ns of a "name=NS" word of a second-process reply; -1 when missing.
int64_t NsOf(const std::map<std::string, std::string>& kv, const std::string& name) {
  int64_t v = -1;
  auto it = kv.find(name);
  if (it == kv.end() || !absl::SimpleAtoi(it->second, &v)) return -1;
  return v;
}
double MsOf(const std::map<std::string, std::string>& kv, const std::string& name) {
  double v = NAN;
  auto it = kv.find(name);
  if (it == kv.end() || !absl::SimpleAtod(it->second, &v)) return NAN;
  return v;
}
// (to - from) in ms, NAN when either mark is missing.
double Between(int64_t from, int64_t to) { return from < 0 || to < 0 ? NAN : (to - from) / 1e6; }

struct Bookkeeping {
  std::string skipped;
  uint64_t chunks = 0, pools = 0;
  double daemon_bytes_per_chunk = NAN, raw_bytes_per_chunk = NAN, daemon_bytes_per_pool = NAN;
  double own_bytes_per_chunk = NAN;  // daemon - raw: kvd's own share (the 240 B target)
  double fds_per_chunk = NAN, fds_per_chunk_after_attach = NAN, exports_per_chunk = NAN;
  std::string exports_skipped;
};

struct Options {
  std::string socket;  // empty: start a kvd
  std::string kvd_binary;
  std::string backend = "auto";
  int device = 0;
  std::string bytes, chunk, budget = "100%";
  uint64_t segments = 0;
  int reps = 9;
  int deadline_s = 0;  // 0: none
  bool chunk_sweep = false;
  std::string sweep_bytes, sweep_sizes;
  int sweep_reps = 3;
  int fragments = 0;
  int compact_grows = 0;
  uint32_t compact_chunks_per_pause = 0;  // 0: the daemon's --compact-chunks-per-pause
  std::string sections = "all";
  std::string layout = "LBHNC";
  int pause_ms = -1;
  // Who releases first in the raw lifecycle's sleep and shrink: "importer" (the second process; the exporter's
  // release then frees) or "exporter" (then the importer's release frees, as in kvd: Note [Who holds a released
  // chunk] in docs/architecture.md).
  std::string raw_release_first = "importer";
  int threads = 4;
  int rpc_calls = 0;
  int watch_streams = 200;
  std::string bookkeeping_bytes;
  std::string keep_bytes;  // the keep section's pool; empty: the section says why it is skipped
  uint64_t bookkeeping_pools = 64;
  int granule_reps = 0;
  std::string free_slack;
  bool torch = true;
  bool json = false;
  int child_fd = -1;
  uint64_t child_granularity = 0;
};

// ---------------------------------------------------------------------------------------------------
// The daemon's process: pid (SO_PEERCRED), anonymous resident memory, open FDs.

absl::StatusOr<pid_t> PeerPid(const std::string& socket_path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus(errno, "socket");
  absl::Cleanup closer = [fd] { close(fd); };
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_path.size() >= sizeof(addr.sun_path)) return absl::InvalidArgumentError("socket path too long");
  std::memcpy(addr.sun_path, socket_path.data(), socket_path.size());
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return ErrnoStatus(errno, "connect");
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return ErrnoStatus(errno, "SO_PEERCRED");
  return cred.pid;
}

absl::StatusOr<uint64_t> RssAnonBytes(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "RssAnon:")) {
      std::vector<std::string> w = absl::StrSplit(line, ' ', absl::SkipEmpty());
      uint64_t kb = 0;
      if (w.size() >= 2 && absl::SimpleAtoi(w[1], &kb)) return kb * 1024;
    }
  }
  return absl::UnavailableError(absl::StrCat("cannot read RssAnon of pid ", pid));
}

// The FDs of `pid` that may hold memory: everything but sockets, pipes and event/epoll/timer FDs.
absl::StatusOr<std::vector<int>> MemoryFds(pid_t pid) {
  const std::string dir = absl::StrCat("/proc/", pid, "/fd");
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return ErrnoStatus(errno, absl::StrCat("opendir ", dir));
  std::vector<int> out;
  while (dirent* e = readdir(d)) {
    int fd = 0;
    if (!absl::SimpleAtoi(e->d_name, &fd)) continue;
    char target[512];
    const ssize_t n = readlink(absl::StrCat(dir, "/", fd).c_str(), target, sizeof(target) - 1);
    if (n <= 0) continue;
    const absl::string_view t(target, n);
    if (absl::StartsWith(t, "socket:") || absl::StartsWith(t, "pipe:") || absl::StrContains(t, "[event") ||
        absl::StrContains(t, "[timerfd]") || absl::StartsWith(t, "/proc/") || absl::StartsWith(t, "/dev/null")) {
      continue;
    }
    out.push_back(fd);
  }
  closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

absl::StatusOr<uint64_t> HostFreeBytes() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  uint64_t total = 0, shmem = 0;
  while (std::getline(in, line)) {
    std::vector<std::string> w = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (w.size() < 2) continue;
    if (w[0] == "MemTotal:" && !absl::SimpleAtoi(w[1], &total)) total = 0;
    if (w[0] == "Shmem:" && !absl::SimpleAtoi(w[1], &shmem)) shmem = 0;
  }
  if (total == 0) return absl::UnavailableError("cannot read MemTotal from /proc/meminfo");
  return (total - std::min(total, shmem)) * 1024;
}

// Least-squares slope of y over x.
double Slope(const std::vector<double>& x, const std::vector<double>& y) {
  double mx = 0, my = 0;
  for (size_t i = 0; i < x.size(); ++i) mx += x[i], my += y[i];
  mx /= x.size(), my /= y.size();
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) num += (x[i] - mx) * (y[i] - my), den += (x[i] - mx) * (x[i] - mx);
  return den > 0 ? num / den : NAN;
}

// ---------------------------------------------------------------------------------------------------
// The chunk-size sweep (--chunk-sweep; docs/benchmarks.md, "Chunk size"): the same bytes as chunks of each
// size through kvd::Device, the calls the daemon and an engine make, with no daemon in between.

// The sweep's phases, in the order they happen, and their sums.
constexpr const char* kSweepPhases[] = {"create",         "map",     "export",   "import", "import_map",
                                        "import_release", "release", "free_wait"};
struct SweepGroup {
  const char* name;
  std::vector<const char*> phases;
};
const std::vector<SweepGroup>& SweepGroups() {
  static const auto* groups = new std::vector<SweepGroup>{
      {"grow", {"create", "map", "export"}},
      {"attach", {"import", "import_map"}},
      {"release_all", {"import_release", "release", "free_wait"}},
      {"total", {"create", "map", "export", "import", "import_map", "import_release", "release", "free_wait"}}};
  return *groups;
}

struct SweepSize {
  uint64_t chunk_bytes = 0, handles = 0;
  std::string skipped;
  // variant ("after_release", "after_pause") -> phase or group -> samples (ms)
  std::map<std::string, std::map<std::string, std::vector<double>>> ms;
  // The scrub: create's p50 after a release less its p50 after a pause (ms; derived, not timed).
  double scrub_ms() const {
    auto at = [&](const char* variant) -> double {
      auto v = ms.find(variant);
      if (v == ms.end()) return NAN;
      auto p = v->second.find("create");
      return p == v->second.end() ? NAN : P50(p->second);
    };
    return at("after_release") - at("after_pause");
  }
};

// ---------------------------------------------------------------------------------------------------
// The benchmark.

class Bench {
 public:
  explicit Bench(Options o) : o_(std::move(o)) {}
  ~Bench() { Stop(); }
  // The whole path, or with --chunk-sweep the chunk-size sweep.
  absl::Status Run();
  void Print(FILE* out) const;
  std::string Json() const;

 private:
  absl::Status StartDaemon();
  void Stop();
  void Pause() const { std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms_)); }
  // Whether --sections asks for `section`.
  bool Want(const std::string& section) const { return sections_.empty() || sections_.contains(section); }
  // The device's own free count: the driver's (cuMemGetInfo) on a GPU. On host, memfd pages are shmem and
  // the host device's free count is per process, so the machine's MemTotal - Shmem (MemAvailable does not
  // follow shmem frees on every VM).
  absl::StatusOr<uint64_t> FreeBytes() {
    if (!gpu_) return HostFreeBytes();
    KVD_ASSIGN_OR_RETURN(DeviceInfo info, raw_->Info());
    return info.free_bytes;
  }
  // Polls the device's free count until it has risen by `bytes` over `before` (its value right before the
  // release), within the slack; bounded by free_timeout_ms_ (counted in free_timeouts_).
  absl::Status WaitFree(uint64_t before, uint64_t bytes);
  absl::StatusOr<PoolInfo> CreatePool(const std::string& name, uint64_t blocks);
  Line& GetLine(const std::string& name, const std::string& variant);

  void AddAttachPhases(Line& l, int64_t sent, const std::map<std::string, std::string>& marks);
  void AddRawAttachPhases(Line& l, int64_t sent, const std::map<std::string, std::string>& parts);
  absl::Status Lifecycle(RawExporter& raw, const PoolInfo& grown);
  absl::Status KvdCycle(bool paused, bool record);
  absl::Status RawCycle(RawExporter& raw, bool paused, bool record);
  absl::Status InProcessCycle(InProcessSide& side, bool paused, bool record);
  absl::Status ReleaseInProcess(InProcessSide& side);
  absl::Status Fragmented();
  absl::StatusOr<uint64_t> ReshapeBytes(uint64_t want, double peak);
  absl::StatusOr<ReshapeTimes> RawReshape(const Plan& from, const Plan& to);
  absl::Status Compact();
  absl::Status ShrinkToHalf();
  absl::Status ControlRpc();
  absl::Status ControlRpcWithWatchers(const std::string& pool, const std::vector<double>& idle);
  absl::Status Concurrent();
  absl::Status Reclaim();
  absl::Status Saturate();
  absl::Status Keep();
  absl::Status MeasureBookkeeping();
  absl::Status Granule();
  absl::Status Torch();
  // The pause and the free-count wait's bounds for a device of granularity `g`.
  absl::Status SetWaits(uint64_t g);
  absl::Status ChunkSweep();
  absl::Status SweepRound(SweepSize& r, uint64_t va, bool paused, bool record);
  void PrintSweep(FILE* out) const;
  std::string SweepJson() const;

  Options o_;
  std::string backend_;
  bool gpu_ = false;
  DeviceStatus daemon_;
  DeviceInfo raw_info_;
  // layers_: the pool's L; segments_: its segments (one per layer under LBHNC, one under BLHNC).
  uint64_t bytes_ = 0, layers_ = 0, segments_ = 0, blocks_ = 0, max_chunk_ = 0, slack_ = 0;
  int pause_ms_ = 0, fragments_ = 0, compact_grows_ = 0, free_timeout_ms_ = 10000;
  uint64_t compact_bytes_ = 0, shrink_bytes_ = 0;  // the pools of the compact and shrink_to_half lines
  std::set<std::string> sections_;                 // empty: all
  std::string socket_, dir_;
  pid_t kvd_pid_ = -1, daemon_pid_ = -1;
  std::unique_ptr<Client> client_;
  std::unique_ptr<Device> raw_;
  std::unique_ptr<InProcess> in_process_;  // null: see in_process_skipped_
  std::string in_process_skipped_;
  std::unique_ptr<Child> child_;
  std::string prefix_;
  std::string pool_;  // the main pool
  std::vector<std::string> pools_;
  uint64_t pool_bytes_ = 0;  // committed when full
  uint64_t chunks_ = 0;      // in the main pool when full
  std::deque<Line> lines_;   // GetLine hands out references: a deque keeps them valid
  Bookkeeping book_;
  uint64_t free_timeouts_ = 0;
  std::string torch_version_;
  int64_t deadline_ns_ = 0;  // 0: none (--deadline-s)
  uint64_t sweep_bytes_ = 0;
  std::vector<SweepSize> sweep_;
  int lifecycle_reps_ = 0;  // repetitions of the lifecycle that ran
};

absl::Status Bench::StartDaemon() {
  std::string binary = o_.kvd_binary;
  if (binary.empty()) {
    char self[4096];
    const ssize_t len = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (len <= 0) return ErrnoStatus(errno, "readlink(/proc/self/exe)");
    const std::string dir = std::string(self, len).substr(0, std::string(self, len).rfind('/'));
    for (const std::string& candidate : {dir + "/kvd", dir + "/../daemon/kvd"}) {
      if (access(candidate.c_str(), X_OK) == 0) binary = candidate;
      if (!binary.empty()) break;
    }
    if (binary.empty()) binary = "kvd";  // from PATH
  }
  char tmpl[] = "/tmp/kvd-bench-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return ErrnoStatus(errno, "mkdtemp");
  dir_ = tmpl;
  socket_ = dir_ + "/gpu0.sock";
  std::vector<std::string> args = {binary,
                                   absl::StrCat("--backend=", o_.backend),
                                   absl::StrCat("--device=", o_.device),
                                   absl::StrCat("--socket=", socket_),
                                   absl::StrCat("--budget=", o_.budget),
                                   "--log-level=warn"};
  if (!o_.chunk.empty()) args.push_back(absl::StrCat("--max-chunk=", o_.chunk));
  if (!o_.keep_bytes.empty()) {
    KVD_ASSIGN_OR_RETURN(const uint64_t keep, ParseBytes(o_.keep_bytes, "--keep-bytes"));
    args.push_back(absl::StrCat("--host-tier-bytes=", (keep + (2 << 20) - 1) / (2 << 20) * (2 << 20)));
  }
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const std::string log = dir_ + "/kvd.log";
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  const int err = posix_spawnp(&kvd_pid_, binary.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (err != 0) return ErrnoStatus(err, absl::StrCat("posix_spawnp(", binary, ")"));
  const std::string handles = dir_ + "/gpu0.handles";
  for (int i = 0; i < 600; ++i) {
    if (access(handles.c_str(), F_OK) == 0) return absl::OkStatus();
    int status = 0;
    if (waitpid(kvd_pid_, &status, WNOHANG) == kvd_pid_) {
      kvd_pid_ = -1;
      std::ifstream in(log);
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      return absl::UnavailableError(absl::StrCat(binary, " exited at start: ", text));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return absl::DeadlineExceededError(absl::StrCat(binary, " did not open ", handles, " within 30 s"));
}

void Bench::Stop() {
  if (client_ != nullptr) {
    for (const std::string& p : pools_) client_->DeletePool(p, true).IgnoreError();
    pools_.clear();
  }
  child_.reset();
  client_.reset();
  if (kvd_pid_ > 0) {
    kill(kvd_pid_, SIGTERM);
    int status = 0;
    waitpid(kvd_pid_, &status, 0);
    kvd_pid_ = -1;
  }
  if (!dir_.empty()) {
    std::filesystem::remove_all(dir_);
    dir_.clear();
  }
}

absl::Status Bench::WaitFree(uint64_t before, uint64_t bytes) {
  const int64_t start = NowNs();
  while (true) {
    KVD_ASSIGN_OR_RETURN(uint64_t free, FreeBytes());
    if (free + slack_ >= before + bytes) return absl::OkStatus();
    if (MsSince(start) > free_timeout_ms_) {
      ++free_timeouts_;
      return absl::OkStatus();
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

absl::StatusOr<PoolInfo> Bench::CreatePool(const std::string& name, uint64_t blocks) {
  PoolOptions p{.name = prefix_ + name, .dims = kDims};
  p.dims.layers = layers_;
  p.dims.capacity_blocks = blocks;
  p.layout.override_layout = o_.layout;
  KVD_ASSIGN_OR_RETURN(PoolInfo pool, client_->CreatePool(p));
  pools_.push_back(p.name);
  if (pool.geometry.segments != segments_) {
    return absl::InternalError(
        absl::StrCat("pool ", p.name, " has ", pool.geometry.segments, " segments, expected ", segments_));
  }
  return pool;
}

Line& Bench::GetLine(const std::string& name, const std::string& variant) {
  for (Line& l : lines_) {
    if (l.name == name && l.variant == variant) return l;
  }
  lines_.push_back(Line{.name = name, .variant = variant, .kvd_what = "kvd", .base_what = "raw device calls"});
  return lines_.back();
}

// An attach's phases from the second process's marks: the request over the socket pair; libkvd's
// device look-up (a GetDeviceInfo RPC on a client's first attach only), the Attach RPC, the
// handle-channel fetch of the lease's FDs, reserve + import + map of every chunk, the rest of the
// Watch stream's start (sent before the import, confirmed after it); then reading one word per chunk.
void Bench::AddAttachPhases(Line& l, int64_t sent, const std::map<std::string, std::string>& marks) {
  const int64_t received = NsOf(marks, "received"), begin = NsOf(marks, "attach.begin"),
                device = NsOf(marks, "attach.device"), rpc = NsOf(marks, "attach.rpc"),
                fetched = NsOf(marks, "lease.fetched"), mapped = NsOf(marks, "attach.mapped"),
                watching = NsOf(marks, "attach.watching"), attached = NsOf(marks, "attached"),
                read = NsOf(marks, "read");
  AddPhase(l.kvd_phases, "request", Between(sent, received));
  AddPhase(l.kvd_phases, "device", Between(begin, device));
  AddPhase(l.kvd_phases, "attach_rpc", Between(device, rpc));
  AddPhase(l.kvd_phases, "fd_fetch", Between(rpc, fetched));
  AddPhase(l.kvd_phases, "reserve_import_map", Between(fetched, mapped));
  AddPhase(l.kvd_phases, "watch_start", Between(mapped, watching));
  AddPhase(l.kvd_phases, "read", Between(attached, read));
  // What no mark covers: the start of Attach and the return from it (the follower thread's start).
  AddPhase(l.kvd_phases, "other", Between(received, begin) + Between(watching, attached));
}

void Bench::AddRawAttachPhases(Line& l, int64_t sent, const std::map<std::string, std::string>& parts) {
  AddPhase(l.base_phases, "request", Between(sent, NsOf(parts, "received")));
  AddPhase(l.base_phases, "reserve", MsOf(parts, "reserve_ms"));
  AddPhase(l.base_phases, "fd_receive", MsOf(parts, "fd_receive_ms"));
  AddPhase(l.base_phases, "import_map", MsOf(parts, "import_map_ms"));
  AddPhase(l.base_phases, "read", MsOf(parts, "read_ms"));
}

// grow, attach (second process), sleep, wake, shrink of the main pool through kvd.
absl::Status Bench::KvdCycle(bool paused, bool record) {
  const std::string variant = paused ? "after_pause" : "after_release";
  auto add = [&](const char* op, double ms) {
    if (record) GetLine(op, variant).kvd.push_back(ms);
  };
  auto pause = [&] {
    if (paused) Pause();
  };
  pause();
  int64_t t = NowNs();
  KVD_ASSIGN_OR_RETURN(const PoolChange grown, client_->Grow(pool_, blocks_));
  const double grow_ms = MsSince(t);
  add("grow", grow_ms);
  // The daemon's own time on the change (PoolUpdate.elapsed_us) and the rest: the RPC, gRPC and libkvd.
  auto split = [&](const char* op, double ms, uint64_t elapsed_us) {
    if (!record) return;
    Line& l = GetLine(op, variant);
    AddPhase(l.kvd_phases, "in_daemon", elapsed_us / 1e3);
    AddPhase(l.kvd_phases, "outside", ms - elapsed_us / 1e3);
  };
  split("grow", grow_ms, grown.elapsed_us);
  pause();
  const std::string attach = absl::StrCat("kvd-attach ", socket_, " ", pool_, " ", pool_bytes_);
  t = NowNs();
  KVD_RETURN_IF_ERROR(SendWithFds(child_->socket(), attach, {}));
  std::map<std::string, std::string> marks;
  KVD_ASSIGN_OR_RETURN(double ms, child_->TimedReply(attach, t, &marks));
  add("attach", ms);
  add("grow_mapped", grow_ms + ms);
  if (record) AddAttachPhases(GetLine("attach", variant), t, marks);
  KVD_RETURN_IF_ERROR(child_->Call("kvd-marks").status());  // forget the marks since the attach
  pause();
  KVD_ASSIGN_OR_RETURN(uint64_t before, FreeBytes());
  t = NowNs();
  KVD_RETURN_IF_ERROR(client_->Sleep(pool_, /*wait=*/true).status());
  const int64_t replied = NowNs();
  KVD_RETURN_IF_ERROR(WaitFree(before, pool_bytes_));
  add("sleep", MsSince(t));
  if (record) {
    KVD_ASSIGN_OR_RETURN(std::vector<std::string> w, child_->Call("kvd-marks"));
    const std::map<std::string, std::string> kv = Child::KeyValues(w);
    const int64_t event = NsOf(kv, "release.event"), unmapped = NsOf(kv, "release.unmapped"),
                  acking = NsOf(kv, "release.acknowledging");
    Line& l = GetLine("sleep", variant);
    // The daemon's Sleep until the importer's follower has the release (its RESUME: the importer is
    // pausable, so this includes its pause and acknowledgement; the daemon's own unmap/release runs on
    // after it sends the event), the importer's unmap + release, from its
    // Acknowledge RPC's start to the Sleep's reply here (the daemon answers on the last
    // acknowledgement), then the wait for the free count.
    AddPhase(l.kvd_phases, "to_event", Between(t, event));
    AddPhase(l.kvd_phases, "importer_unmap", Between(event, unmapped));
    AddPhase(l.kvd_phases, "unmap_to_ack", Between(unmapped, acking));
    AddPhase(l.kvd_phases, "ack_to_reply", Between(acking, replied));
    AddPhase(l.kvd_phases, "free_wait", MsSince(replied));
  }
  pause();
  t = NowNs();
  KVD_ASSIGN_OR_RETURN(const std::vector<PoolChange> woken, client_->Wake(pool_));
  const double wake_ms = MsSince(t);
  add("wake", wake_ms);
  if (woken.size() == 1) split("wake", wake_ms, woken[0].elapsed_us);
  const std::string wait = absl::StrCat("kvd-wait ", pool_bytes_);
  KVD_RETURN_IF_ERROR(SendWithFds(child_->socket(), wait, {}));
  KVD_ASSIGN_OR_RETURN(ms, child_->TimedReply(wait, t));  // the importer's follower has mapped it again
  add("wake_mapped", ms);
  pause();
  KVD_ASSIGN_OR_RETURN(before, FreeBytes());
  t = NowNs();
  KVD_ASSIGN_OR_RETURN(const PoolChange shrunk, client_->Shrink(pool_, 0, /*wait=*/true));
  const double shrink_reply_ms = MsSince(t);
  KVD_RETURN_IF_ERROR(WaitFree(before, pool_bytes_));
  add("shrink", MsSince(t));
  if (record) {
    // The daemon's time until it committed (its own references released), then until the reply (the
    // importer's acknowledgement), then the free count.
    Line& l = GetLine("shrink", variant);
    AddPhase(l.kvd_phases, "in_daemon", shrunk.elapsed_us / 1e3);
    AddPhase(l.kvd_phases, "to_reply", shrink_reply_ms - shrunk.elapsed_us / 1e3);
    AddPhase(l.kvd_phases, "free_wait", MsSince(t) - shrink_reply_ms);
  }
  return child_->Call("kvd-detach").status();
}

// The same cycle with the bare calls: create/map/export here, import/map/read there.
absl::Status Bench::RawCycle(RawExporter& raw, bool paused, bool record) {
  const std::string variant = paused ? "after_pause" : "after_release";
  auto add = [&](const char* op, double ms) {
    if (record) GetLine(op, variant).base.push_back(ms);
  };
  auto pause = [&] {
    if (paused) Pause();
  };
  const bool exporter_first = o_.raw_release_first == "exporter";
  auto release_both = [&]() -> absl::Status {
    if (exporter_first) KVD_RETURN_IF_ERROR(raw.Release());
    KVD_RETURN_IF_ERROR(child_->Call("raw-release").status());
    return exporter_first ? absl::OkStatus() : raw.Release();
  };
  KVD_RETURN_IF_ERROR(raw.Reserve());
  pause();
  int64_t t = NowNs();
  KVD_RETURN_IF_ERROR(raw.Grow());
  const double grow_ms = MsSince(t);
  add("grow", grow_ms);
  if (record) {
    for (const auto& [phase, ms] : raw.grow_phases_ms()) AddPhase(GetLine("grow", variant).base_phases, phase, ms);
  }
  pause();
  t = NowNs();
  KVD_RETURN_IF_ERROR(raw.SendAttach(*child_));
  std::map<std::string, std::string> parts;
  KVD_ASSIGN_OR_RETURN(double ms, child_->TimedReply("raw-attach", t, &parts));
  add("attach", ms);
  add("grow_mapped", grow_ms + ms);
  if (record) AddRawAttachPhases(GetLine("attach", variant), t, parts);
  pause();
  KVD_ASSIGN_OR_RETURN(uint64_t before, FreeBytes());
  t = NowNs();
  int64_t importer_ns = 0, exporter_ns = 0;
  for (const bool exporter : {exporter_first, !exporter_first}) {
    const int64_t start = NowNs();
    KVD_RETURN_IF_ERROR(exporter ? raw.Release() : child_->Call("raw-release").status());
    (exporter ? exporter_ns : importer_ns) = NowNs() - start;
  }
  const int64_t released = NowNs();
  KVD_RETURN_IF_ERROR(WaitFree(before, raw.plan().bytes()));
  add("sleep", MsSince(t));
  if (record) {
    Line& l = GetLine("sleep", variant);
    AddPhase(l.base_phases, "importer_unmap", importer_ns / 1e6);  // request + unmap + release there
    AddPhase(l.base_phases, "exporter_release", exporter_ns / 1e6);
    AddPhase(l.base_phases, "free_wait", MsSince(released));
  }
  pause();
  t = NowNs();
  KVD_RETURN_IF_ERROR(raw.Grow());
  add("wake", MsSince(t));
  KVD_RETURN_IF_ERROR(raw.SendAttach(*child_));  // the importer maps again, as kvd's follower does
  KVD_ASSIGN_OR_RETURN(ms, child_->TimedReply("raw-attach", t, &parts));
  add("wake_mapped", ms - MsOf(parts, "read_ms"));  // until mapped: kvd's follower reads nothing either
  pause();
  KVD_ASSIGN_OR_RETURN(before, FreeBytes());
  t = NowNs();
  KVD_RETURN_IF_ERROR(release_both());
  KVD_RETURN_IF_ERROR(WaitFree(before, raw.plan().bytes()));
  add("shrink", MsSince(t));
  return child_->Call("raw-detach").status();
}

// The same cycle in this process with an in-process peer's allocations: every allocation created, then
// every one mapped with access set (grow, attach and grow_mapped are those two halves and their sum);
// unmapped and released one after the other, then the free-count wait (sleep, shrink); created and
// mapped again (wake is the creates, wake_mapped both).
absl::Status Bench::InProcessCycle(InProcessSide& side, bool paused, bool record) {
  const std::string variant = paused ? "after_pause" : "after_release";
  auto add = [&](const char* op, double ms) {
    if (record) GetLine(op, variant).PeerNamed(side.name).ms.push_back(ms);
  };
  auto pause = [&] {
    if (paused) Pause();
  };
  InProcess& d = *in_process_;
  auto allocate = [&](const char* create_op, const char* map_op, const char* both_op) -> absl::Status {
    const int64_t t = NowNs();
    for (const PlanChunk& a : side.plan.chunks) {
      KVD_ASSIGN_OR_RETURN(const uint64_t handle, d.Create(a.bytes));
      side.handles.push_back(handle);
    }
    const int64_t created = NowNs();
    for (; side.mapped < side.handles.size(); ++side.mapped) {
      const PlanChunk& a = side.plan.chunks[side.mapped];
      KVD_RETURN_IF_ERROR(d.Map(side.va + a.offset, side.handles[side.mapped], a.bytes));
    }
    const int64_t mapped = NowNs();
    add(create_op, Between(t, created));
    if (map_op != nullptr) add(map_op, Between(created, mapped));
    add(both_op, Between(t, mapped));
    return absl::OkStatus();
  };
  auto release = [&](const char* op) -> absl::Status {
    KVD_ASSIGN_OR_RETURN(const uint64_t before, FreeBytes());
    const int64_t t = NowNs();
    KVD_RETURN_IF_ERROR(ReleaseInProcess(side));
    KVD_RETURN_IF_ERROR(WaitFree(before, side.plan.bytes()));
    add(op, MsSince(t));
    return absl::OkStatus();
  };
  if (side.va == 0) {
    KVD_ASSIGN_OR_RETURN(side.va, d.Reserve(side.plan.reserve_bytes));
  }
  pause();
  KVD_RETURN_IF_ERROR(allocate("grow", "attach", "grow_mapped"));
  pause();
  KVD_RETURN_IF_ERROR(release("sleep"));
  pause();
  KVD_RETURN_IF_ERROR(allocate("wake", nullptr, "wake_mapped"));
  pause();
  return release("shrink");
}

// Unmaps and releases the side's allocations one after the other (as torch_memory_saver pauses); the
// reservation stays.
absl::Status Bench::ReleaseInProcess(InProcessSide& side) {
  for (size_t i = 0; i < side.handles.size(); ++i) {
    if (i < side.mapped) {
      KVD_RETURN_IF_ERROR(in_process_->Unmap(side.va + side.plan.chunks[i].offset, side.plan.chunks[i].bytes));
    }
    KVD_RETURN_IF_ERROR(in_process_->Release(side.handles[i]));
  }
  side.handles.clear();
  side.mapped = 0;
  return absl::OkStatus();
}

// N grows of 1/N each, then a second process attaches: N chunks per segment.
absl::Status Bench::Fragmented() {
  KVD_ASSIGN_OR_RETURN(PoolInfo pool, CreatePool("frag", blocks_));
  const std::string name = pool.name;
  auto kvd_round = [&](bool record) -> absl::StatusOr<PoolInfo> {
    Pause();
    int64_t t = NowNs();
    for (int k = 1; k <= fragments_; ++k) KVD_RETURN_IF_ERROR(client_->Grow(name, blocks_ * k / fragments_).status());
    if (record) GetLine("fragmented_grow", "after_pause").kvd.push_back(MsSince(t));
    KVD_ASSIGN_OR_RETURN(PoolInfo grown, client_->GetPool(name));
    Pause();
    const std::string attach = absl::StrCat("kvd-attach ", socket_, " ", name, " ", grown.committed_bytes);
    t = NowNs();
    KVD_RETURN_IF_ERROR(SendWithFds(child_->socket(), attach, {}));
    KVD_ASSIGN_OR_RETURN(double ms, child_->TimedReply(attach, t));
    if (record) GetLine("fragmented_attach", "after_pause").kvd.push_back(ms);
    KVD_RETURN_IF_ERROR(child_->Call("kvd-detach").status());
    KVD_ASSIGN_OR_RETURN(const uint64_t before, FreeBytes());
    KVD_RETURN_IF_ERROR(client_->Shrink(name, 0, true).status());
    KVD_RETURN_IF_ERROR(WaitFree(before, grown.committed_bytes));
    return grown;
  };
  KVD_ASSIGN_OR_RETURN(PoolInfo grown, kvd_round(false));  // warm-up, and the chunk plan
  RawExporter raw(raw_.get(), PlanOf(grown));
  auto raw_round = [&]() -> absl::Status {
    KVD_RETURN_IF_ERROR(raw.Reserve());
    Pause();
    int64_t t = NowNs();
    KVD_RETURN_IF_ERROR(raw.Grow());
    GetLine("fragmented_grow", "after_pause").base.push_back(MsSince(t));
    Pause();
    t = NowNs();
    KVD_RETURN_IF_ERROR(raw.SendAttach(*child_));
    KVD_ASSIGN_OR_RETURN(double ms, child_->TimedReply("raw-attach", t));
    GetLine("fragmented_attach", "after_pause").base.push_back(ms);
    KVD_RETURN_IF_ERROR(child_->Call("raw-detach").status());
    KVD_ASSIGN_OR_RETURN(const uint64_t before, FreeBytes());
    KVD_RETURN_IF_ERROR(raw.Release());
    return WaitFree(before, raw.plan().bytes());
  };
  for (int rep = 0; rep < o_.reps; ++rep) {
    if (rep % 2 == 0) {
      KVD_RETURN_IF_ERROR(kvd_round(true).status());
      KVD_RETURN_IF_ERROR(raw_round());
    } else {
      KVD_RETURN_IF_ERROR(raw_round());
      KVD_RETURN_IF_ERROR(kvd_round(true).status());
    }
  }
  const std::string note = absl::StrFormat("%d grows, %d chunks", fragments_, grown.chunks.size());
  GetLine("fragmented_grow", "after_pause").note = note;
  GetLine("fragmented_attach", "after_pause").note = note;
  return client_->DeletePool(name, true).status();
}

// The largest pool of at most `want` bytes whose reshape fits in the device's free memory now: a reshape
// holds the old chunks and their replacements at once (every client maps the old ones until it resumes),
// so `peak` times the pool must fit, less 4 GiB on a GPU for the three processes' contexts. Whole
// granules per segment; 0 when not even one fits.
absl::StatusOr<uint64_t> Bench::ReshapeBytes(uint64_t want, double peak) {
  KVD_ASSIGN_OR_RETURN(const uint64_t free, FreeBytes());
  const uint64_t reserve = gpu_ ? uint64_t{4} << 30 : 0;
  const uint64_t fits = free > reserve ? static_cast<uint64_t>((free - reserve) / peak) : 0;
  const uint64_t unit = segments_ * daemon_.granularity_bytes;
  return std::min(want, fits) / unit * unit;
}

// The bare calls of a reshape, from the chunk plan `from` to the plan `to` (the same reservation). First,
// untimed: `from` is created, mapped and exported at a reservation, then the pause. Timed: every chunk
// of `to` that is not also in `from` (same offset and size) is created, mapped into a scratch reservation
// and exported (create_map); its bytes are copied there from the pool's address on the device, one
// Device::CopyRange per new chunk, across the old chunks it spans (copy); every chunk of `from` not in
// `to` is unmapped, released and its FD closed (release_old); the new chunks are unmapped from the
// scratch reservation and mapped at the pool's address (remap); then the free count must have risen by
// the bytes given back (free_wait). Everything is released after, untimed.
absl::StatusOr<ReshapeTimes> Bench::RawReshape(const Plan& from, const Plan& to) {
  Device& d = *raw_;
  struct Held {
    PlanChunk at;
    Chunk chunk;
    int fd = -1;
    uint64_t mapped_va = 0;  // 0: not mapped
    bool live = false;
  };
  std::vector<Held> old_chunks, new_chunks;
  uint64_t pool_va = 0, scratch_va = 0;
  auto drop = [&](Held& h) -> absl::Status {
    if (h.mapped_va != 0) KVD_RETURN_IF_ERROR(d.Unmap(h.mapped_va, h.at.bytes));
    h.mapped_va = 0;
    if (h.fd >= 0) close(h.fd);
    h.fd = -1;
    if (h.live) KVD_RETURN_IF_ERROR(d.Release(h.chunk));
    h.live = false;
    return absl::OkStatus();
  };
  absl::Cleanup undo = [&] {
    for (Held& h : new_chunks) drop(h).IgnoreError();
    for (Held& h : old_chunks) drop(h).IgnoreError();
    if (pool_va != 0) d.Free(pool_va, from.reserve_bytes).IgnoreError();
    if (scratch_va != 0) d.Free(scratch_va, to.reserve_bytes).IgnoreError();
  };
  auto create = [&](const PlanChunk& c, uint64_t va, Held& h) -> absl::Status {
    h.at = c;
    KVD_ASSIGN_OR_RETURN(h.chunk, d.Create(c.bytes));
    h.live = true;
    KVD_RETURN_IF_ERROR(d.Map(va + c.offset, h.chunk, Access::kReadWrite));
    h.mapped_va = va + c.offset;
    KVD_ASSIGN_OR_RETURN(h.fd, d.Export(h.chunk));
    return absl::OkStatus();
  };
  auto same = [](const PlanChunk& a, const PlanChunk& b) { return a.offset == b.offset && a.bytes == b.bytes; };
  auto in = [&](const Plan& plan, const PlanChunk& c) {
    return std::any_of(plan.chunks.begin(), plan.chunks.end(), [&](const PlanChunk& o) { return same(o, c); });
  };
  KVD_ASSIGN_OR_RETURN(pool_va, d.Reserve(from.reserve_bytes));
  KVD_ASSIGN_OR_RETURN(scratch_va, d.Reserve(to.reserve_bytes));
  old_chunks.resize(from.chunks.size());
  for (size_t i = 0; i < from.chunks.size(); ++i) KVD_RETURN_IF_ERROR(create(from.chunks[i], pool_va, old_chunks[i]));
  std::vector<PlanChunk> added;
  for (const PlanChunk& c : to.chunks) {
    if (!in(from, c)) added.push_back(c);
  }
  uint64_t given_back = 0;
  for (const PlanChunk& c : from.chunks) given_back += in(to, c) ? 0 : c.bytes;
  for (const PlanChunk& c : added) given_back -= std::min(given_back, c.bytes);
  Pause();
  KVD_ASSIGN_OR_RETURN(const uint64_t free_before, FreeBytes());

  ReshapeTimes times;
  int64_t t = NowNs();
  new_chunks.resize(added.size());
  for (size_t i = 0; i < added.size(); ++i) KVD_RETURN_IF_ERROR(create(added[i], scratch_va, new_chunks[i]));
  times.create_map = MsSince(t);
  t = NowNs();
  for (const PlanChunk& c : added) KVD_RETURN_IF_ERROR(d.CopyRange(scratch_va + c.offset, pool_va + c.offset, c.bytes));
  times.copy = MsSince(t);
  t = NowNs();
  for (Held& h : old_chunks) {
    if (!in(to, h.at)) KVD_RETURN_IF_ERROR(drop(h));
  }
  times.release_old = MsSince(t);
  t = NowNs();
  for (Held& h : new_chunks) {
    KVD_RETURN_IF_ERROR(d.Unmap(h.mapped_va, h.at.bytes));
    h.mapped_va = 0;
    KVD_RETURN_IF_ERROR(d.Map(pool_va + h.at.offset, h.chunk, Access::kReadWrite));
    h.mapped_va = pool_va + h.at.offset;
  }
  times.remap = MsSince(t);
  t = NowNs();
  KVD_RETURN_IF_ERROR(WaitFree(free_before, given_back));
  times.free_wait = MsSince(t);

  KVD_ASSIGN_OR_RETURN(const uint64_t free_after, FreeBytes());
  std::move(undo).Invoke();
  KVD_RETURN_IF_ERROR(WaitFree(free_after, to.bytes()));
  return times;
}

// A pool of half of --bytes grown in --compact-grows equal steps (64 grows of 1 GiB over 80 segments on a
// GPU), a pausable Mapping of the second process attached and a pattern written through it, then
// Client::Compact; a fresh attach of the second process before and after, against the same pool grown
// once; the Compact against the bare calls of the same reshape.
absl::Status Bench::Compact() {
  const std::string variant = absl::StrCat(compact_grows_, "_grows");
  Line& compact = GetLine("compact", variant);
  Line& pause = GetLine("compact_pause", variant);
  Line& before = GetLine("compact_attach", "before_compact");
  Line& after = GetLine("compact_attach", "after_compact");
  compact.kvd_what = "Client::Compact with a pausable Mapping of the second process attached, then the free-count wait";
  compact.base_what =
      "raw: create + map + export the compacted chunks, CopyRange the bytes, unmap + release the old chunks, map "
      "the new ones at the pool's address, free-count wait";
  pause.kvd_what =
      "the Compact reply's reshape.max_pause_us: the longest pause of its steps (the daemon's "
      "--compact-chunks-per-pause)";
  pause.base_what = "raw: the CopyRange of the same bytes alone";
  pause.ratio_means = "pause p50 / raw copy p50";
  before.kvd_what = "a fresh attach of the second process (as attach), the fragmented pool";
  after.kvd_what = "a fresh attach of the second process (as attach), the pool after Compact";
  before.base_what = after.base_what = "the same attach of a pool of the same size grown once";
  before.ratio_means = after.ratio_means = "kvd / grown once p50";
  after.target = "<= 1.5";
  KVD_ASSIGN_OR_RETURN(const uint64_t bytes, ReshapeBytes(bytes_ / 2, 2.0));
  const uint64_t blocks = bytes / (layers_ * kLayerBlockBytes);
  const uint64_t granule_blocks = daemon_.granularity_bytes / kLayerBlockBytes;
  if (blocks < static_cast<uint64_t>(compact_grows_) * granule_blocks) {
    const std::string why = absl::StrCat("the device's free memory holds no pool of ", compact_grows_,
                                         " granules per segment twice over (free now: ", FormatBytes(bytes), ")");
    for (Line* l : {&compact, &pause, &before, &after}) l->skipped = why;
    return absl::OkStatus();
  }
  compact_bytes_ = blocks * layers_ * kLayerBlockBytes;
  KVD_ASSIGN_OR_RETURN(const PoolInfo frag, CreatePool("compact", blocks));
  KVD_ASSIGN_OR_RETURN(const PoolInfo once, CreatePool("once", blocks));
  auto attach = [&](const std::string& pool, uint64_t committed, bool pausable) -> absl::StatusOr<double> {
    const std::string request =
        absl::StrCat("kvd-attach ", socket_, " ", pool, " ", committed, pausable ? " pausable" : "");
    const int64_t t = NowNs();
    KVD_RETURN_IF_ERROR(SendWithFds(child_->socket(), request, {}));
    return child_->TimedReply(request, t);
  };
  Plan fragmented, compacted;
  uint64_t seed = 0;
  std::string shape;
  auto kvd_round = [&](bool record) -> absl::Status {
    for (int k = 1; k <= compact_grows_; ++k) {
      KVD_RETURN_IF_ERROR(client_->Grow(frag.name, blocks * k / compact_grows_).status());
    }
    KVD_ASSIGN_OR_RETURN(const PoolInfo grown, client_->GetPool(frag.name));
    Pause();
    KVD_ASSIGN_OR_RETURN(const double before_ms, attach(frag.name, grown.committed_bytes, /*pausable=*/true));
    KVD_ASSIGN_OR_RETURN(const std::vector<std::string> written,
                         child_->Call(absl::StrCat("kvd-pattern-write ", ++seed)));
    Pause();
    KVD_ASSIGN_OR_RETURN(const uint64_t free_before, FreeBytes());
    const int64_t t = NowNs();
    KVD_ASSIGN_OR_RETURN(const PoolChange change,
                         client_->Compact(frag.name, {.max_chunks_per_pause = o_.compact_chunks_per_pause}));
    const int64_t replied = NowNs();
    KVD_RETURN_IF_ERROR(WaitFree(free_before, 0));  // the old chunks are gone, the new ones hold the same bytes
    const double ms = MsSince(t);
    if (!change.reshape.has_value()) return absl::InternalError("Compact replied without a reshape");
    const Reshape& r = *change.reshape;
    if (r.paused_clients < 1) {
      return absl::InternalError(absl::StrCat("Compact of ", frag.name, " paused no client (", r.chunks_before, " -> ",
                                              r.chunks_after, " chunks); the second process is pausable"));
    }
    KVD_ASSIGN_OR_RETURN(const PoolInfo done, client_->GetPool(frag.name));
    KVD_ASSIGN_OR_RETURN(
        const std::vector<std::string> checked,
        child_->Call(absl::StrCat("kvd-pattern-check ", grown.committed_bytes, " ", done.chunks.size())));
    if (written.empty() || checked.empty() || checked[0] != written[0]) {
      return absl::DataLossError(absl::StrCat("Compact: ", checked.empty() ? "?" : checked[0], " of ",
                                              written.empty() ? "?" : written[0], " pattern samples read back"));
    }
    if (Child::KeyValues(checked)["pauses"] != absl::StrCat(r.steps)) {
      return absl::InternalError(absl::StrCat("Compact: the second process's on_pause ran ",
                                              Child::KeyValues(checked)["pauses"], " times, not once for each of ",
                                              r.steps, " steps"));
    }
    KVD_RETURN_IF_ERROR(child_->Call("kvd-detach").status());
    Pause();
    KVD_ASSIGN_OR_RETURN(const double after_ms, attach(frag.name, done.committed_bytes, /*pausable=*/false));
    KVD_RETURN_IF_ERROR(child_->Call("kvd-detach").status());
    if (record) {
      compact.kvd.push_back(ms);
      AddPhase(compact.kvd_phases, "call", (replied - t) / 1e6);
      AddPhase(compact.kvd_phases, "pause", r.pause_us / 1e3);
      AddPhase(compact.kvd_phases, "longest_pause", r.max_pause_us / 1e3);
      AddPhase(compact.kvd_phases, "copy", r.copy_us / 1e3);
      AddPhase(compact.kvd_phases, "free_wait", ms - (replied - t) / 1e6);
      pause.kvd.push_back(r.max_pause_us / 1e3);
      before.kvd.push_back(before_ms);
      after.kvd.push_back(after_ms);
    } else {
      fragmented = PlanOf(grown);
      compacted = PlanOf(done);
      shape = absl::StrFormat(
          "%s, %d grows: %d -> %d chunks in %d steps, %s copied, %d client(s) paused, %s pattern samples",
          FormatBytes(done.committed_bytes), compact_grows_, r.chunks_before, r.chunks_after, r.steps,
          FormatBytes(r.copied_bytes), r.paused_clients, written[0]);
    }
    KVD_ASSIGN_OR_RETURN(const uint64_t free_now, FreeBytes());
    KVD_RETURN_IF_ERROR(client_->Shrink(frag.name, 0, true).status());
    return WaitFree(free_now, PlanOf(done).bytes());
  };
  auto once_round = [&](bool record) -> absl::Status {
    KVD_RETURN_IF_ERROR(client_->Grow(once.name, blocks).status());
    KVD_ASSIGN_OR_RETURN(const PoolInfo grown, client_->GetPool(once.name));
    Pause();
    KVD_ASSIGN_OR_RETURN(const double ms, attach(once.name, grown.committed_bytes, /*pausable=*/false));
    KVD_RETURN_IF_ERROR(child_->Call("kvd-detach").status());
    if (record) {
      before.base.push_back(ms);
      after.base.push_back(ms);
    }
    KVD_ASSIGN_OR_RETURN(const uint64_t free_now, FreeBytes());
    KVD_RETURN_IF_ERROR(client_->Shrink(once.name, 0, true).status());
    return WaitFree(free_now, PlanOf(grown).bytes());
  };
  auto raw_round = [&]() -> absl::Status {
    KVD_ASSIGN_OR_RETURN(const ReshapeTimes t, RawReshape(fragmented, compacted));
    compact.base.push_back(t.total());
    AddReshapePhases(compact.base_phases, t);
    pause.base.push_back(t.copy);
    return absl::OkStatus();
  };
  KVD_RETURN_IF_ERROR(kvd_round(false));  // warm-up, and both chunk plans
  KVD_RETURN_IF_ERROR(once_round(false));
  for (int rep = 0; rep < o_.reps; ++rep) {
    if (rep % 2 == 0) {
      KVD_RETURN_IF_ERROR(kvd_round(true));
      KVD_RETURN_IF_ERROR(once_round(true));
      KVD_RETURN_IF_ERROR(raw_round());
    } else {
      KVD_RETURN_IF_ERROR(raw_round());
      KVD_RETURN_IF_ERROR(once_round(true));
      KVD_RETURN_IF_ERROR(kvd_round(true));
    }
  }
  for (Line* l : {&compact, &pause, &before, &after}) l->note = shape;
  pause.note = absl::StrCat(shape, "; target: pause p50 <= 60 ms (issue 14, 50 GiB)");
  KVD_RETURN_IF_ERROR(client_->DeletePool(frag.name, true).status());
  return client_->DeletePool(once.name, true).status();
}

// A pool of --bytes grown once (one chunk per segment below --chunk), a pausable Mapping of the second
// process attached and a pattern written through it, shrunk to half its blocks: every chunk straddles the
// target and is replaced by one holding the kept bytes. Against the bare calls of the same reshape.
absl::Status Bench::ShrinkToHalf() {
  Line& l = GetLine("shrink_to_half", "once_grown");
  l.kvd_what =
      "Client::Shrink(half, wait) with a pausable Mapping of the second process attached, then the free-count wait";
  l.base_what =
      "raw: create + map + export the kept bytes' chunks, CopyRange the kept bytes, unmap + release the old chunks, "
      "map the new ones at the pool's address, free-count wait";
  l.target = "<= 1.2";
  KVD_ASSIGN_OR_RETURN(const uint64_t bytes, ReshapeBytes(bytes_, 1.5));
  const uint64_t blocks = bytes / (layers_ * kLayerBlockBytes);
  const uint64_t target = blocks / 2;
  if (target < daemon_.granularity_bytes / kLayerBlockBytes) {
    l.skipped = absl::StrCat(
        "the device's free memory holds no pool of two granules per segment and half of it "
        "again (free now: ",
        FormatBytes(bytes), ")");
    return absl::OkStatus();
  }
  shrink_bytes_ = blocks * layers_ * kLayerBlockBytes;
  KVD_ASSIGN_OR_RETURN(const PoolInfo pool, CreatePool("half", blocks));
  Plan grown_plan, shrunk_plan;
  uint64_t seed = 1000;
  auto kvd_round = [&](bool record) -> absl::Status {
    KVD_RETURN_IF_ERROR(client_->Grow(pool.name, blocks).status());
    KVD_ASSIGN_OR_RETURN(const PoolInfo grown, client_->GetPool(pool.name));
    KVD_RETURN_IF_ERROR(
        child_->Call(absl::StrCat("kvd-attach ", socket_, " ", pool.name, " ", grown.committed_bytes, " pausable"))
            .status());
    KVD_ASSIGN_OR_RETURN(const std::vector<std::string> written,
                         child_->Call(absl::StrCat("kvd-pattern-write ", ++seed)));
    const uint64_t given_back = grown_plan.bytes() - std::min(grown_plan.bytes(), shrunk_plan.bytes());
    Pause();
    KVD_ASSIGN_OR_RETURN(const uint64_t free_before, FreeBytes());
    const int64_t t = NowNs();
    KVD_ASSIGN_OR_RETURN(const PoolChange change, client_->Shrink(pool.name, target, ShrinkOptions{.wait = true}));
    const int64_t replied = NowNs();
    KVD_RETURN_IF_ERROR(WaitFree(free_before, given_back));
    const double ms = MsSince(t);
    if (!change.reshape.has_value()) return absl::InternalError("Shrink replied without a reshape");
    const Reshape& r = *change.reshape;
    if (!r.target_reached || r.paused_clients < 1) {
      return absl::InternalError(absl::StrCat("Shrink of ", pool.name, " to ", target, " blocks: target_reached ",
                                              r.target_reached, ", ", r.paused_clients, " client(s) paused, ",
                                              r.chunks_replaced, " chunk(s) replaced"));
    }
    KVD_ASSIGN_OR_RETURN(const PoolInfo shrunk, client_->GetPool(pool.name));
    KVD_ASSIGN_OR_RETURN(
        const std::vector<std::string> checked,
        child_->Call(absl::StrCat("kvd-pattern-check ", target * kLayerBlockBytes, " ", shrunk.chunks.size())));
    uint64_t n = 0;
    if (checked.empty() || !absl::SimpleAtoi(checked[0], &n) || n == 0) {
      return absl::DataLossError("Shrink: no pattern sample below the target was checked");
    }
    if (Child::KeyValues(checked)["pauses"] != "1") {
      return absl::InternalError(absl::StrCat("Shrink: the second process's on_pause ran ",
                                              Child::KeyValues(checked)["pauses"], " times, not once"));
    }
    KVD_RETURN_IF_ERROR(child_->Call("kvd-detach").status());
    if (record) {
      l.kvd.push_back(ms);
      AddPhase(l.kvd_phases, "call", (replied - t) / 1e6);
      AddPhase(l.kvd_phases, "pause", r.pause_us / 1e3);
      AddPhase(l.kvd_phases, "copy", r.copy_us / 1e3);
      AddPhase(l.kvd_phases, "free_wait", ms - (replied - t) / 1e6);
    } else {
      grown_plan = PlanOf(grown);
      shrunk_plan = PlanOf(shrunk);
      l.note = absl::StrFormat(
          "%s -> %s (%d -> %d blocks), %d chunk(s) replaced, %s copied, %d client(s) paused, %d of %s pattern "
          "samples below the target checked",
          FormatBytes(grown.committed_bytes), FormatBytes(shrunk.committed_bytes), blocks, shrunk.committed_blocks,
          r.chunks_replaced, FormatBytes(r.copied_bytes), r.paused_clients, n, written.empty() ? "?" : written[0]);
      if (shrink_bytes_ < bytes_) {
        absl::StrAppend(&l.note, "; the pool is ", FormatBytes(shrink_bytes_), ", not --bytes ", FormatBytes(bytes_),
                        ": the old chunks and their replacements must fit at once");
      }
    }
    KVD_ASSIGN_OR_RETURN(const uint64_t free_now, FreeBytes());
    KVD_RETURN_IF_ERROR(client_->Shrink(pool.name, 0, true).status());
    return WaitFree(free_now, PlanOf(shrunk).bytes());
  };
  auto raw_round = [&]() -> absl::Status {
    KVD_ASSIGN_OR_RETURN(const ReshapeTimes t, RawReshape(grown_plan, shrunk_plan));
    l.base.push_back(t.total());
    AddReshapePhases(l.base_phases, t);
    return absl::OkStatus();
  };
  KVD_RETURN_IF_ERROR(kvd_round(false));  // warm-up, and both chunk plans
  for (int rep = 0; rep < o_.reps; ++rep) {
    if (rep % 2 == 0) {
      KVD_RETURN_IF_ERROR(kvd_round(true));
      KVD_RETURN_IF_ERROR(raw_round());
    } else {
      KVD_RETURN_IF_ERROR(raw_round());
      KVD_RETURN_IF_ERROR(kvd_round(true));
    }
  }
  return client_->DeletePool(pool.name, true).status();
}

namespace {

// Calls `fn` with the /proc directory of each live thread of process `pid`; none when it cannot be read.
template <typename Fn>
void ForEachThread(pid_t pid, Fn fn) {
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/task"), ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    fn(it->path());
  }
}

// The threads of process `pid`; 0 when it cannot be read.
size_t ThreadsOf(pid_t pid) {
  size_t n = 0;
  ForEachThread(pid, [&](const std::filesystem::path&) { ++n; });
  return n;
}

// The CPU time process `pid` has used (user + system, /proc/<pid>/stat), in ms; -1 when it cannot be read.
double CpuMs(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t end = stat.rfind(')');  // the command may hold spaces
  if (end == std::string::npos) return -1;
  const std::vector<std::string> fields = absl::StrSplit(stat.substr(end + 2), ' ');
  uint64_t user = 0, system = 0;
  if (fields.size() < 13 || !absl::SimpleAtoi(fields[11], &user) || !absl::SimpleAtoi(fields[12], &system)) return -1;
  return (user + system) * 1e3 / sysconf(_SC_CLK_TCK);
}

// The threads of process `pid` named `name` (their comm, as gRPC names its own), and the voluntary context
// switches of its live threads (each a wait for another thread or the kernel; a thread that exits takes its
// count with it, so it is read only across calls served by threads that stay); 0 when they cannot be read.
size_t ThreadsNamed(pid_t pid, absl::string_view name) {
  size_t n = 0;
  ForEachThread(pid, [&](const std::filesystem::path& task) {
    std::ifstream in(task / "comm");
    std::string comm;
    std::getline(in, comm);
    n += comm == name ? 1 : 0;
  });
  return n;
}
uint64_t VoluntarySwitches(pid_t pid) {
  uint64_t n = 0;
  ForEachThread(pid, [&](const std::filesystem::path& task) {
    std::ifstream in(task / "status");
    for (std::string line; std::getline(in, line);) {
      absl::string_view rest = line;
      uint64_t v = 0;
      if (absl::ConsumePrefix(&rest, "voluntary_ctxt_switches:") && absl::SimpleAtoi(rest, &v)) n += v;
    }
  });
  return n;
}

}  // namespace

// GetPool of a small pool through libkvd against a bare gRPC server answering the same method; the idle line's
// note counts the daemon's context switches per call. Then informative lines take the difference apart, from
// batches of four kinds of call: libkvd's GetPool, the same GetPool through a plain gRPC stub on kvd's socket, a
// second bare server (in the second process, started after the idle line) answering with kvd's own reply, and
// the bare server. Their ratios chain: libkvd / stub (what the client library adds), stub / bare with kvd's
// reply (what the daemon adds over a synchronous server sending the same bytes), bare with kvd's reply / bare
// (what the reply's size costs gRPC alone). Last, a third bare server with a callback method (MixedPingService,
// kvd's shape before Note [No callback API]: gRPC starts its callback threads in the second process) against the
// second, both with kvd's reply: what the callback API costs a call (idle_server), and what its threads cost the
// synchronous server beside them (callback_threads, the second server's p50 now against before).
absl::Status Bench::ControlRpc() {
  KVD_ASSIGN_OR_RETURN(PoolInfo ctl, CreatePool("ctl", 1));
  const std::string ping_path = absl::StrCat("/tmp/kvd-bench-ping-", getpid(), ".sock");
  const std::string sized_path = absl::StrCat("/tmp/kvd-bench-ping-", getpid(), "-sized.sock");
  const std::string mixed_path = absl::StrCat("/tmp/kvd-bench-ping-", getpid(), "-mixed.sock");
  for (const std::string& path : {ping_path, sized_path, mixed_path}) unlink(path.c_str());
  KVD_RETURN_IF_ERROR(child_->Call(absl::StrCat("ping-serve ", ping_path)).status());
  absl::Cleanup unlink_ping = [&] {
    for (const std::string& path : {ping_path, sized_path, mixed_path}) unlink(path.c_str());
  };
  const auto channel = [](const std::string& path) {
    return kvd::v1::Kvd::NewStub(grpc::CreateChannel(absl::StrCat("unix:", path), grpc::InsecureChannelCredentials()));
  };
  std::unique_ptr<kvd::v1::Kvd::Stub> stub = channel(ping_path);
  // One GetPool of `ctl` on `on`, with the session's metadata when `token` is set.
  auto unary = [&](kvd::v1::Kvd::Stub& on, const char* what, const std::string* token,
                   kvd::v1::Pool* reply) -> absl::Status {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    if (token != nullptr) context.AddMetadata(wire::kSessionMetadataKey, *token);
    kvd::v1::GetPoolRequest request;
    request.set_name(ctl.name);
    grpc::Status s = on.GetPool(&context, request, reply);
    if (!s.ok()) return absl::UnavailableError(absl::StrCat(what, ": ", s.error_message()));
    return absl::OkStatus();
  };
  // A call of GetPool on `on` (with the session's token when `token` is set), as a kind of call to time.
  auto call_on = [&](kvd::v1::Kvd::Stub* on, const char* what, const std::string* token) {
    return [&unary, on, what, token]() -> absl::Status {
      kvd::v1::Pool reply;
      return unary(*on, what, token, &reply);
    };
  };
  auto ping = call_on(stub.get(), "bare ping", nullptr);
  auto get = [&]() -> absl::Status { return client_->GetPool(ctl.name).status(); };
  const int calls = o_.rpc_calls;
  for (int i = 0; i < 50; ++i) {
    KVD_RETURN_IF_ERROR(ping());
    KVD_RETURN_IF_ERROR(get());
  }
  Line& idle = GetLine("control_rpc", "idle");
  idle.kvd_what = "libkvd GetPool";
  idle.base_what = "bare gRPC unary (GetPool of a trivial server, second process)";
  idle.ratio_means = "kvd/bare p50";
  const uint64_t switches_before = daemon_pid_ > 0 ? VoluntarySwitches(daemon_pid_) : 0;
  const uint64_t bare_switches_before = VoluntarySwitches(child_->pid());
  for (int batch = 0; batch < calls; batch += 100) {
    for (const bool is_kvd : {batch % 200 == 0, batch % 200 != 0}) {  // alternate which goes first
      for (int i = 0; i < 100; ++i) {
        const int64_t t = NowNs();
        KVD_RETURN_IF_ERROR(is_kvd ? get() : ping());
        (is_kvd ? idle.kvd : idle.base).push_back(MsSince(t));
      }
    }
  }
  if (daemon_pid_ > 0) {
    idle.note = absl::StrFormat(
        "voluntary context switches per call: the daemon %.1f, the bare server's process %.1f; %d of gRPC's "
        "callback threads (nexting_thread) in the daemon",
        static_cast<double>(VoluntarySwitches(daemon_pid_) - switches_before) / idle.kvd.size(),
        static_cast<double>(VoluntarySwitches(child_->pid()) - bare_switches_before) / idle.base.size(),
        ThreadsNamed(daemon_pid_, "nexting_thread"));
  }
  // Runs `kinds` in batches of 100, each kind in turn and a different one first each round.
  using Kinds = std::vector<std::pair<std::function<absl::Status()>, std::vector<double>*>>;
  auto batches = [&](const Kinds& kinds) -> absl::Status {
    for (int batch = 0; batch < calls; batch += 100) {
      for (size_t k = 0; k < kinds.size(); ++k) {
        const auto& [call, samples] = kinds[(k + batch / 100) % kinds.size()];
        for (int i = 0; i < 100; ++i) {
          const int64_t t = NowNs();
          KVD_RETURN_IF_ERROR(call());
          samples->push_back(MsSince(t));
        }
      }
    }
    return absl::OkStatus();
  };

  // Where the difference goes: a plain stub on kvd's socket, and a bare server answering with kvd's reply,
  // while the second process serves synchronous methods only.
  KVD_ASSIGN_OR_RETURN(HandleSession session, HandleSession::Open(wire::HandlesPathFor(socket_), "stub"));
  std::unique_ptr<kvd::v1::Kvd::Stub> direct = channel(socket_);
  kvd::v1::Pool kvd_reply;
  KVD_RETURN_IF_ERROR(unary(*direct, "GetPool on kvd's socket", &session.token(), &kvd_reply));
  const std::string reply64 = absl::Base64Escape(kvd_reply.SerializeAsString());
  KVD_RETURN_IF_ERROR(child_->Call(absl::StrCat("ping-serve ", sized_path, " ", reply64)).status());
  std::unique_ptr<kvd::v1::Kvd::Stub> sized = channel(sized_path);
  auto stub_get = call_on(direct.get(), "GetPool on kvd's socket", &session.token());
  auto sized_ping = call_on(sized.get(), "bare ping with kvd's reply", nullptr);
  for (int i = 0; i < 50; ++i) {
    KVD_RETURN_IF_ERROR(stub_get());
    KVD_RETURN_IF_ERROR(sized_ping());
  }
  std::vector<double> libkvd, stubbed, bare_sized, bare;
  KVD_RETURN_IF_ERROR(batches({{get, &libkvd}, {stub_get, &stubbed}, {sized_ping, &bare_sized}, {ping, &bare}}));
  // Then the second process also serves a callback method: gRPC starts its callback threads there, and the
  // synchronous server with kvd's reply is measured again beside it.
  const size_t child_callback_threads = ThreadsNamed(child_->pid(), "nexting_thread");
  KVD_RETURN_IF_ERROR(child_->Call(absl::StrCat("ping-serve-mixed ", mixed_path, " ", reply64)).status());
  std::unique_ptr<kvd::v1::Kvd::Stub> mixed = channel(mixed_path);
  auto mixed_ping = call_on(mixed.get(), "callback ping with kvd's reply", nullptr);
  for (int i = 0; i < 50; ++i) {
    KVD_RETURN_IF_ERROR(sized_ping());
    KVD_RETURN_IF_ERROR(mixed_ping());
  }
  std::vector<double> bare_sized_beside, mixed_sized;
  KVD_RETURN_IF_ERROR(batches({{sized_ping, &bare_sized_beside}, {mixed_ping, &mixed_sized}}));

  Line& client_share = GetLine("control_rpc", "idle_client");
  client_share.kvd_what = "libkvd GetPool";
  client_share.base_what = "the same GetPool through a plain gRPC stub on kvd's socket";
  client_share.ratio_means = "libkvd/stub p50";
  client_share.kvd = libkvd;
  client_share.base = stubbed;
  Line& daemon_share = GetLine("control_rpc", "idle_daemon");
  daemon_share.kvd_what = "GetPool through a plain gRPC stub on kvd's socket";
  daemon_share.base_what = "a bare synchronous server answering with kvd's reply";
  daemon_share.ratio_means = "stub/bare-with-kvd's-reply p50";
  daemon_share.kvd = stubbed;
  daemon_share.base = bare_sized;
  Line& reply_share = GetLine("control_rpc", "idle_reply");
  reply_share.kvd_what = "a bare server answering with kvd's reply";
  reply_share.base_what = "the bare server";
  reply_share.ratio_means = "bare-with-kvd's-reply/bare p50";
  reply_share.kvd = bare_sized;
  reply_share.base = bare;
  reply_share.note =
      absl::StrFormat("kvd's reply %d bytes, the bare one %d", kvd_reply.ByteSizeLong(), 2 + ctl.name.size());
  Line& server_share = GetLine("control_rpc", "idle_server");
  server_share.kvd_what =
      "a bare server with GetPool on gRPC's callback API beside synchronous methods (kvd's shape before it left "
      "that API) with kvd's reply";
  server_share.base_what = "a bare synchronous server answering with kvd's reply, in the same process";
  server_share.ratio_means = "callback/synchronous p50";
  server_share.kvd = mixed_sized;
  server_share.base = bare_sized_beside;
  Line& threads_share = GetLine("control_rpc", "callback_threads");
  threads_share.kvd_what = "a bare synchronous server with kvd's reply, its process also serving a callback method";
  threads_share.base_what = "the same server before its process served one";
  threads_share.ratio_means = "after/before p50";
  threads_share.kvd = bare_sized_beside;
  threads_share.base = bare_sized;
  threads_share.note = absl::StrFormat("the second process's gRPC callback threads (nexting_thread): %d -> %d",
                                       child_callback_threads, ThreadsNamed(child_->pid(), "nexting_thread"));

  // During grows of another pool (the main one, to the full size): only calls that start inside a
  // Grow count.
  KVD_ASSIGN_OR_RETURN(std::unique_ptr<Client> grower, Client::Connect({.socket = socket_, .client_name = "grower"}));
  std::vector<std::pair<int64_t, int64_t>> grows;
  std::atomic<bool> done{false};
  absl::Status grower_status;
  std::thread thread([&] {
    grower_status = [&]() -> absl::Status {
      for (int i = 0; i < std::max(o_.reps, 3); ++i) {
        Pause();
        const int64_t t = NowNs();
        KVD_RETURN_IF_ERROR(grower->Grow(pool_, blocks_).status());
        grows.emplace_back(t, NowNs());
        KVD_ASSIGN_OR_RETURN(const uint64_t before, FreeBytes());
        KVD_RETURN_IF_ERROR(grower->Shrink(pool_, 0, true).status());
        KVD_RETURN_IF_ERROR(WaitFree(before, pool_bytes_));
      }
      return absl::OkStatus();
    }();
    done = true;
  });
  std::vector<std::pair<int64_t, double>> samples;
  absl::Status s;
  while (!done && s.ok()) {
    const int64_t t = NowNs();
    s = get();
    samples.emplace_back(t, MsSince(t));
  }
  thread.join();
  KVD_RETURN_IF_ERROR(s);
  KVD_RETURN_IF_ERROR(grower_status);
  Line& during = GetLine("control_rpc", "during_grow");
  during.kvd_what = absl::StrCat("libkvd GetPool while another pool grows ", FormatBytes(pool_bytes_));
  during.base_what = "libkvd GetPool idle";
  during.ratio_means = "p99 during / p99 idle";
  during.base = idle.kvd;
  for (const auto& [start, ms] : samples) {
    for (const auto& [from, to] : grows) {
      if (start >= from && start < to) {
        during.kvd.push_back(ms);
        break;
      }
    }
  }
  if (during.kvd.empty()) during.skipped = "no call started during a grow (grows too short to sample)";
  during.note = absl::StrFormat("%d calls during %d grows", during.kvd.size(), grows.size());
  during.ratio = P99(during.kvd) / P99(during.base);
  KVD_RETURN_IF_ERROR(ControlRpcWithWatchers(ctl.name, idle.kvd));
  return client_->DeletePool(ctl.name, true).status();
}

// Arbitration (docs/api.md, "Policy, waiting and reclaim"). Engine A (priority 0) holds --bytes (or what the
// device can back), grown in ten steps, 20% of its blocks live (every fifth, a pattern sampled in three of
// its segments); a filler pool of the highest priority takes whatever else the device could back. Engine B
// (priority 10) asks for 40% of A with GrowRequest.wait: kvd asks A, A's on_reclaim gives back with
// ShrinkForReclaim and its live blocks (a compaction shrink to a chunk boundary), B is admitted. Against
// the same moves by hand: an operator's ShrinkForReclaim of A to the same bytes, then B's Grow. Phases of
// the kvd line: to_ask (B's call -> A's hook called) and give_to_reply (A's compaction shrink until B's
// reply: B is admitted as soon as A's clients let go of the memory, before A's Shrink call returns; the
// hook's own time is in the note). A's sampled live bytes are checked after each round, wherever their
// blocks moved.
absl::Status Bench::Reclaim() {
  Line& l = GetLine("reclaim", "a_holds_the_device");
  l.kvd_what =
      "B's Grow(+40% of A, wait) with A (priority 0, 20% live) holding the device: kvd asks A, A's on_reclaim "
      "shrinks with its live blocks, B admitted";
  l.base_what = "by hand: an operator's ShrinkForReclaim of A to the same bytes, then B's Grow";
  l.target = "<= 1.2";
  if (!gpu_ && daemon_.budget_bytes > 4 * bytes_) {
    l.skipped =
        absl::StrCat("host: the filler would take the daemon's whole budget (", FormatBytes(daemon_.budget_bytes),
                     ") of the machine's memory; run with --budget of at most 4 x --bytes");
    return absl::OkStatus();
  }
  const uint64_t gran_blocks = std::max<uint64_t>(daemon_.granularity_bytes / kLayerBlockBytes, 1);
  KVD_ASSIGN_OR_RETURN(const DeviceStatus now, client_->DeviceInfo());
  const uint64_t a_bytes = std::min(bytes_, now.available_bytes);
  const uint64_t step = a_bytes / (segments_ * kLayerBlockBytes) / 10 / gran_blocks * gran_blocks;
  if (step == 0) {
    l.skipped =
        absl::StrCat("the device can back ", FormatBytes(now.available_bytes), ": not ten granules per segment for A");
    return absl::OkStatus();
  }
  const uint64_t a_blocks = 10 * step;
  const uint64_t b_blocks = 4 * step;  // 40% of A
  KVD_ASSIGN_OR_RETURN(std::unique_ptr<Reader> reader, Reader::Open(backend_, daemon_.device_index));
  KVD_ASSIGN_OR_RETURN(std::unique_ptr<Client> a_client,
                       Client::Connect({.socket = socket_, .client_name = "engine-a"}));
  KVD_ASSIGN_OR_RETURN(std::unique_ptr<Client> b_client,
                       Client::Connect({.socket = socket_, .client_name = "engine-b"}));
  std::vector<uint64_t> live;
  for (uint64_t b = 0; b < a_blocks; b += 5) live.push_back(b);
  std::vector<double> hook_ms;  // A's on_reclaim, call to return
  // A round: fresh pools, A full with its pattern; `by_hand` or kvd moves the memory; the pattern checked.
  auto round = [&](bool by_hand, bool record) -> absl::Status {
    const std::string a_name = prefix_ + "reclaim-a", b_name = prefix_ + "reclaim-b", f_name = prefix_ + "filler";
    PoolOptions a_opts{.name = a_name, .dims = kDims};
    a_opts.dims.layers = segments_;
    a_opts.dims.capacity_blocks = a_blocks;
    a_opts.layout.override_layout = "LBHNC";
    PoolOptions b_opts = a_opts, f_opts = a_opts;
    b_opts.name = b_name;
    b_opts.policy.priority = 10;
    f_opts.name = f_name;
    f_opts.policy.priority = 1000;
    f_opts.dims.capacity_blocks = std::max<uint64_t>(now.available_bytes / (segments_ * kLayerBlockBytes), 1);
    KVD_RETURN_IF_ERROR(client_->CreatePool(a_opts).status());
    pools_.push_back(a_name);
    KVD_RETURN_IF_ERROR(client_->CreatePool(b_opts).status());
    pools_.push_back(b_name);
    KVD_RETURN_IF_ERROR(client_->CreatePool(f_opts).status());
    pools_.push_back(f_name);
    // Set on libkvd's reclaim thread, read here once `hooked` says the hook is done.
    absl::Mutex hook_mu;
    bool hooked = false;
    int64_t hook_in = -1, hook_out = -1;
    std::map<uint64_t, uint64_t> moved;
    absl::Status answered;
    AttachOptions o{.client_name = "engine-a"};
    o.on_pause = [](const std::vector<ByteRange>&) {};  // the bench touches A only between rounds
    o.on_resume = [](bool) {};
    o.on_reclaim = [&](const ReclaimRequest& r) -> absl::Status {
      const int64_t in = NowNs();
      absl::StatusOr<PoolChange> change = a_client->ShrinkForReclaim(r, live);
      absl::MutexLock lock(&hook_mu);
      hook_in = in;
      hook_out = NowNs();
      answered = change.status();
      if (change.ok() && change->reshape.has_value()) {
        for (const BlockMove& m : change->reshape->moved_blocks) moved[m.src] = m.dst;
      }
      hooked = true;
      return change.status();
    };
    KVD_ASSIGN_OR_RETURN(std::unique_ptr<Mapping> a_map, a_client->Attach(a_name, o));
    for (uint64_t at = step; at <= a_blocks; at += step) KVD_RETURN_IF_ERROR(a_client->Grow(a_name, at).status());
    // The filler: all the device can back besides A, so that B's whole ask comes from A.
    KVD_ASSIGN_OR_RETURN(const DeviceStatus before, client_->DeviceInfo());
    const uint64_t fill =
        std::min<uint64_t>(before.available_bytes / (segments_ * kLayerBlockBytes) / gran_blocks * gran_blocks,
                           f_opts.dims.capacity_blocks);
    if (fill > 0) KVD_RETURN_IF_ERROR(client_->Grow(f_name, fill).status());
    // The pattern: 4 KiB at the start of sampled live blocks in the first, middle and last segment.
    const Geometry& g = a_map->geometry();
    const uint64_t base = reinterpret_cast<uint64_t>(a_map->base());
    std::vector<std::pair<uint64_t, uint64_t>> samples;  // (segment, block)
    for (uint64_t s : {uint64_t{0}, segments_ / 2, segments_ - 1}) {
      for (size_t i = 0; i < live.size(); i += std::max<size_t>(live.size() / 256, 1)) samples.push_back({s, live[i]});
    }
    const auto at = [&](uint64_t segment, uint64_t block) {
      return base + g.offset + segment * g.segment_stride + block * g.block_stride;
    };
    for (const auto& [seg, blk] : samples) {
      const std::vector<uint64_t> words = PatternBytes(seg * 1000003 + blk, 0);
      KVD_RETURN_IF_ERROR(reader->Write(at(seg, blk), words.data(), kSampleBytes));
    }
    Pause();
    const uint64_t asked = b_blocks * segments_ * kLayerBlockBytes;
    const int64_t t = NowNs();
    if (by_hand) {
      KVD_ASSIGN_OR_RETURN(const PoolChange change,
                           client_->ShrinkForReclaim(ReclaimRequest{.pool = a_name, .bytes = asked}, live));
      KVD_RETURN_IF_ERROR(b_client->Grow(b_name, b_blocks).status());
      if (change.reshape.has_value()) {
        for (const BlockMove& m : change.reshape->moved_blocks) moved[m.src] = m.dst;
      }
    } else {
      KVD_RETURN_IF_ERROR(
          b_client->Grow(b_name, b_blocks, WaitOptions{.wait = true, .wait_for = absl::Seconds(60)}).status());
    }
    const double ms = MsSince(t);
    const int64_t done = NowNs();
    if (!by_hand) {
      // B may be served a moment before A's hook returns (A's memory is free once it unmapped it).
      absl::MutexLock lock(&hook_mu);
      if (!hook_mu.AwaitWithTimeout(absl::Condition(&hooked), absl::Seconds(60))) {
        return absl::InternalError("B was served without A's on_reclaim having run");
      }
      KVD_RETURN_IF_ERROR(answered);
    }
    KVD_ASSIGN_OR_RETURN(const PoolInfo a_after, client_->GetPool(a_name));
    uint64_t checked = 0;
    for (const auto& [seg, blk] : samples) {
      auto it = moved.find(blk);
      const uint64_t now_at = it == moved.end() ? blk : it->second;
      std::vector<uint64_t> read(kSampleBytes / 8);
      KVD_RETURN_IF_ERROR(reader->Read(at(seg, now_at), read.data(), kSampleBytes));
      if (read != PatternBytes(seg * 1000003 + blk, 0)) {
        return absl::DataLossError(absl::StrCat("reclaim: A's live block ", blk, " (now ", now_at, ") of segment ", seg,
                                                " does not hold its pattern after the ",
                                                by_hand ? "shrink by hand" : "reclaim"));
      }
      ++checked;
    }
    if (record) {
      (by_hand ? l.base : l.kvd).push_back(ms);
      if (!by_hand) {
        AddPhase(l.kvd_phases, "to_ask", (hook_in - t) / 1e6);
        AddPhase(l.kvd_phases, "give_to_reply", (done - hook_in) / 1e6);
        hook_ms.push_back((hook_out - hook_in) / 1e6);
      }
    } else if (!by_hand) {
      l.note = absl::StrFormat(
          "A %s in %d chunks (%d blocks, %d live) -> %s; B asked %s; filler %s; %d live samples checked byte for "
          "byte after each round",
          FormatBytes(a_blocks * segments_ * kLayerBlockBytes), static_cast<int>(10 * segments_), a_blocks, live.size(),
          FormatBytes(a_after.committed_bytes), FormatBytes(asked), FormatBytes(fill * segments_ * kLayerBlockBytes),
          checked);
    }
    a_map.reset();
    for (const std::string& name : {b_name, f_name, a_name}) {
      KVD_RETURN_IF_ERROR(client_->DeletePool(name, true).status());
      pools_.erase(std::remove(pools_.begin(), pools_.end(), name), pools_.end());
    }
    return absl::OkStatus();
  };
  KVD_RETURN_IF_ERROR(round(false, false));  // warm-up
  for (int rep = 0; rep < o_.reps; ++rep) {
    KVD_RETURN_IF_ERROR(round(rep % 2 == 1, true));
    KVD_RETURN_IF_ERROR(round(rep % 2 == 0, true));
  }
  absl::StrAppend(&l.note,
                  absl::StrFormat("; A's on_reclaim (its Shrink, waiting for its release) p50 %.3f ms", P50(hook_ms)));
  return absl::OkStatus();
}

// Eight engines (priorities 0..7, each a Client of its own) grow their pools at once in steps of 1/64 of what
// the device can back, waiting up to 2 s each, until each one's grow fails: the device's free memory is
// taken to its headroom and the driver refuses nothing (every refusal is kvd's RESOURCE_EXHAUSTED).
absl::Status Bench::Saturate() {
  Line& l = GetLine("saturate", "8_engines");
  l.kvd_what = "8 engines growing at once with wait, until each is refused: wall time to saturation";
  l.base_what = "none (the figure is the count of driver out-of-memory errors: 0)";
  l.ratio_means = "driver out-of-memory errors";
  if (!gpu_ && daemon_.budget_bytes > 4 * bytes_) {
    l.skipped = absl::StrCat("host: saturating the daemon's budget (", FormatBytes(daemon_.budget_bytes),
                             ") would fill the machine's memory; run with --budget of at most 4 x --bytes");
    return absl::OkStatus();
  }
  const uint64_t gran_blocks = std::max<uint64_t>(daemon_.granularity_bytes / kLayerBlockBytes, 1);
  KVD_ASSIGN_OR_RETURN(const DeviceStatus start, client_->DeviceInfo());
  const uint64_t step =
      std::max<uint64_t>(start.available_bytes / 64 / (segments_ * kLayerBlockBytes) / gran_blocks, 1) * gran_blocks;
  const uint64_t capacity = 128 * step;
  std::vector<std::unique_ptr<Client>> engines;
  for (int i = 0; i < 8; ++i) {
    KVD_ASSIGN_OR_RETURN(std::unique_ptr<Client> c,
                         Client::Connect({.socket = socket_, .client_name = absl::StrCat("engine-", i)}));
    PoolOptions p{.name = absl::StrCat(prefix_, "sat-", i), .dims = kDims};
    p.dims.layers = segments_;
    p.dims.capacity_blocks = capacity;
    p.layout.override_layout = "LBHNC";
    p.policy.priority = static_cast<uint32_t>(i);
    KVD_RETURN_IF_ERROR(c->CreatePool(p).status());
    pools_.push_back(p.name);
    engines.push_back(std::move(c));
  }
  std::vector<std::thread> threads;
  std::vector<absl::Status> ends(engines.size());
  const int64_t t = NowNs();
  for (size_t i = 0; i < engines.size(); ++i) {
    threads.emplace_back([&, i] {
      const std::string name = absl::StrCat(prefix_, "sat-", i);
      for (uint64_t target = step; target <= capacity; target += step) {
        absl::Status s =
            engines[i]->Grow(name, target, WaitOptions{.wait = true, .wait_for = absl::Seconds(2)}).status();
        if (!s.ok()) {
          ends[i] = s;
          return;
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  l.kvd.push_back(MsSince(t));
  uint64_t other = 0;
  for (const absl::Status& s : ends) other += !s.ok() && !absl::IsResourceExhausted(s) ? 1 : 0;
  KVD_ASSIGN_OR_RETURN(const DeviceStatus end, client_->DeviceInfo());
  l.ratio = static_cast<double>(end.driver_out_of_memory - start.driver_out_of_memory);
  l.target = "0";
  l.note = absl::StrFormat(
      "%s committed of %s the device could back at the start, %s free at the end; %d engines "
      "refused with another code than RESOURCE_EXHAUSTED",
      FormatBytes(end.committed_bytes), FormatBytes(start.available_bytes), FormatBytes(end.free_bytes), other);
  for (size_t i = 0; i < engines.size(); ++i) {
    const std::string name = absl::StrCat(prefix_, "sat-", i);
    KVD_RETURN_IF_ERROR(client_->DeletePool(name, true).status());
    pools_.erase(std::remove(pools_.begin(), pools_.end(), name), pools_.end());
  }
  return absl::OkStatus();
}

// GetPool of the small pool while --watch-streams Watch streams are open (clients of another pool, in a
// session of their own, none reading), against GetPool idle: what open streams cost the daemon's other RPCs
// (Note [Watch streams are pushed] in docs/architecture.md). The note has the daemon's threads before and
// with the streams open, and the CPU time it spends in a second of idling with them open.
absl::Status Bench::ControlRpcWithWatchers(const std::string& pool, const std::vector<double>& idle) {
  const int n = o_.watch_streams;
  Line& line = GetLine("control_rpc", "watch_streams");
  line.kvd_what = absl::StrCat("libkvd GetPool with ", n, " Watch streams open");
  line.base_what = "libkvd GetPool idle";
  line.ratio_means = "kvd/idle p50";
  line.base = idle;
  KVD_ASSIGN_OR_RETURN(PoolInfo watched, CreatePool("watched", 1));
  absl::Cleanup delete_watched = [&] { client_->DeletePool(watched.name, true).IgnoreError(); };
  KVD_ASSIGN_OR_RETURN(HandleSession session, HandleSession::Open(wire::HandlesPathFor(socket_), "watchers"));
  std::unique_ptr<kvd::v1::Kvd::Stub> stub =
      kvd::v1::Kvd::NewStub(grpc::CreateChannel(absl::StrCat("unix:", socket_), grpc::InsecureChannelCredentials()));
  const auto context = [&session] {
    auto c = std::make_unique<grpc::ClientContext>();
    c->AddMetadata(wire::kSessionMetadataKey, session.token());
    return c;
  };
  const size_t threads_before = daemon_pid_ > 0 ? ThreadsOf(daemon_pid_) : 0;

  struct Stream {
    std::unique_ptr<grpc::ClientContext> context;
    std::unique_ptr<grpc::ClientAsyncReader<kvd::v1::PoolEvent>> reader;
    grpc::Status finished;
  };
  grpc::CompletionQueue cq;
  std::vector<Stream> streams(n);
  int pending = 0;  // operations started on `cq` and not yet completed
  const auto await = [&](int count) -> absl::Status {
    for (; count > 0; --count, --pending) {
      void* tag = nullptr;
      bool ok = false;
      if (cq.AsyncNext(&tag, &ok, std::chrono::system_clock::now() + std::chrono::seconds(30)) !=
          grpc::CompletionQueue::GOT_EVENT) {
        return absl::DeadlineExceededError("a Watch stream did not start within 30 s");
      }
      if (!ok) return absl::UnavailableError("a Watch stream failed to start");
    }
    return absl::OkStatus();
  };
  absl::Cleanup hang_up = [&] {
    for (Stream& st : streams) {
      if (st.reader == nullptr) continue;
      st.context->TryCancel();
      st.reader->Finish(&st.finished, &st);
      ++pending;
    }
    cq.Shutdown();
    void* tag;
    bool ok;
    while (cq.Next(&tag, &ok)) {
    }
  };
  for (Stream& st : streams) {
    kvd::v1::AttachRequest attach;
    attach.set_pool(watched.name);
    attach.set_client_name("watcher");
    kvd::v1::AttachResponse attached;
    auto attach_context = context();
    attach_context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    if (grpc::Status s = stub->Attach(attach_context.get(), attach, &attached); !s.ok()) {
      return absl::UnavailableError(absl::StrCat("attaching a watcher: ", s.error_message()));
    }
    kvd::v1::WatchRequest watch;
    watch.set_client_id(attached.client_id());
    st.context = context();
    st.reader = stub->PrepareAsyncWatch(st.context.get(), watch, &cq);
    st.reader->StartCall(&st);
    ++pending;
  }
  KVD_RETURN_IF_ERROR(await(n));
  // The daemon sends a stream's initial metadata once the stream is registered.
  for (Stream& st : streams) {
    st.reader->ReadInitialMetadata(&st);
    ++pending;
  }
  KVD_RETURN_IF_ERROR(await(n));
  if (daemon_pid_ > 0) {
    const size_t threads_open = ThreadsOf(daemon_pid_);
    const double cpu_before = CpuMs(daemon_pid_);
    absl::SleepFor(absl::Seconds(1));
    const double cpu_after = CpuMs(daemon_pid_);
    line.note = absl::StrFormat("daemon threads %d -> %d; %.0f ms CPU in 1 s idle with the streams open",
                                threads_before, threads_open, cpu_after - cpu_before);
  } else {
    line.note = "the daemon's threads and CPU: unknown (its pid is not known)";
  }
  for (int i = 0; i < o_.rpc_calls; ++i) {
    const int64_t t = NowNs();
    KVD_RETURN_IF_ERROR(client_->GetPool(pool).status());
    line.kvd.push_back(MsSince(t));
  }
  line.ratio = P50(line.kvd) / P50(line.base);
  return absl::OkStatus();
}

// N pools resized by N threads at once, against the same resizes one pool at a time.
absl::Status Bench::Concurrent() {
  const int n = o_.threads;
  const uint64_t blocks = blocks_ / n;
  std::vector<std::string> names;
  std::vector<std::unique_ptr<Client>> clients;
  for (int i = 0; i < n; ++i) {
    KVD_ASSIGN_OR_RETURN(PoolInfo p, CreatePool(absl::StrCat("conc", i), blocks));
    names.push_back(p.name);
    KVD_ASSIGN_OR_RETURN(std::unique_ptr<Client> c,
                         Client::Connect({.socket = socket_, .client_name = absl::StrCat("resizer-", i)}));
    clients.push_back(std::move(c));
  }
  auto each = [&](bool at_once, const std::function<absl::Status(int)>& fn) -> absl::StatusOr<double> {
    const int64_t t = NowNs();
    std::vector<absl::Status> results(n);
    if (at_once) {
      std::vector<std::thread> threads;
      for (int i = 0; i < n; ++i) threads.emplace_back([&, i] { results[i] = fn(i); });
      for (std::thread& th : threads) th.join();
    } else {
      for (int i = 0; i < n; ++i) results[i] = fn(i);
    }
    const double ms = MsSince(t);
    for (const absl::Status& s : results) KVD_RETURN_IF_ERROR(s);
    return ms;
  };
  Line& grow = GetLine("concurrent_resize_grow", absl::StrCat(n, "_pools"));
  Line& shrink = GetLine("concurrent_resize_shrink", absl::StrCat(n, "_pools"));
  for (Line* l : {&grow, &shrink}) {
    l->kvd_what = absl::StrCat(n, " threads, one pool each, at once");
    l->base_what = "the same resizes one pool at a time";
    l->ratio_means = "at once / one at a time";
  }
  auto round = [&](bool at_once) -> absl::Status {
    std::vector<uint64_t> committed(n);
    Pause();
    KVD_ASSIGN_OR_RETURN(double g, each(at_once, [&](int i) -> absl::Status {
                           KVD_ASSIGN_OR_RETURN(PoolChange c, clients[i]->Grow(names[i], blocks));
                           committed[i] = c.pool.committed_bytes;
                           return absl::OkStatus();
                         }));
    Pause();
    KVD_ASSIGN_OR_RETURN(const uint64_t before, FreeBytes());
    KVD_ASSIGN_OR_RETURN(double s,
                         each(at_once, [&](int i) { return clients[i]->Shrink(names[i], 0, true).status(); }));
    uint64_t bytes = 0;
    for (uint64_t c : committed) bytes += c;
    KVD_RETURN_IF_ERROR(WaitFree(before, bytes));
    (at_once ? grow.kvd : grow.base).push_back(g);
    (at_once ? shrink.kvd : shrink.base).push_back(s);
    return absl::OkStatus();
  };
  // The driver's own serialisation: the same chunk plans through kvd::Device on N threads of this process
  // (create + map + export, then unmap + release + close), at once against one at a time. kvd's ratio is
  // to be read against this one: kvd cannot be more parallel than the calls it makes.
  std::vector<std::unique_ptr<RawExporter>> raws;
  for (int i = 0; i < n; ++i) {
    KVD_RETURN_IF_ERROR(clients[i]->Grow(names[i], blocks).status());
    KVD_ASSIGN_OR_RETURN(PoolInfo grown, clients[i]->GetPool(names[i]));
    KVD_RETURN_IF_ERROR(clients[i]->Shrink(names[i], 0, true).status());
    raws.push_back(std::make_unique<RawExporter>(raw_.get(), PlanOf(grown)));
    KVD_RETURN_IF_ERROR(raws.back()->Reserve());
  }
  Line& raw_grow = GetLine("concurrent_raw_grow", absl::StrCat(n, "_pools"));
  Line& raw_shrink = GetLine("concurrent_raw_shrink", absl::StrCat(n, "_pools"));
  for (Line* l : {&raw_grow, &raw_shrink}) {
    l->kvd_what = absl::StrCat(n, " threads, raw device calls (the same chunk plans), at once");
    l->base_what = "the same raw calls one plan at a time (the driver's own serialisation; no kvd)";
    l->ratio_means = "at once / one at a time";
  }
  auto raw_round = [&](bool at_once) -> absl::Status {
    Pause();
    KVD_ASSIGN_OR_RETURN(double g, each(at_once, [&](int i) { return raws[i]->Grow(); }));
    Pause();
    KVD_ASSIGN_OR_RETURN(const uint64_t before, FreeBytes());
    KVD_ASSIGN_OR_RETURN(double s, each(at_once, [&](int i) { return raws[i]->Release(); }));
    uint64_t bytes = 0;
    for (const auto& r : raws) bytes += r->plan().bytes();
    KVD_RETURN_IF_ERROR(WaitFree(before, bytes));
    (at_once ? raw_grow.kvd : raw_grow.base).push_back(g);
    (at_once ? raw_shrink.kvd : raw_shrink.base).push_back(s);
    return absl::OkStatus();
  };
  for (int rep = 0; rep < o_.reps; ++rep) {
    KVD_RETURN_IF_ERROR(round(rep % 2 == 0));
    KVD_RETURN_IF_ERROR(round(rep % 2 != 0));
    KVD_RETURN_IF_ERROR(raw_round(rep % 2 == 0));
    KVD_RETURN_IF_ERROR(raw_round(rep % 2 != 0));
  }
  raws.clear();
  for (const std::string& name : names) KVD_RETURN_IF_ERROR(client_->DeletePool(name, true).status());
  return absl::OkStatus();
}

// The daemon's anonymous memory and FDs per chunk (a pool grown one granule per segment at a time)
// and per (empty) pool, as least-squares slopes; the same chunks through kvd::Device here for the
// driver's and device layer's own share.
// A sleep that keeps the contents and the wake that copies them back (Note [The host tier]), against the same
// bytes copied between mapped allocations and registered host memory in this process. The raw side's host buffer
// is at most 8 GiB, reused piece by piece (the copy rate to registered memory does not depend on which pages),
// so that kvd's tier and the baseline together fit a host whose memory is about twice the pool.
absl::Status Bench::Keep() {
  Line& sl = GetLine("sleep_keep", "whole_pool");
  Line& wl = GetLine("wake_keep", "whole_pool");
  if (o_.keep_bytes.empty()) {
    sl.skipped = wl.skipped = "needs --keep-bytes (kvd_bench then starts kvd with a host tier of that size)";
    return absl::OkStatus();
  }
  KVD_ASSIGN_OR_RETURN(const uint64_t keep, ParseBytes(o_.keep_bytes, "--keep-bytes"));
  const uint64_t g = daemon_.granularity_bytes;
  const uint64_t per_segment = keep / segments_ / g * g;  // whole granules: the pool's bytes fit the tier
  const uint64_t blocks = per_segment / (layers_ / segments_ * kLayerBlockBytes);
  if (blocks == 0) {
    return absl::InvalidArgumentError(absl::StrCat("--keep-bytes: ", FormatBytes(keep), " over ", segments_,
                                                   " segments is less than one granule per segment"));
  }
  // kvd: one chunk per segment (a single grow), no client attached: the sleep is the copy and the release.
  KVD_ASSIGN_OR_RETURN(PoolInfo pool, CreatePool("keep", blocks));
  KVD_RETURN_IF_ERROR(client_->Grow(pool.name, blocks).status());
  KVD_ASSIGN_OR_RETURN(pool, client_->GetPool(pool.name));
  const uint64_t bytes = pool.committed_bytes;
  // The tier is allocated and registered in the background after kvd starts: the line measures sleeps, not that.
  const absl::Time started = absl::Now();
  for (;;) {
    KVD_ASSIGN_OR_RETURN(const DeviceStatus d, client_->DeviceInfo());
    if (d.host_tier_ready) break;
    if (absl::Now() - started > absl::Minutes(5)) {
      return absl::DeadlineExceededError("the host tier was not ready 5 minutes after kvd started");
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  std::fprintf(stderr, "kvd_bench: keep: the host tier was ready %.1f s after the pool was grown\n",
               absl::ToDoubleSeconds(absl::Now() - started));
  sl.kvd_what = absl::StrCat("Sleep(keep) of ", FormatBytes(bytes), " as ", pool.chunks.size(),
                             " chunks until its reply: every byte copied to the host tier, the device memory released");
  wl.kvd_what = "Wake until its reply: one chunk per segment made, every byte copied back from the host tier";
  const uint64_t buffer_bytes = std::min<uint64_t>(bytes, uint64_t{8} << 30);
  sl.base_what = absl::StrCat("in this process: the same bytes copied from ", pool.chunks.size(),
                              " mapped allocations into ", FormatBytes(buffer_bytes),
                              " of registered memfd memory (pieces of at most 256 MiB, 4 threads), then unmapped and "
                              "released");
  wl.base_what = "the allocations created and mapped again, the bytes copied back from the registered memory";

  // The raw side's memory: the allocations' sizes are kvd's chunks', the host buffer registered once.
  UniqueFd fd(memfd_create("kvd-bench-keep", MFD_CLOEXEC));
  if (!fd.valid() || ftruncate(fd.get(), static_cast<off_t>(buffer_bytes)) != 0 ||
      fallocate(fd.get(), 0, 0, static_cast<off_t>(buffer_bytes)) != 0) {
    return ErrnoStatus(errno, "the keep line's host buffer");
  }
  void* host = mmap(nullptr, buffer_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (host == MAP_FAILED) return ErrnoStatus(errno, "mmap of the keep line's host buffer");
  absl::Cleanup unmap_host = [&] { munmap(host, buffer_bytes); };
  KVD_RETURN_IF_ERROR(raw_->RegisterHost(host, buffer_bytes));
  absl::Cleanup unregister = [&] { raw_->UnregisterHost(host).IgnoreError(); };
  KVD_ASSIGN_OR_RETURN(const uint64_t va, raw_->Reserve(bytes));
  absl::Cleanup free_va = [&] { raw_->Free(va, bytes).IgnoreError(); };
  std::vector<uint64_t> sizes;
  for (const ChunkInfo& c : pool.chunks) sizes.push_back(c.bytes);
  std::vector<Chunk> chunks;
  auto make = [&]() -> absl::Status {
    uint64_t at = 0;
    for (uint64_t size : sizes) {
      KVD_ASSIGN_OR_RETURN(Chunk c, raw_->Create(size));
      chunks.push_back(c);
      KVD_RETURN_IF_ERROR(raw_->Map(va + at, c, Access::kReadWrite));
      at += size;
    }
    return absl::OkStatus();
  };
  auto release = [&]() -> absl::Status {
    uint64_t at = 0;
    for (const Chunk& c : chunks) {
      KVD_RETURN_IF_ERROR(raw_->Unmap(va + at, c.bytes));
      KVD_RETURN_IF_ERROR(raw_->Release(c));
      at += c.bytes;
    }
    chunks.clear();
    return absl::OkStatus();
  };
  absl::Cleanup released = [&] { release().IgnoreError(); };
  // Every byte in pieces of at most 256 MiB within one allocation, by 4 threads, as the tier copies a pool's runs
  // (--host-tier-copy-threads' default); the host side wraps around the buffer.
  struct Piece {
    uint64_t va, host, bytes;
  };
  std::vector<Piece> pieces;
  for (uint64_t at = 0, i = 0; i < sizes.size(); at += sizes[i++]) {
    for (uint64_t done = 0; done < sizes[i];) {
      const uint64_t h = (at + done) % buffer_bytes;
      const uint64_t n = std::min({uint64_t{256} << 20, sizes[i] - done, buffer_bytes - h});
      pieces.push_back({va + at + done, h, n});
      done += n;
    }
  }
  auto copy = [&](bool to_host) -> absl::Status {
    std::atomic<size_t> next{0};
    absl::Mutex mu;
    absl::Status first;
    auto work = [&] {
      for (size_t i = next.fetch_add(1); i < pieces.size(); i = next.fetch_add(1)) {
        const Piece& p = pieces[i];
        uint8_t* h = static_cast<uint8_t*>(host) + p.host;
        absl::Status st = to_host ? raw_->CopyToHost(h, p.va, p.bytes) : raw_->CopyFromHost(p.va, h, p.bytes);
        if (!st.ok()) {
          absl::MutexLock lock(&mu);
          if (first.ok()) first = std::move(st);
        }
      }
    };
    std::vector<std::thread> threads;
    for (int t = 1; t < 4; ++t) threads.emplace_back(work);
    work();
    for (std::thread& t : threads) t.join();
    return first;
  };
  KVD_RETURN_IF_ERROR(make());

  for (int rep = 0; rep < o_.reps; ++rep) {
    Pause();
    int64_t t = NowNs();
    SleepOptions options{.wait = true, .keep = true};
    KVD_RETURN_IF_ERROR(client_->Sleep(pool.name, options).status());
    sl.kvd.push_back(MsSince(t));
    KVD_ASSIGN_OR_RETURN(const PoolInfo asleep, client_->GetPool(pool.name));
    if (asleep.kept_bytes != bytes) {
      return absl::InternalError(absl::StrCat("the keeping sleep kept ", asleep.kept_bytes, " of ", bytes, " bytes"));
    }
    Pause();
    t = NowNs();
    KVD_RETURN_IF_ERROR(copy(/*to_host=*/true));
    KVD_RETURN_IF_ERROR(release());
    sl.base.push_back(MsSince(t));
    Pause();
    t = NowNs();
    KVD_RETURN_IF_ERROR(client_->Wake(pool.name).status());
    wl.kvd.push_back(MsSince(t));
    Pause();
    t = NowNs();
    KVD_RETURN_IF_ERROR(make());
    KVD_RETURN_IF_ERROR(copy(/*to_host=*/false));
    wl.base.push_back(MsSince(t));
  }
  KVD_RETURN_IF_ERROR(client_->DeletePool(pool.name, true).status());
  pools_.erase(std::remove(pools_.begin(), pools_.end(), pool.name), pools_.end());
  const double rate = static_cast<double>(bytes) / (P50(sl.kvd) / 1000.0) / 1e9;
  sl.note = absl::StrFormat("kvd p50 %.1f GB/s to the tier", rate);
  wl.note = absl::StrFormat("kvd p50 %.1f GB/s back", static_cast<double>(bytes) / (P50(wl.kvd) / 1000.0) / 1e9);
  return absl::OkStatus();
}

absl::Status Bench::MeasureBookkeeping() {
  if (daemon_pid_ <= 0) {
    book_.skipped = "the daemon's pid is unknown (SO_PEERCRED failed)";
    return absl::OkStatus();
  }
  if (!RssAnonBytes(daemon_pid_).ok() || !MemoryFds(daemon_pid_).ok()) {
    book_.skipped = absl::StrCat("cannot read /proc/", daemon_pid_, " (another user's daemon?)");
    return absl::OkStatus();
  }
  KVD_ASSIGN_OR_RETURN(uint64_t bk_bytes, ParseBytes(o_.bookkeeping_bytes, "--bookkeeping-bytes"));
  const uint64_t g = daemon_.granularity_bytes;
  const uint64_t granule_blocks = g / kLayerBlockBytes;
  const uint64_t steps = bk_bytes / (g * segments_);
  if (g % kLayerBlockBytes != 0 || steps < 4) {
    book_.skipped = absl::StrCat("--bookkeeping-bytes must hold at least 4 granules per segment (",
                                 FormatBytes(4 * g * segments_), ")");
    return absl::OkStatus();
  }
  KVD_ASSIGN_OR_RETURN(PoolInfo pool, CreatePool("book", steps * granule_blocks));
  KVD_ASSIGN_OR_RETURN(std::vector<int> fds_before, MemoryFds(daemon_pid_));
  std::vector<double> x, rss, fds;
  auto sample = [&](uint64_t chunks) -> absl::Status {
    KVD_ASSIGN_OR_RETURN(uint64_t r, RssAnonBytes(daemon_pid_));
    KVD_ASSIGN_OR_RETURN(std::vector<int> f, MemoryFds(daemon_pid_));
    x.push_back(chunks);
    rss.push_back(r);
    fds.push_back(f.size());
    return absl::OkStatus();
  };
  KVD_RETURN_IF_ERROR(sample(0));
  for (uint64_t k = 1; k <= steps; ++k) {
    KVD_RETURN_IF_ERROR(client_->Grow(pool.name, k * granule_blocks).status());
    if (k % std::max<uint64_t>(1, steps / 8) == 0 || k == steps) KVD_RETURN_IF_ERROR(sample(k * segments_));
  }
  KVD_ASSIGN_OR_RETURN(PoolInfo grown, client_->GetPool(pool.name));
  book_.chunks = grown.chunks.size();
  book_.daemon_bytes_per_chunk = Slope(x, rss);
  book_.fds_per_chunk = Slope(x, fds);
  // Two attaches by the second process, then: memory FDs of the daemon per chunk, and how many distinct
  // open files (exports) they are, by kcmp(KCMP_FILE).
  for (int i = 0; i < 2; ++i) {
    KVD_RETURN_IF_ERROR(
        child_->Call(absl::StrCat("kvd-attach ", socket_, " ", pool.name, " ", grown.committed_bytes)).status());
    KVD_RETURN_IF_ERROR(child_->Call("kvd-detach").status());
  }
  KVD_ASSIGN_OR_RETURN(std::vector<int> fds_after, MemoryFds(daemon_pid_));
  std::vector<int> added;
  std::set_difference(fds_after.begin(), fds_after.end(), fds_before.begin(), fds_before.end(),
                      std::back_inserter(added));
  book_.fds_per_chunk_after_attach = static_cast<double>(added.size()) / book_.chunks;
  int kcmp_errno = 0;
  auto less = [&](int a, int b) {
    const long r = syscall(SYS_kcmp, daemon_pid_, daemon_pid_, KCMP_FILE, a, b);
    if (r < 0) kcmp_errno = errno;
    return r == 1;
  };
  std::sort(added.begin(), added.end(), less);
  uint64_t distinct = 0;
  for (size_t i = 0; i < added.size() && kcmp_errno == 0; ++i) {
    if (i == 0 || less(added[i - 1], added[i])) ++distinct;
  }
  if (kcmp_errno != 0) {
    book_.exports_skipped = absl::StrCat("kcmp on the daemon: ", std::strerror(kcmp_errno));
  } else {
    book_.exports_per_chunk = static_cast<double>(distinct) / book_.chunks;
  }
  KVD_RETURN_IF_ERROR(client_->Shrink(pool.name, 0, true).status());
  KVD_RETURN_IF_ERROR(client_->DeletePool(pool.name, true).status());

  // The device layer and driver alone: the same chunks created, mapped and exported in a bare process (a
  // fresh second one: this one's heap has room left by everything it did, which would hide what the device
  // layer allocates; RawBookkeeping).
  {
    const Plan plan = PlanOf(grown);
    const size_t per = plan.chunks.size() / 4;
    KVD_ASSIGN_OR_RETURN(std::unique_ptr<Child> bare, Child::Spawn(backend_, daemon_.device_index, g));
    KVD_RETURN_IF_ERROR(SendWithFds(bare->socket(), absl::StrCat("raw-book ", plan.reserve_bytes, " ", 4 * per), {}));
    for (size_t i = 0; i < 4 * per; i += kMaxFdsPerMessage) {
      std::string text = "chunks";
      for (size_t j = i; j < std::min(4 * per, i + kMaxFdsPerMessage); ++j) {
        absl::StrAppend(&text, " ", plan.chunks[j].offset, ":", plan.chunks[j].bytes);
      }
      KVD_RETURN_IF_ERROR(SendWithFds(bare->socket(), text, {}));
    }
    KVD_ASSIGN_OR_RETURN(const std::vector<std::string> w, bare->Reply("raw-book"));
    std::vector<double> rx, ry;
    for (size_t q = 0; q < w.size(); ++q) {
      uint64_t bytes = 0;
      if (!absl::SimpleAtoi(w[q], &bytes)) return absl::InternalError(absl::StrCat("raw-book: bad reply ", w[q]));
      rx.push_back(q * per);
      ry.push_back(bytes);
    }
    book_.raw_bytes_per_chunk = Slope(rx, ry);
  }
  book_.own_bytes_per_chunk = book_.daemon_bytes_per_chunk - book_.raw_bytes_per_chunk;

  // Per pool: empty pools.
  std::vector<double> px, py;
  std::vector<std::string> created;
  const uint64_t n = o_.bookkeeping_pools;
  for (uint64_t i = 0; i <= n; ++i) {
    if (i % std::max<uint64_t>(1, n / 4) == 0 || i == n) {
      KVD_ASSIGN_OR_RETURN(uint64_t r, RssAnonBytes(daemon_pid_));
      px.push_back(i);
      py.push_back(r);
    }
    if (i == n) break;
    KVD_ASSIGN_OR_RETURN(PoolInfo p, CreatePool(absl::StrCat("empty", i), blocks_));
    created.push_back(p.name);
  }
  book_.pools = n;
  book_.daemon_bytes_per_pool = Slope(px, py);
  for (const std::string& name : created) KVD_RETURN_IF_ERROR(client_->DeletePool(name, true).status());
  return absl::OkStatus();
}

// One handle per granule (in-process VMM allocators), grow + attach through the bare calls.
absl::Status Bench::Granule() {
  Line& l = GetLine("granule_design", "after_pause");
  l.kvd_what = "kvd grow + attach (sum of each repetition's after_pause grow and attach)";
  l.base_what = absl::StrCat("one ", FormatBytes(raw_info_.granularity),
                             " handle per granule, create+map+export + import+map in a second process, in batches of ",
                             kMaxFdsPerMessage, "; ratio = granule / (kvd grow + attach)");
  l.ratio_means = "granule p50 / (kvd grow + attach) p50";
  l.target = ">= 40";
  const uint64_t g = raw_info_.granularity;
  const uint64_t n = bytes_ / g;
  // Exported, sent and closed in batches (GrowAndSendInBatches), imported and closed as they arrive:
  // about 2 * kMaxFdsPerMessage FDs are open at once, not one per granule.
  Plan plan{.reserve_bytes = n * g};
  for (uint64_t i = 0; i < n; ++i) plan.chunks.push_back({i * g, g});
  RawExporter raw(raw_.get(), std::move(plan));
  for (int rep = 0; rep < o_.granule_reps; ++rep) {
    KVD_RETURN_IF_ERROR(raw.Reserve());
    Pause();
    const int64_t t = NowNs();
    KVD_RETURN_IF_ERROR(raw.GrowAndSendInBatches(*child_));
    KVD_ASSIGN_OR_RETURN(double ms, child_->TimedReply("raw-attach", t));
    l.base.push_back(ms);
    KVD_RETURN_IF_ERROR(child_->Call("raw-detach").status());
    KVD_ASSIGN_OR_RETURN(const uint64_t before, FreeBytes());
    KVD_RETURN_IF_ERROR(raw.Release());
    KVD_RETURN_IF_ERROR(WaitFree(before, n * g));
  }
  return absl::OkStatus();
}

// torch.zeros of the same bytes in a Python subprocess, timed inside it (after CUDA's start).
absl::Status Bench::Torch() {
  Line& l = GetLine("torch_zeros", "after_pause");
  l.kvd_what = "kvd grow + attach (sum of each repetition's after_pause grow and attach)";
  l.base_what =
      "torch.zeros(uint8) of the same bytes + synchronize, one process; ratio = torch.zeros / (kvd grow + attach)";
  l.ratio_means = "torch.zeros p50 / (kvd grow + attach) p50";
  l.target = ">= 8";
  if (!gpu_ || backend_ != "cuda") {
    l.skipped = absl::StrCat("torch.zeros on CUDA only (backend ", backend_, ")");
    return absl::OkStatus();
  }
  if (!o_.torch) {
    l.skipped = "--no-torch";
    return absl::OkStatus();
  }
  const std::string script = absl::StrFormat(
      "import json,sys,time\n"
      "try:\n import torch\nexcept Exception as e:\n print(json.dumps({'skipped': 'torch not importable: %%s' %% e}))\n"
      " sys.exit(0)\n"
      "if not torch.cuda.is_available():\n print(json.dumps({'skipped': 'torch sees no CUDA device'})); sys.exit(0)\n"
      "dev = torch.device('cuda', %d); torch.zeros(1, device=dev); torch.cuda.synchronize(dev)\n"
      "ms = []\n"
      "for _ in range(%d):\n"
      " time.sleep(%f)\n"
      " t = time.perf_counter(); x = torch.zeros(%d, dtype=torch.uint8, device=dev); torch.cuda.synchronize(dev)\n"
      " ms.append((time.perf_counter() - t) * 1e3); del x; torch.cuda.empty_cache()\n"
      "print(json.dumps({'ms': ms, 'torch': torch.__version__}))\n",
      o_.device, o_.reps, pause_ms_ / 1000.0, bytes_);
  const std::string path = absl::StrCat("/tmp/kvd-bench-torch-", getpid(), ".py");
  {
    std::ofstream out(path);
    out << script;
  }
  absl::Cleanup remove = [&] { unlink(path.c_str()); };
  FILE* p = popen(absl::StrCat("python3 ", path, " 2>/dev/null").c_str(), "r");
  if (p == nullptr) {
    l.skipped = "python3 cannot be started";
    return absl::OkStatus();
  }
  std::string output;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) output.append(buf, n);
  const int rc = pclose(p);
  // The output is one line of JSON we wrote: {"skipped": "..."} or {"ms": [..], "torch": "..."}.
  if (rc != 0 || output.empty()) {
    l.skipped = absl::StrCat("python3 failed (exit ", WEXITSTATUS(rc), "): torch not importable or out of memory");
    return absl::OkStatus();
  }
  if (size_t at = output.find("\"skipped\": \""); at != std::string::npos) {
    l.skipped = output.substr(at + 12, output.rfind('"') - at - 12);
    return absl::OkStatus();
  }
  const size_t open = output.find('['), close = output.find(']');
  for (absl::string_view v : absl::StrSplit(output.substr(open + 1, close - open - 1), ',', absl::SkipEmpty())) {
    double ms = 0;
    if (absl::SimpleAtod(v, &ms)) l.base.push_back(ms);
  }
  if (size_t at = output.find("\"torch\": \""); at != std::string::npos) {
    torch_version_ = output.substr(at + 10, output.find('"', at + 10) - at - 10);
  }
  return absl::OkStatus();
}

absl::Status Bench::SetWaits(uint64_t g) {
  pause_ms_ = o_.pause_ms >= 0 ? o_.pause_ms : (gpu_ ? 2000 : 20);
  free_timeout_ms_ = gpu_ ? 10000 : 2000;
  KVD_ASSIGN_OR_RETURN(slack_,
                       ParseBytes(o_.free_slack.empty() ? (gpu_ ? "0" : "8MiB") : o_.free_slack, "--free-slack"));
  slack_ = std::max(slack_, g);
  return absl::OkStatus();
}

absl::Status Bench::Run() {
  if (o_.deadline_s > 0) deadline_ns_ = NowNs() + int64_t{o_.deadline_s} * 1'000'000'000;
  if (o_.chunk_sweep) return ChunkSweep();
  if (o_.socket.empty()) {
    KVD_RETURN_IF_ERROR(StartDaemon());
  } else {
    socket_ = o_.socket;
  }
  KVD_ASSIGN_OR_RETURN(client_, Client::Connect({.socket = socket_, .client_name = "kvd-bench"}));
  KVD_ASSIGN_OR_RETURN(daemon_, client_->DeviceInfo());
  backend_ = daemon_.backend;
  gpu_ = backend_ != "host";
  if (absl::StatusOr<pid_t> pid = PeerPid(socket_); pid.ok()) daemon_pid_ = *pid;
  KVD_ASSIGN_OR_RETURN(raw_, OpenDevice({.backend = backend_,
                                         .index = static_cast<int>(daemon_.device_index),
                                         .host_granularity = daemon_.granularity_bytes}));
  KVD_ASSIGN_OR_RETURN(raw_info_, raw_->Info());
  if (raw_info_.uuid != daemon_.uuid) {
    return absl::FailedPreconditionError(
        absl::StrCat("the daemon serves ", daemon_.uuid, " but --device opens ", raw_info_.uuid));
  }
  if (absl::StatusOr<std::unique_ptr<InProcess>> in_process =
          InProcess::Open(backend_, static_cast<int>(daemon_.device_index));
      in_process.ok()) {
    in_process_ = *std::move(in_process);
  } else {
    in_process_skipped_ = in_process.status().ToString();
  }

  KVD_ASSIGN_OR_RETURN(bytes_, ParseBytes(o_.bytes.empty() ? (gpu_ ? "128GiB" : "256MiB") : o_.bytes, "--bytes"));
  layers_ = o_.segments ? o_.segments : (gpu_ ? 80 : 8);
  if (o_.layout != "LBHNC" && o_.layout != "BLHNC") {
    return absl::InvalidArgumentError(absl::StrCat("--layout: \"", o_.layout, "\" is neither LBHNC nor BLHNC"));
  }
  segments_ = o_.layout == "LBHNC" ? layers_ : 1;
  blocks_ = bytes_ / (layers_ * kLayerBlockBytes);
  fragments_ = o_.fragments ? o_.fragments : (gpu_ ? 16 : 8);
  compact_grows_ = o_.compact_grows ? o_.compact_grows : (gpu_ ? 64 : 8);
  KVD_RETURN_IF_ERROR(SetWaits(daemon_.granularity_bytes));
  if (o_.bookkeeping_bytes.empty()) o_.bookkeeping_bytes = gpu_ ? "16GiB" : "1GiB";
  if (o_.rpc_calls <= 0) o_.rpc_calls = gpu_ ? 2000 : 400;
  if (o_.granule_reps <= 0) o_.granule_reps = std::min(o_.reps, 3);
  if (o_.sections != "all") {
    const std::set<std::string> known = {"lifecycle",   "fragmented",  "compact", "shrink_to_half",
                                         "control_rpc", "concurrent",  "reclaim", "saturate",
                                         "keep",        "bookkeeping", "granule", "torch"};
    for (absl::string_view section : absl::StrSplit(o_.sections, ',', absl::SkipEmpty())) {
      if (!known.contains(std::string(section))) {
        return absl::InvalidArgumentError(absl::StrCat("--sections: unknown section \"", section, "\" (known: all, ",
                                                       absl::StrJoin(known, ", "), ")"));
      }
      sections_.insert(std::string(section));
    }
    if (sections_.empty()) return absl::InvalidArgumentError("--sections: empty");
  }
  // The other sections size their grows in granules of a segment per layer.
  if (o_.layout != "LBHNC") {
    for (const char* section : {"fragmented", "compact", "shrink_to_half", "concurrent", "bookkeeping"}) {
      if (Want(section)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--layout: ", o_.layout, " measures the lifecycle, control_rpc, granule and torch sections only, not ",
            section, " (pass --sections=lifecycle)"));
      }
    }
  }
  const uint64_t granule_blocks = daemon_.granularity_bytes / kLayerBlockBytes;
  if (blocks_ < granule_blocks ||
      (Want("fragmented") && blocks_ < static_cast<uint64_t>(fragments_) * granule_blocks) ||
      (Want("concurrent") && blocks_ < static_cast<uint64_t>(o_.threads) * granule_blocks)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--bytes: ", FormatBytes(bytes_), " over ", segments_, " segments is less than one granule (",
                     FormatBytes(daemon_.granularity_bytes), ") per segment for each fragment and each thread"));
  }
  if (Want("compact") && bytes_ / 2 / (layers_ * kLayerBlockBytes) <
                             static_cast<uint64_t>(compact_grows_) * (daemon_.granularity_bytes / kLayerBlockBytes)) {
    return absl::InvalidArgumentError(absl::StrCat("--compact-grows: half of --bytes (", FormatBytes(bytes_ / 2),
                                                   ") over ", segments_, " segments is less than one granule (",
                                                   FormatBytes(daemon_.granularity_bytes), ") per segment for each of ",
                                                   compact_grows_, " grows"));
  }
  prefix_ = absl::StrCat("bench-", getpid(), "-");

  KVD_ASSIGN_OR_RETURN(child_, Child::Spawn(backend_, daemon_.device_index, daemon_.granularity_bytes));
  KVD_ASSIGN_OR_RETURN(PoolInfo pool, CreatePool("main", blocks_));
  pool_ = pool.name;
  std::fprintf(stderr, "kvd_bench: %s %s, %s of %llu layers as %llu segments (%s), pause %d ms, %d reps\n",
               backend_.c_str(), daemon_.name.c_str(), FormatBytes(bytes_).c_str(),
               static_cast<unsigned long long>(layers_), static_cast<unsigned long long>(segments_), o_.layout.c_str(),
               pause_ms_, o_.reps);

  // Warm-up (the second process's driver start, the daemon's first grow), and the chunk plan.
  KVD_RETURN_IF_ERROR(client_->Grow(pool_, blocks_).status());
  KVD_ASSIGN_OR_RETURN(PoolInfo grown, client_->GetPool(pool_));
  pool_bytes_ = grown.committed_bytes;
  max_chunk_ = 0;
  chunks_ = grown.chunks.size();
  for (const ChunkInfo& c : grown.chunks) max_chunk_ = std::max(max_chunk_, c.bytes);
  KVD_RETURN_IF_ERROR(client_->Shrink(pool_, 0, true).status());
  RawExporter raw(raw_.get(), PlanOf(grown));
  if (Want("lifecycle")) KVD_RETURN_IF_ERROR(Lifecycle(raw, grown));
  if (Want("fragmented")) {
    std::fprintf(stderr, "kvd_bench: fragmented\n");
    KVD_RETURN_IF_ERROR(Fragmented());
  }
  if (Want("compact")) {
    std::fprintf(stderr, "kvd_bench: compact\n");
    KVD_RETURN_IF_ERROR(Compact());
  }
  if (Want("shrink_to_half")) {
    std::fprintf(stderr, "kvd_bench: shrink to half\n");
    KVD_RETURN_IF_ERROR(ShrinkToHalf());
  }
  if (Want("control_rpc")) {
    std::fprintf(stderr, "kvd_bench: control RPC\n");
    KVD_RETURN_IF_ERROR(ControlRpc());
    GetLine("control_rpc", "idle").target = "<= 1.2";
    GetLine("control_rpc", "during_grow").target = "<= 2";
  }
  if (Want("concurrent")) {
    std::fprintf(stderr, "kvd_bench: concurrent resizes\n");
    KVD_RETURN_IF_ERROR(Concurrent());
  }
  if (Want("reclaim")) {
    std::fprintf(stderr, "kvd_bench: reclaim\n");
    KVD_RETURN_IF_ERROR(Reclaim());
  }
  if (Want("saturate")) {
    std::fprintf(stderr, "kvd_bench: saturate\n");
    KVD_RETURN_IF_ERROR(Saturate());
  }
  if (Want("keep")) {
    std::fprintf(stderr, "kvd_bench: keep\n");
    KVD_RETURN_IF_ERROR(Keep());
    GetLine("sleep_keep", "whole_pool").target = "<= 1.10";
    GetLine("wake_keep", "whole_pool").target = "<= 1.10";
  }
  if (Want("bookkeeping")) {
    std::fprintf(stderr, "kvd_bench: bookkeeping\n");
    KVD_RETURN_IF_ERROR(MeasureBookkeeping());
  } else {
    book_.skipped = "not in --sections";
  }
  // The alternatives, against kvd's grow + attach after a pause.
  std::vector<double> kvd_grow_attach;
  if (Want("lifecycle")) {
    const Line& g = GetLine("grow", "after_pause");
    const Line& a = GetLine("attach", "after_pause");
    for (size_t i = 0; i < std::min(g.kvd.size(), a.kvd.size()); ++i) kvd_grow_attach.push_back(g.kvd[i] + a.kvd[i]);
  }
  if (Want("granule")) {
    std::fprintf(stderr, "kvd_bench: granule design\n");
    KVD_RETURN_IF_ERROR(Granule());
  }
  if (Want("torch")) {
    std::fprintf(stderr, "kvd_bench: torch.zeros\n");
    KVD_RETURN_IF_ERROR(Torch());
  }
  for (const auto& [name, section] : {std::pair<const char*, const char*>{"granule_design", "granule"},
                                      std::pair<const char*, const char*>{"torch_zeros", "torch"}}) {
    if (!Want(section)) continue;
    Line& l = GetLine(name, "after_pause");
    l.kvd = kvd_grow_attach;
    if (l.kvd.empty() && l.skipped.empty()) {
      l.skipped = "compared with the lifecycle section's grow + attach: add lifecycle to --sections";
    }
    if (l.skipped.empty()) l.ratio = P50(l.base) / P50(l.kvd);
  }
  for (Line& l : lines_) {
    if (std::isnan(l.ratio) && l.skipped.empty()) l.ratio = P50(l.kvd) / P50(l.base);
    for (Peer& p : l.peers) {
      if (p.skipped.empty()) p.ratio = P50(l.kvd) / P50(p.ms);
    }
  }
  return absl::OkStatus();
}

// What an in-process peer's column of each lifecycle line times.
const char* InProcessWhat(const std::string& op) {
  if (op == "grow") return "create every allocation";
  if (op == "attach") return "map + set access of every allocation";
  if (op == "grow_mapped") return "create + map + set access (the allocation)";
  if (op == "wake") return "create every allocation again";
  if (op == "wake_mapped") return "create + map + set access again (the resume)";
  return "unmap + release every allocation (the pause), then the free-count wait";  // sleep, shrink
}

// grow, attach, sleep, wake and shrink of the main pool (and grow_mapped, wake_mapped: until the second
// process has it mapped), interleaved with the bare calls and the in-process peers, both variants.
absl::Status Bench::Lifecycle(RawExporter& raw, const PoolInfo& grown) {
  const Plan plan = PlanOf(grown);
  std::vector<InProcessSide> sides;
  if (in_process_ != nullptr) {
    sides.push_back({.name = "single", .plan = SinglePlan(plan)});
    if (segments_ > 1) sides.push_back({.name = "per_segment", .plan = PerSegmentPlan(plan)});
  }
  absl::Cleanup give_back = [&] {
    for (InProcessSide& side : sides) {
      ReleaseInProcess(side).IgnoreError();
      if (side.va != 0) in_process_->Free(side.va, side.plan.reserve_bytes).IgnoreError();
    }
  };
  // Issue 25: kvd within 1.2x of the in-process allocations a torch_memory_saver user would make instead --
  // per layer for a layer-outermost pool, one for a pool of one segment -- to give, release and take back
  // the memory.
  const std::string peer_with_target = segments_ == 1 ? "single" : "per_segment";
  for (const char* op : {"grow", "attach", "grow_mapped", "sleep", "wake", "wake_mapped", "shrink"}) {
    for (const char* variant : {"after_release", "after_pause"}) {
      Line& l = GetLine(op, variant);
      l.lifecycle = true;
      l.note = absl::StrFormat("%d chunks", grown.chunks.size());
      if (in_process_ == nullptr) l.peers_skipped = in_process_skipped_;
      for (const InProcessSide& side : sides) {
        Peer& p = l.PeerNamed(side.name);
        p.allocations = side.plan.chunks.size();
        p.what = absl::StrCat("in this process, ",
                              side.name == "single" ? "one allocation of all the bytes"
                                                    : absl::StrCat("one allocation per segment (", p.allocations, ")"),
                              ": ", InProcessWhat(op));
        const std::string o = op;
        if (side.name == peer_with_target && (o == "grow_mapped" || o == "sleep" || o == "wake_mapped")) {
          p.target = "<= 1.2";
        }
      }
    }
  }
  GetLine("grow", "after_release").target = GetLine("grow", "after_pause").target = "<= 1.10";
  GetLine("attach", "after_release").target = GetLine("attach", "after_pause").target = "<= 1.15";
  GetLine("sleep", "after_release").target = GetLine("sleep", "after_pause").target = "<= 1.10";
  GetLine("wake", "after_release").target = GetLine("wake", "after_pause").target = "<= 1.15";
  GetLine("shrink", "after_release").target = GetLine("shrink", "after_pause").target = "<= 1.15";
  for (const char* op : {"grow_mapped", "wake_mapped"}) {
    for (const char* variant : {"after_release", "after_pause"}) {
      GetLine(op, variant).kvd_what = op == std::string("grow_mapped")
                                          ? "kvd grow + attach (the memory committed and mapped by the second process)"
                                          : "kvd Wake until the second process's Mapping has mapped it again";
      GetLine(op, variant).base_what = "raw device calls: the same until the second process has mapped it";
    }
  }

  // kvd, raw, then the in-process peers; repetition r starts with the (r mod N)-th, so that none always
  // follows another's release.
  std::vector<std::function<absl::Status(bool, bool)>> cycles = {
      [&](bool paused, bool record) { return KvdCycle(paused, record); },
      [&](bool paused, bool record) { return RawCycle(raw, paused, record); }};
  for (auto& cycle : cycles) KVD_RETURN_IF_ERROR(cycle(false, false));  // warm-up
  // A peer whose warm-up fails (the driver refuses one allocation of all the bytes, say) is left out and
  // says why in every line; the rest of the run goes on.
  for (InProcessSide& side : sides) {
    if (absl::Status s = InProcessCycle(side, false, false); !s.ok()) {
      ReleaseInProcess(side).IgnoreError();
      for (Line& l : lines_) {
        if (l.lifecycle) l.PeerNamed(side.name).skipped = s.ToString();
      }
      continue;
    }
    cycles.push_back([&, s = &side](bool paused, bool record) { return InProcessCycle(*s, paused, record); });
  }
  int64_t longest = 0;
  for (int rep = 0; rep < o_.reps; ++rep) {
    if (rep > 0 && deadline_ns_ > 0 && NowNs() + longest > deadline_ns_) {
      std::fprintf(stderr, "kvd_bench: lifecycle stopped after %d of %d repetitions (--deadline-s)\n", rep, o_.reps);
      break;
    }
    std::fprintf(stderr, "kvd_bench: lifecycle, repetition %d/%d\n", rep + 1, o_.reps);
    const int64_t started = NowNs();
    for (const bool paused : {false, true}) {
      for (size_t k = 0; k < cycles.size(); ++k) KVD_RETURN_IF_ERROR(cycles[(rep + k) % cycles.size()](paused, true));
    }
    longest = std::max(longest, NowNs() - started);
    lifecycle_reps_ = rep + 1;
  }
  return absl::OkStatus();
}

void Bench::Print(FILE* out) const {
  if (o_.chunk_sweep) return PrintSweep(out);
  std::fprintf(out,
               "kvd_bench: backend %s, %s (%s), driver %s, kvd %s; %s of %llu layers as %llu segments (%s; %llu chunks "
               "of up to %s), %d reps, pause %d ms\n",
               backend_.c_str(), daemon_.name.c_str(), daemon_.uuid.c_str(),
               daemon_.driver_version.empty() ? "-" : daemon_.driver_version.c_str(), daemon_.daemon_version.c_str(),
               FormatBytes(bytes_).c_str(), static_cast<unsigned long long>(layers_),
               static_cast<unsigned long long>(segments_), o_.layout.c_str(), static_cast<unsigned long long>(chunks_),
               FormatBytes(max_chunk_).c_str(), o_.reps, pause_ms_);
  std::fprintf(out, "%-26s %-16s %9s %9s %9s %9s %7s %8s  %s\n", "line", "variant", "kvd p50", "kvd p99", "base p50",
               "base p99", "ratio", "target", "baseline; note");
  for (const Line& l : lines_) {
    if (!l.skipped.empty()) {
      std::fprintf(out, "%-26s %-16s skipped: %s\n", l.name.c_str(), l.variant.c_str(), l.skipped.c_str());
      continue;
    }
    std::fprintf(out, "%-26s %-16s %9.3f %9.3f %9.3f %9.3f %7.2f %8s  %s%s%s\n", l.name.c_str(), l.variant.c_str(),
                 P50(l.kvd), P99(l.kvd), P50(l.base), P99(l.base), l.ratio, l.target.c_str(), l.base_what.c_str(),
                 l.note.empty() ? "" : "; ", l.note.c_str());
    auto phases = [](const std::vector<std::pair<std::string, std::vector<double>>>& ps) {
      std::vector<std::string> parts;
      for (const auto& [name, v] : ps) parts.push_back(absl::StrFormat("%s %.3f", name, P50(v)));
      return absl::StrJoin(parts, ", ");
    };
    if (!l.kvd_phases.empty())
      std::fprintf(out, "  %s %s phases, kvd p50: %s\n", l.name.c_str(), l.variant.c_str(),
                   phases(l.kvd_phases).c_str());
    if (!l.base_phases.empty())
      std::fprintf(out, "  %s %s phases, raw p50: %s\n", l.name.c_str(), l.variant.c_str(),
                   phases(l.base_phases).c_str());
    if (!l.lifecycle) continue;
    if (!l.peers_skipped.empty()) {
      std::fprintf(out, "  %s %s in-process: skipped: %s\n", l.name.c_str(), l.variant.c_str(),
                   l.peers_skipped.c_str());
      continue;
    }
    std::vector<std::string> parts;
    for (const Peer& p : l.peers) {
      if (!p.skipped.empty()) {
        parts.push_back(absl::StrCat(p.name, " skipped: ", p.skipped));
        continue;
      }
      parts.push_back(absl::StrFormat("%s (%d allocation%s) p50 %.3f p99 %.3f ratio %.2f%s", p.name, p.allocations,
                                      p.allocations == 1 ? "" : "s", P50(p.ms), P99(p.ms), p.ratio,
                                      p.target.empty() ? "" : absl::StrCat(" (target ", p.target, ")")));
    }
    std::fprintf(out, "  %s %s in-process, kvd/in-process p50: %s\n", l.name.c_str(), l.variant.c_str(),
                 absl::StrJoin(parts, "; ").c_str());
  }
  std::fprintf(out, "(ms; ratio: %s unless the baseline says otherwise; targets are for the H200)\n", "kvd/raw p50");
  if (lifecycle_reps_ < o_.reps && Want("lifecycle")) {
    std::fprintf(out, "lifecycle: %d of %d repetitions ran (--deadline-s %d)\n", lifecycle_reps_, o_.reps,
                 o_.deadline_s);
  }
  if (!book_.skipped.empty()) {
    std::fprintf(out, "bookkeeping: skipped: %s\n", book_.skipped.c_str());
  } else {
    std::fprintf(out,
                 "bookkeeping (%llu chunks, %llu pools): kvd's own %.0f B/chunk (target <= 240) = daemon %.0f B/chunk "
                 "- driver + device layer alone in a bare process %.0f B/chunk; %.0f B/pool, %.2f FDs/chunk (%.2f "
                 "after two attaches), exports/chunk %s\n",
                 static_cast<unsigned long long>(book_.chunks), static_cast<unsigned long long>(book_.pools),
                 book_.own_bytes_per_chunk, book_.daemon_bytes_per_chunk, book_.raw_bytes_per_chunk,
                 book_.daemon_bytes_per_pool, book_.fds_per_chunk, book_.fds_per_chunk_after_attach,
                 book_.exports_skipped.empty() ? absl::StrFormat("%.2f", book_.exports_per_chunk).c_str()
                                               : absl::StrCat("skipped: ", book_.exports_skipped).c_str());
  }
  if (free_timeouts_ > 0) {
    std::fprintf(out, "warning: the free count did not come back within %d ms %llu times (timed as that)\n",
                 free_timeout_ms_, static_cast<unsigned long long>(free_timeouts_));
  }
}

std::string Quote(absl::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out.push_back('\\');
    if (static_cast<unsigned char>(c) >= 0x20) out.push_back(c);
  }
  return out + "\"";
}
std::string Num(double v) { return std::isfinite(v) ? absl::StrFormat("%.4f", v) : "null"; }
// The fields of a sample set, without the braces.
std::string SampleFields(const std::vector<double>& v) {
  std::vector<std::string> parts;
  for (double x : v) parts.push_back(Num(x));
  return absl::StrCat("\"p50_ms\": ", Num(P50(v)), ", \"p99_ms\": ", Num(P99(v)), ", \"n\": ", v.size(),
                      ", \"samples_ms\": [", absl::StrJoin(parts, ", "), "]");
}
std::string Samples(const std::vector<double>& v) { return absl::StrCat("{", SampleFields(v), "}"); }

std::string Bench::Json() const {
  if (o_.chunk_sweep) return SweepJson();
  std::string j = absl::StrFormat(
      "{\"program\": \"kvd_bench\",\n \"device\": {\"backend\": %s, \"name\": %s, \"uuid\": %s, \"driver_version\": "
      "%s, \"daemon_version\": %s, \"total_bytes\": %d, \"granularity\": %d, \"max_chunk_bytes\": %d},\n"
      " \"config\": {\"bytes\": %d, \"layers\": %d, \"segments\": %d, \"layout\": %s, \"chunks\": %d, "
      "\"largest_chunk_bytes\": %d, \"reps\": %d, "
      "\"pause_ms\": %d, \"fragments\": %d, \"compact_grows\": %d, \"compact_chunks_per_pause\": %d, "
      "\"compact_bytes\": %d, \"shrink_bytes\": %d, "
      "\"threads\": %d, \"watch_streams\": %d, \"granule_reps\": %d, \"torch\": %s, \"free_timeouts\": %d, "
      "\"sections\": %s, "
      "\"lifecycle_reps\": %d, \"deadline_s\": %d, \"raw_release_first\": %s},\n \"lines\": [",
      Quote(backend_), Quote(daemon_.name), Quote(daemon_.uuid), Quote(daemon_.driver_version),
      Quote(daemon_.daemon_version), daemon_.total_bytes, daemon_.granularity_bytes, daemon_.max_chunk_bytes, bytes_,
      layers_, segments_, Quote(o_.layout), chunks_, max_chunk_, o_.reps, pause_ms_, fragments_, compact_grows_,
      o_.compact_chunks_per_pause, compact_bytes_, shrink_bytes_, o_.threads, o_.watch_streams, o_.granule_reps,
      Quote(torch_version_), free_timeouts_, Quote(o_.sections), lifecycle_reps_, o_.deadline_s,
      Quote(o_.raw_release_first));
  for (size_t i = 0; i < lines_.size(); ++i) {
    const Line& l = lines_[i];
    absl::StrAppend(&j, i ? ",\n  " : "\n  ", "{\"name\": ", Quote(l.name), ", \"variant\": ", Quote(l.variant));
    if (!l.skipped.empty()) {
      absl::StrAppend(&j, ", \"skipped\": ", Quote(l.skipped), "}");
      continue;
    }
    absl::StrAppend(&j, ", \"kvd\": ", Samples(l.kvd), ", \"kvd_what\": ", Quote(l.kvd_what),
                    ", \"baseline\": ", Samples(l.base), ", \"baseline_what\": ", Quote(l.base_what),
                    ", \"ratio\": ", Num(l.ratio), ", \"ratio_means\": ", Quote(l.ratio_means),
                    ", \"target\": ", Quote(l.target), ", \"note\": ", Quote(l.note));
    if (!l.kvd_phases.empty() || !l.base_phases.empty()) {
      auto phases = [](const std::vector<std::pair<std::string, std::vector<double>>>& ps) {
        std::vector<std::string> parts;
        for (const auto& [name, v] : ps) parts.push_back(absl::StrCat(Quote(name), ": ", Samples(v)));
        return absl::StrCat("{", absl::StrJoin(parts, ", "), "}");
      };
      absl::StrAppend(&j, ", \"phases\": {\"kvd\": ", phases(l.kvd_phases), ", \"baseline\": ", phases(l.base_phases),
                      "}");
    }
    if (l.lifecycle) {
      std::vector<std::string> peers;
      for (const Peer& p : l.peers) {
        if (!p.skipped.empty()) {
          peers.push_back(absl::StrCat(Quote(p.name), ": {\"skipped\": ", Quote(p.skipped), "}"));
          continue;
        }
        peers.push_back(absl::StrCat(Quote(p.name), ": {", SampleFields(p.ms), ", \"allocations\": ", p.allocations,
                                     ", \"what\": ", Quote(p.what), ", \"ratio\": ", Num(p.ratio),
                                     ", \"target\": ", Quote(p.target), "}"));
      }
      absl::StrAppend(&j, ", \"in_process\": ",
                      l.peers_skipped.empty() ? absl::StrCat("{", absl::StrJoin(peers, ", "), "}")
                                              : absl::StrCat("{\"skipped\": ", Quote(l.peers_skipped), "}"));
    }
    j += "}";
  }
  j += "],\n \"bookkeeping\": ";
  if (!book_.skipped.empty()) {
    absl::StrAppend(&j, "{\"skipped\": ", Quote(book_.skipped), "}");
  } else {
    absl::StrAppend(&j, "{\"chunks\": ", book_.chunks, ", \"pools\": ", book_.pools,
                    ", \"daemon_bytes_per_chunk\": ", Num(book_.daemon_bytes_per_chunk),
                    ", \"raw_bytes_per_chunk\": ", Num(book_.raw_bytes_per_chunk),
                    ", \"daemon_own_bytes_per_chunk\": ", Num(book_.own_bytes_per_chunk),
                    ", \"daemon_bytes_per_pool\": ", Num(book_.daemon_bytes_per_pool),
                    ", \"fds_per_chunk\": ", Num(book_.fds_per_chunk),
                    ", \"fds_per_chunk_after_attach\": ", Num(book_.fds_per_chunk_after_attach),
                    ", \"exports_per_chunk\": ",
                    book_.exports_skipped.empty() ? Num(book_.exports_per_chunk)
                                                  : absl::StrCat("{\"skipped\": ", Quote(book_.exports_skipped), "}"),
                    "}");
  }
  j += "}\n";
  return j;
}

// One round of the sweep at `size`: every chunk created, then mapped (+ access), then exported here; the
// FDs passed to the second process, which receives, imports (closing each FD) and maps every one; the
// importer unmaps and releases each, then this process does; then the free-count wait. Timed per phase.
absl::Status Bench::SweepRound(SweepSize& r, uint64_t va, bool paused, bool record) {
  Device& d = *raw_;
  const uint64_t n = r.handles, size = r.chunk_bytes;
  std::vector<Chunk> chunks;
  std::vector<int> fds;
  uint64_t mapped = 0;
  absl::Cleanup undo = [&] {
    for (int fd : fds) close(fd);
    for (uint64_t i = 0; i < mapped; ++i) d.Unmap(va + i * size, size).IgnoreError();
    for (const Chunk& c : chunks) d.Release(c).IgnoreError();
  };
  chunks.reserve(n);
  fds.reserve(n);
  if (paused) Pause();
  const int64_t t0 = NowNs();
  for (uint64_t i = 0; i < n; ++i) {
    KVD_ASSIGN_OR_RETURN(const Chunk c, d.Create(size));
    chunks.push_back(c);
  }
  const int64_t t1 = NowNs();
  for (; mapped < n; ++mapped) KVD_RETURN_IF_ERROR(d.Map(va + mapped * size, chunks[mapped], Access::kReadWrite));
  const int64_t t2 = NowNs();
  for (const Chunk& c : chunks) {
    KVD_ASSIGN_OR_RETURN(const int fd, d.Export(c));
    fds.push_back(fd);
  }
  const int64_t t3 = NowNs();
  KVD_RETURN_IF_ERROR(SendWithFds(child_->socket(), absl::StrCat("raw-attach ", n * size, " ", n), {}));
  for (uint64_t i = 0; i < n; i += kMaxFdsPerMessage) {
    const uint64_t count = std::min<uint64_t>(kMaxFdsPerMessage, n - i);
    std::string text = "chunks";
    for (uint64_t j = i; j < i + count; ++j) absl::StrAppend(&text, " ", j * size, ":", size);
    KVD_RETURN_IF_ERROR(SendWithFds(child_->socket(), text, absl::MakeConstSpan(fds).subspan(i, count)));
  }
  std::map<std::string, std::string> attached;
  KVD_RETURN_IF_ERROR(child_->TimedReply("raw-attach", t3, &attached).status());
  for (int fd : fds) close(fd);
  fds.clear();
  KVD_ASSIGN_OR_RETURN(const uint64_t before, FreeBytes());
  KVD_ASSIGN_OR_RETURN(const std::vector<std::string> released, child_->Call("raw-release"));
  const std::map<std::string, std::string> importer = Child::KeyValues(released);
  const int64_t t4 = NowNs();
  for (; mapped > 0; --mapped) KVD_RETURN_IF_ERROR(d.Unmap(va + (mapped - 1) * size, size));
  for (const Chunk& c : chunks) KVD_RETURN_IF_ERROR(d.Release(c));
  chunks.clear();
  const int64_t t5 = NowNs();
  KVD_RETURN_IF_ERROR(WaitFree(before, n * size));
  const int64_t t6 = NowNs();
  if (!record) return absl::OkStatus();
  std::map<std::string, std::vector<double>>& out = r.ms[paused ? "after_pause" : "after_release"];
  const std::map<std::string, double> phase = {
      {"create", Between(t0, t1)},
      {"map", Between(t1, t2)},
      {"export", Between(t2, t3)},
      {"import", MsOf(attached, "fd_receive_ms") + MsOf(attached, "import_ms")},
      {"import_map", MsOf(attached, "map_ms")},
      {"import_release", MsOf(importer, "unmap_ms") + MsOf(importer, "release_ms")},
      {"release", Between(t4, t5)},
      {"free_wait", Between(t5, t6)}};
  for (const auto& [name, ms] : phase) out[name].push_back(ms);
  for (const SweepGroup& g : SweepGroups()) {
    double sum = 0;
    for (const char* p : g.phases) sum += phase.at(p);
    out[g.name].push_back(sum);
  }
  return absl::OkStatus();
}

// The chunk sizes of --sweep-sizes against --sweep-bytes, each: a warm-up round (after a pause), then
// --sweep-reps times a round right after the previous one's release and a round after --pause-ms.
absl::Status Bench::ChunkSweep() {
  if (!o_.socket.empty()) {
    return absl::InvalidArgumentError("--chunk-sweep: measures the device layer alone; it takes no --socket");
  }
  KVD_ASSIGN_OR_RETURN(raw_, OpenDevice({.backend = o_.backend, .index = o_.device}));
  KVD_ASSIGN_OR_RETURN(raw_info_, raw_->Info());
  backend_ = BackendName(raw_info_.backend);
  gpu_ = backend_ != "host";
  const uint64_t g = raw_->granularity();
  KVD_RETURN_IF_ERROR(SetWaits(g));
  KVD_ASSIGN_OR_RETURN(
      sweep_bytes_, ParseBytes(o_.sweep_bytes.empty() ? (gpu_ ? "32GiB" : "256MiB") : o_.sweep_bytes, "--sweep-bytes"));
  const std::string sizes = o_.sweep_sizes.empty() ? (gpu_ ? "2MiB,8MiB,32MiB,128MiB,512MiB,1GiB,2GiB,4GiB,8GiB,16GiB"
                                                           : "2MiB,8MiB,32MiB,128MiB")
                                                   : o_.sweep_sizes;
  rlimit files{};
  getrlimit(RLIMIT_NOFILE, &files);
  for (absl::string_view text : absl::StrSplit(sizes, ',', absl::SkipEmpty())) {
    KVD_ASSIGN_OR_RETURN(const uint64_t size, ParseBytes(text, "--sweep-sizes"));
    if (size == 0 || size % g != 0 || sweep_bytes_ % size != 0) {
      return absl::InvalidArgumentError(absl::StrCat("--sweep-sizes: ", FormatBytes(size),
                                                     " is not a multiple of the granularity ", FormatBytes(g),
                                                     " that divides --sweep-bytes ", FormatBytes(sweep_bytes_)));
    }
    const uint64_t n = sweep_bytes_ / size;
    if (n + 256 > files.rlim_cur) {  // every chunk's FD is open here at once, and a batch in the second process
      return absl::InvalidArgumentError(absl::StrCat("--sweep-bytes: ", FormatBytes(sweep_bytes_), " as ",
                                                     FormatBytes(size), " chunks needs ", n,
                                                     " FDs at once; the open-file limit is ", files.rlim_cur));
    }
    sweep_.push_back({.chunk_bytes = size, .handles = n});
  }
  if (sweep_.empty()) return absl::InvalidArgumentError("--sweep-sizes: empty");
  std::fprintf(stderr, "kvd_bench: chunk sweep, backend %s %s, %s per round, %d reps, pause %d ms\n", backend_.c_str(),
               raw_info_.name.c_str(), FormatBytes(sweep_bytes_).c_str(), o_.sweep_reps, pause_ms_);
  KVD_ASSIGN_OR_RETURN(child_, Child::Spawn(backend_, o_.device, g));
  KVD_ASSIGN_OR_RETURN(const uint64_t va, raw_->Reserve(sweep_bytes_));
  absl::Cleanup free_va = [&] { raw_->Free(va, sweep_bytes_).IgnoreError(); };
  int64_t longest = 0;
  for (SweepSize& r : sweep_) {
    if (deadline_ns_ > 0 && NowNs() + longest > deadline_ns_) {
      r.skipped = absl::StrCat("--deadline-s ", o_.deadline_s, ": no time left for it");
      continue;
    }
    std::fprintf(stderr, "kvd_bench: chunk sweep, %s x %llu\n", FormatBytes(r.chunk_bytes).c_str(),
                 static_cast<unsigned long long>(r.handles));
    const int64_t started = NowNs();
    KVD_RETURN_IF_ERROR(SweepRound(r, va, /*paused=*/true, /*record=*/false));
    for (int rep = 0; rep < o_.sweep_reps; ++rep) {
      KVD_RETURN_IF_ERROR(SweepRound(r, va, /*paused=*/false, /*record=*/true));
      KVD_RETURN_IF_ERROR(SweepRound(r, va, /*paused=*/true, /*record=*/true));
    }
    KVD_RETURN_IF_ERROR(child_->Call("raw-detach").status());
    longest = std::max(longest, NowNs() - started);
  }
  return absl::OkStatus();
}

// Per GiB (ms) and per handle (us) of a p50 in ms.
double PerGib(double ms, uint64_t bytes) { return ms / (static_cast<double>(bytes) / (uint64_t{1} << 30)); }
double PerHandle(double ms, uint64_t handles) { return ms * 1e3 / static_cast<double>(handles); }

// The fastest size of each group and variant, by p50 per GiB; 0 when no size ran.
uint64_t Fastest(const std::vector<SweepSize>& sweep, const std::string& variant, const std::string& group) {
  uint64_t best = 0;
  double best_ms = INFINITY;
  for (const SweepSize& r : sweep) {
    if (!r.skipped.empty()) continue;
    const double ms = P50(r.ms.at(variant).at(group));
    if (ms < best_ms) best = r.chunk_bytes, best_ms = ms;
  }
  return best;
}

void Bench::PrintSweep(FILE* out) const {
  std::fprintf(out,
               "kvd_bench --chunk-sweep: backend %s, %s (%s), driver %s; %s per round through kvd::Device (create, "
               "map, export here; import, map in a second process), %d reps, pause %d ms\n",
               backend_.c_str(), raw_info_.name.c_str(), raw_info_.uuid.c_str(),
               raw_info_.driver_version.empty() ? "-" : raw_info_.driver_version.c_str(),
               FormatBytes(sweep_bytes_).c_str(), o_.sweep_reps, pause_ms_);
  std::vector<std::string> columns;
  for (const char* p : kSweepPhases) columns.push_back(p);
  for (const SweepGroup& g : SweepGroups()) columns.push_back(g.name);
  for (const bool per_handle : {false, true}) {
    std::fprintf(out, "%s\n%-10s %8s %-14s", per_handle ? "p50 us per handle:" : "p50 ms per GiB:", "chunk", "handles",
                 "variant");
    for (const std::string& c : columns) std::fprintf(out, " %*s", std::max<int>(9, c.size()), c.c_str());
    std::fprintf(out, "\n");
    for (const SweepSize& r : sweep_) {
      if (!r.skipped.empty()) {
        std::fprintf(out, "%-10s %8llu skipped: %s\n", FormatBytes(r.chunk_bytes).c_str(),
                     static_cast<unsigned long long>(r.handles), r.skipped.c_str());
        continue;
      }
      auto scale = [&](double ms) { return per_handle ? PerHandle(ms, r.handles) : PerGib(ms, sweep_bytes_); };
      for (const char* variant : {"after_release", "after_pause"}) {
        std::fprintf(out, "%-10s %8llu %-14s", FormatBytes(r.chunk_bytes).c_str(),
                     static_cast<unsigned long long>(r.handles), variant);
        for (const std::string& c : columns) {
          std::fprintf(out, " %*.3f", std::max<int>(9, c.size()), scale(P50(r.ms.at(variant).at(c))));
        }
        std::fprintf(out, "\n");
      }
      std::fprintf(out, "%-10s %8llu %-14s %*.3f  (create after a release - after a pause)\n",
                   FormatBytes(r.chunk_bytes).c_str(), static_cast<unsigned long long>(r.handles), "scrub", 9,
                   scale(r.scrub_ms()));
    }
  }
  for (const char* variant : {"after_release", "after_pause"}) {
    std::vector<std::string> parts;
    for (const SweepGroup& g : SweepGroups()) {
      const uint64_t best = Fastest(sweep_, variant, g.name);
      parts.push_back(absl::StrCat(g.name, " ", best == 0 ? "-" : FormatBytes(best)));
    }
    std::fprintf(out, "fastest per GiB, %s: %s\n", variant, absl::StrJoin(parts, ", ").c_str());
  }
  if (free_timeouts_ > 0) {
    std::fprintf(out, "warning: the free count did not come back within %d ms %llu times (timed as that)\n",
                 free_timeout_ms_, static_cast<unsigned long long>(free_timeouts_));
  }
}

std::string Bench::SweepJson() const {
  std::vector<std::string> sizes;
  for (const SweepSize& r : sweep_) {
    std::string j = absl::StrCat("{\"chunk_bytes\": ", r.chunk_bytes, ", \"handles\": ", r.handles);
    if (!r.skipped.empty()) {
      sizes.push_back(absl::StrCat(j, ", \"skipped\": ", Quote(r.skipped), "}"));
      continue;
    }
    auto stats = [&](const std::vector<double>& v) {
      return absl::StrCat("{", SampleFields(v), ", \"per_gib_ms\": ", Num(PerGib(P50(v), sweep_bytes_)),
                          ", \"per_handle_us\": ", Num(PerHandle(P50(v), r.handles)), "}");
    };
    for (const char* variant : {"after_release", "after_pause"}) {
      std::vector<std::string> parts;
      for (const auto& [name, v] : r.ms.at(variant)) parts.push_back(absl::StrCat(Quote(name), ": ", stats(v)));
      absl::StrAppend(&j, ", ", Quote(variant), ": {", absl::StrJoin(parts, ", "), "}");
    }
    const double scrub = r.scrub_ms();
    absl::StrAppend(&j, ", \"scrub\": {\"ms\": ", Num(scrub), ", \"per_gib_ms\": ", Num(PerGib(scrub, sweep_bytes_)),
                    ", \"per_handle_us\": ", Num(PerHandle(scrub, r.handles)), "}}");
    sizes.push_back(j);
  }
  std::vector<std::string> fastest;
  for (const char* variant : {"after_release", "after_pause"}) {
    std::vector<std::string> parts;
    for (const SweepGroup& g : SweepGroups()) {
      parts.push_back(absl::StrCat(Quote(g.name), ": ", Fastest(sweep_, variant, g.name)));
    }
    fastest.push_back(absl::StrCat(Quote(variant), ": {", absl::StrJoin(parts, ", "), "}"));
  }
  std::vector<std::string> size_list;
  for (const SweepSize& r : sweep_) size_list.push_back(absl::StrCat(r.chunk_bytes));
  return absl::StrFormat(
      "{\"program\": \"kvd_bench\", \"mode\": \"chunk_sweep\",\n \"device\": {\"backend\": %s, \"name\": %s, \"uuid\": "
      "%s, \"driver_version\": %s, \"total_bytes\": %d, \"granularity\": %d},\n \"config\": {\"bytes\": %d, \"reps\": "
      "%d, \"pause_ms\": %d, \"chunk_sizes\": [%s], \"free_timeouts\": %d, \"deadline_s\": %d},\n \"sizes\": [\n  "
      "%s],\n"
      " \"fastest\": {%s}}\n",
      Quote(backend_), Quote(raw_info_.name), Quote(raw_info_.uuid), Quote(raw_info_.driver_version),
      raw_info_.total_bytes, raw_info_.granularity, sweep_bytes_, o_.sweep_reps, pause_ms_,
      absl::StrJoin(size_list, ", "), free_timeouts_, o_.deadline_s, absl::StrJoin(sizes, ",\n  "),
      absl::StrJoin(fastest, ", "));
}

}  // namespace
}  // namespace kvd

int main(int argc, char** argv) {
  // Lift the soft open-file limit to the hard one (inherited by the kvd and the second process it starts):
  // the granule design passes FDs in batches of a few hundred, but a large fragmented pool holds one FD
  // per chunk in the daemon and a lease's worth in flight.
  kvd::RaiseOpenFileLimit();
  kvd::Options o;
  CLI::App app{
      "kvd_bench: the whole path through kvd (grow, a second process's attach, sleep, wake, shrink; the fragmented "
      "shape; Compact and an exact shrink to half against the bare calls of the same reshape; control-RPC latency; "
      "concurrent resizes; the daemon's bookkeeping) against the bare device calls in a "
      "bare pair of processes and, for the lifecycle, against in-process allocations (one for all the bytes, one "
      "per segment), interleaved, as medians, p99 and ratios; or, with --chunk-sweep, the device calls against the "
      "chunk size (docs/benchmarks.md)."};
  app.add_option("--socket", o.socket, "Use the running kvd on this gRPC socket (default: start one)");
  app.add_option("--kvd", o.kvd_binary, "The kvd program to start (default: next to kvd_bench, else on PATH)");
  app.add_option("--backend", o.backend, "Backend of the kvd it starts: auto, cuda or host")->capture_default_str();
  app.add_option("--device", o.device, "Device index")->capture_default_str();
  app.add_option("--budget", o.budget, "--budget of the kvd it starts")->capture_default_str();
  app.add_option("--bytes", o.bytes, "Pool size (default 128GiB on a GPU, 256MiB on host)");
  app.add_option("--segments", o.segments,
                 "Layers of the pool, one segment each under LBHNC (default 80 on a GPU, 8 on host)");
  app.add_option("--layout", o.layout,
                 "The pool's layout: LBHNC (layer-outermost, one segment per layer) or BLHNC (block-outermost, one "
                 "segment; the lifecycle, control_rpc, granule and torch sections only)")
      ->capture_default_str();
  app.add_option("--chunk", o.chunk, "--max-chunk of the kvd it starts (default: kvd's, 4GiB)");
  app.add_option("--reps", o.reps, "Repetitions of each measurement")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  app.add_option("--deadline-s", o.deadline_s,
                 "Start no lifecycle repetition after the first that would end more than this many seconds after "
                 "the start, by the longest one so far (0: none); config.lifecycle_reps says how many ran")
      ->capture_default_str()
      ->check(CLI::Range(0, 86400));
  app.add_option("--fragments", o.fragments, "Grows of the fragmented shape (default 16 on a GPU, 8 on host)");
  app.add_option("--compact-grows", o.compact_grows,
                 "Grows of equal size that fragment the compact line's pool of half --bytes (default 64 on a GPU, 8 "
                 "on host)");
  app.add_option("--compact-chunks-per-pause", o.compact_chunks_per_pause,
                 "CompactOptions::max_chunks_per_pause of the compact line's Compact (default 0: the daemon's "
                 "--compact-chunks-per-pause)");
  app.add_option("--sections", o.sections,
                 "The parts to run, comma-separated: lifecycle, fragmented, compact, shrink_to_half, control_rpc, "
                 "concurrent, reclaim, saturate, keep, bookkeeping, granule, torch (granule and torch compare with "
                 "lifecycle's grow + attach)")
      ->capture_default_str();
  app.add_option("--pause-ms", o.pause_ms, "The pause of the after_pause variants (default 2000 on a GPU, 20 on host)");
  app.add_option("--raw-release-first", o.raw_release_first,
                 "Who releases first in the raw lifecycle's sleep and shrink: importer (the exporter's release frees) "
                 "or exporter (the importer's release frees, as in kvd)")
      ->check(CLI::IsMember({"importer", "exporter"}))
      ->capture_default_str();
  app.add_option("--threads", o.threads, "Pools resized at once in the concurrent line")
      ->capture_default_str()
      ->check(CLI::Range(2, 64));
  app.add_option("--rpc-calls", o.rpc_calls, "Idle control RPCs of each kind (default 2000 on a GPU, 400 on host)");
  app.add_option("--watch-streams", o.watch_streams,
                 "Watch streams open during the control_rpc watch_streams line (clients of one pool)")
      ->check(CLI::Range(1, 256));
  app.add_option("--bookkeeping-bytes", o.bookkeeping_bytes,
                 "Pool grown one granule per segment at a time for the per-chunk bookkeeping (default 16GiB / 1GiB)");
  app.add_option("--keep-bytes", o.keep_bytes,
                 "Pool of the keep section (a sleep that keeps its contents in kvd's host tier, and the wake that "
                 "copies them back); the kvd kvd_bench starts gets --host-tier-bytes of this size (default: the "
                 "section is skipped)");
  app.add_option("--bookkeeping-pools", o.bookkeeping_pools, "Empty pools for the per-pool bookkeeping")
      ->capture_default_str();
  app.add_option("--granule-reps", o.granule_reps, "Repetitions of the granule design (default min(reps, 3))");
  app.add_option("--free-slack", o.free_slack,
                 "How close the free count must come to its value before the release plus the bytes released "
                 "(default one granule on a GPU, 8MiB on host, whose count is the machine's)");
  app.add_flag("--torch,!--no-torch", o.torch, "Compare with torch.zeros when python3 imports torch (CUDA)")
      ->capture_default_str();
  app.add_flag("--json", o.json, "One JSON document on stdout (the table goes to stderr)");
  app.add_flag("--chunk-sweep", o.chunk_sweep,
               "Instead of the rest: time create, map, export, import, map and release of --sweep-bytes as chunks of "
               "each --sweep-sizes through the device layer, after a release and after --pause-ms (no kvd)");
  app.add_option("--sweep-bytes", o.sweep_bytes, "Bytes of every round of the chunk sweep (default 32GiB / 256MiB)");
  app.add_option("--sweep-sizes", o.sweep_sizes,
                 "Chunk sizes of the sweep, comma-separated (default 2MiB,8MiB,32MiB,128MiB,512MiB,1GiB,2GiB,4GiB,8GiB,"
                 "16GiB on a GPU; 2MiB,8MiB,32MiB,128MiB on host)");
  app.add_option("--sweep-reps", o.sweep_reps, "Repetitions of each variant of each size in the chunk sweep")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  app.add_option("--child-fd", o.child_fd, "internal: run as the second process on this socket")->group("");
  app.add_option("--child-granularity", o.child_granularity, "internal")->group("");
  CLI11_PARSE(app, argc, argv);
  if (o.child_fd >= 0) return kvd::ChildMain(o.child_fd, o.backend, o.device, o.child_granularity);
  signal(SIGPIPE, SIG_IGN);
  kvd::Bench bench(o);
  const absl::Status s = bench.Run();
  if (!s.ok()) {
    std::fprintf(stderr, "kvd_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  bench.Print(o.json ? stderr : stdout);
  if (o.json) std::fputs(bench.Json().c_str(), stdout);
  return 0;
}
