// kvd_device_bench: the floor benchmark of docs/GPU.md. It commits `--total` bytes as chunks of each
// `--chunk` size twice per round, once through kvd::Device ("kvd") and once with the raw calls that
// Device wraps ("raw": cuMem* through the driver table on CUDA, memfd/mmap on host), and reports
// kvd's time per phase as a ratio to raw:
//
//   exporter (this process)   reserve, create, map+access, export         (then FDs go to the importer)
//   importer (a second one)   receive, reserve, import (+ close of the FD), map+access; unmap, release
//   exporter                  unmap, release
//
// The importer is this program re-executed with --child-socket; FDs travel with kvd::SendWithFds,
// kMaxFdsPerMessage (250) per message, over a SOCK_SEQPACKET pair. Each plan runs one warm-up round
// (which also pays for the importer's driver start) and then --reps rounds, kvd and raw alternating;
// the table shows each phase's median and minimum; a pause (--settle-ms) before each round lets the
// driver finish freeing the last round's memory. A second table times the block operations against a raw
// memset/memcpy of the same bytes. Progress goes to stderr; --json prints the results as JSON on
// stdout (the tables then go to stderr).
#include <fcntl.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/types/span.h"
#include "kvd/device.h"
#include "kvd/fd_passing.h"
#include "kvd/status.h"
#include "kvd/unique_fd.h"
#include "kvd/units.h"
#ifdef KVD_WITH_CUDA
#include "cuda/cuda_driver.h"
#endif

extern char** environ;

namespace kvd {
namespace {

using Clock = std::chrono::steady_clock;

double MsSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// ---------------------------------------------------------------------------------------------------
// The two ways of doing the lifecycle. Handles are opaque 64-bit values (a CUDA generic allocation
// handle, a memfd). Map includes setting access.

class Path {
 public:
  virtual ~Path() = default;
  virtual absl::StatusOr<uint64_t> Reserve(uint64_t bytes) = 0;
  virtual absl::Status Free(uint64_t va, uint64_t bytes) = 0;
  virtual absl::StatusOr<uint64_t> Create(uint64_t bytes) = 0;
  virtual absl::Status Map(uint64_t va, uint64_t handle, uint64_t bytes) = 0;
  virtual absl::StatusOr<int> Export(uint64_t handle, uint64_t bytes) = 0;
  virtual absl::StatusOr<uint64_t> Import(int fd, uint64_t bytes) = 0;
  virtual absl::Status Unmap(uint64_t va, uint64_t bytes) = 0;
  virtual absl::Status Release(uint64_t handle, uint64_t bytes) = 0;
  virtual absl::Status Write(uint64_t va, const void* src, uint64_t bytes) = 0;
  virtual absl::Status Read(void* dst, uint64_t va, uint64_t bytes) = 0;
  // Raw paths only: the floor of the block operations (one contiguous fill or copy, synchronous).
  virtual absl::Status Fill(uint64_t, uint64_t) { return absl::UnimplementedError("Fill"); }
  virtual absl::Status Copy(uint64_t, uint64_t, uint64_t) { return absl::UnimplementedError("Copy"); }
};

class KvdPath final : public Path {
 public:
  explicit KvdPath(Device* device) : device_(device) {}
  absl::StatusOr<uint64_t> Reserve(uint64_t bytes) override { return device_->Reserve(bytes); }
  absl::Status Free(uint64_t va, uint64_t bytes) override { return device_->Free(va, bytes); }
  absl::StatusOr<uint64_t> Create(uint64_t bytes) override {
    KVD_ASSIGN_OR_RETURN(Chunk chunk, device_->Create(bytes));
    return chunk.handle;
  }
  absl::Status Map(uint64_t va, uint64_t handle, uint64_t bytes) override {
    return device_->Map(va, Chunk{handle, bytes}, Access::kReadWrite);
  }
  absl::StatusOr<int> Export(uint64_t handle, uint64_t bytes) override { return device_->Export(Chunk{handle, bytes}); }
  absl::StatusOr<uint64_t> Import(int fd, uint64_t bytes) override {
    KVD_ASSIGN_OR_RETURN(Chunk chunk, device_->Import(fd, bytes));
    return chunk.handle;
  }
  absl::Status Unmap(uint64_t va, uint64_t bytes) override { return device_->Unmap(va, bytes); }
  absl::Status Release(uint64_t handle, uint64_t bytes) override { return device_->Release(Chunk{handle, bytes}); }
  absl::Status Write(uint64_t va, const void* src, uint64_t bytes) override {
    return device_->CopyFromHost(va, src, bytes);
  }
  absl::Status Read(void* dst, uint64_t va, uint64_t bytes) override { return device_->CopyToHost(dst, va, bytes); }

 private:
  Device* device_;
};

// memfd chunks mapped into a PROT_NONE reservation: what the host backend does, without its checks.
class RawHostPath final : public Path {
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
    UniqueFd fd(memfd_create("kvd-bench", MFD_CLOEXEC));
    if (!fd) return ErrnoStatus(errno, "memfd_create");
    if (ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0 ||
        fallocate(fd.get(), 0, 0, static_cast<off_t>(bytes)) != 0) {
      return ErrnoStatus(errno, "ftruncate/fallocate");
    }
    return static_cast<uint64_t>(fd.release());
  }
  absl::Status Map(uint64_t va, uint64_t handle, uint64_t bytes) override {
    void* p = mmap(reinterpret_cast<void*>(va), bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                   static_cast<int>(handle), 0);
    if (p == MAP_FAILED) return ErrnoStatus(errno, "mmap(MAP_SHARED | MAP_FIXED)");
    return absl::OkStatus();
  }
  absl::StatusOr<int> Export(uint64_t handle, uint64_t) override { return Dup(static_cast<int>(handle)); }
  absl::StatusOr<uint64_t> Import(int fd, uint64_t) override {
    KVD_ASSIGN_OR_RETURN(int own, Dup(fd));
    return static_cast<uint64_t>(own);
  }
  absl::Status Unmap(uint64_t va, uint64_t bytes) override {
    void* p = mmap(reinterpret_cast<void*>(va), bytes, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return ErrnoStatus(errno, "mmap(PROT_NONE | MAP_FIXED)");
    return absl::OkStatus();
  }
  absl::Status Release(uint64_t handle, uint64_t) override {
    if (close(static_cast<int>(handle)) != 0) return ErrnoStatus(errno, "close");
    return absl::OkStatus();
  }
  absl::Status Write(uint64_t va, const void* src, uint64_t bytes) override {
    std::memcpy(reinterpret_cast<void*>(va), src, bytes);
    return absl::OkStatus();
  }
  absl::Status Read(void* dst, uint64_t va, uint64_t bytes) override {
    std::memcpy(dst, reinterpret_cast<const void*>(va), bytes);
    return absl::OkStatus();
  }
  absl::Status Fill(uint64_t va, uint64_t bytes) override {
    std::memset(reinterpret_cast<void*>(va), 0, bytes);
    return absl::OkStatus();
  }
  absl::Status Copy(uint64_t dst, uint64_t src, uint64_t bytes) override {
    std::memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes);
    return absl::OkStatus();
  }

 private:
  static absl::StatusOr<int> Dup(int fd) {
    const int out = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (out < 0) return ErrnoStatus(errno, "fcntl(F_DUPFD_CLOEXEC)");
    return out;
  }
};

#ifdef KVD_WITH_CUDA
// The driver calls CudaDevice makes, made directly: the floor kvd is measured against.
class RawCudaPath final : public Path {
 public:
  static absl::StatusOr<std::unique_ptr<RawCudaPath>> Open(int ordinal, bool fabric) {
    KVD_ASSIGN_OR_RETURN(const CudaDriver* driver, LoadCudaDriver());
    auto path = std::unique_ptr<RawCudaPath>(new RawCudaPath(*driver));
    const CudaDriver& d = *driver;
    KVD_RETURN_IF_ERROR(CudaStatus(d, d.cuInit_(0), "cuInit"));
    KVD_RETURN_IF_ERROR(CudaStatus(d, d.cuDeviceGet_(&path->device_, ordinal), "cuDeviceGet"));
    KVD_RETURN_IF_ERROR(
        CudaStatus(d, d.cuDevicePrimaryCtxRetain_(&path->context_, path->device_), "cuDevicePrimaryCtxRetain"));
    KVD_RETURN_IF_ERROR(CudaStatus(d, d.cuCtxSetCurrent_(path->context_), "cuCtxSetCurrent"));
    path->prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    path->prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    path->prop_.location.id = ordinal;
    path->prop_.requestedHandleTypes = fabric
                                           ? static_cast<CUmemAllocationHandleType>(
                                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_FABRIC)
                                           : CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    size_t granularity = 0;
    KVD_RETURN_IF_ERROR(
        CudaStatus(d, d.cuMemGetAllocationGranularity_(&granularity, &path->prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                   "cuMemGetAllocationGranularity"));
    path->granularity_ = granularity;
    path->access_.location = path->prop_.location;
    path->access_.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    return path;
  }
  ~RawCudaPath() override {
    if (context_ != nullptr) (void)d_.cuDevicePrimaryCtxRelease_(device_);
  }

  absl::StatusOr<uint64_t> Reserve(uint64_t bytes) override {
    CUdeviceptr va = 0;
    KVD_RETURN_IF_ERROR(Check(d_.cuMemAddressReserve_(&va, bytes, granularity_, 0, 0), "cuMemAddressReserve"));
    return va;
  }
  absl::Status Free(uint64_t va, uint64_t bytes) override {
    return Check(d_.cuMemAddressFree_(va, bytes), "cuMemAddressFree");
  }
  absl::StatusOr<uint64_t> Create(uint64_t bytes) override {
    CUmemGenericAllocationHandle handle = 0;
    KVD_RETURN_IF_ERROR(Check(d_.cuMemCreate_(&handle, bytes, &prop_, 0), "cuMemCreate"));
    return handle;
  }
  absl::Status Map(uint64_t va, uint64_t handle, uint64_t bytes) override {
    KVD_RETURN_IF_ERROR(Check(d_.cuMemMap_(va, bytes, 0, handle, 0), "cuMemMap"));
    return Check(d_.cuMemSetAccess_(va, bytes, &access_, 1), "cuMemSetAccess");
  }
  absl::StatusOr<int> Export(uint64_t handle, uint64_t) override {
    int fd = -1;
    KVD_RETURN_IF_ERROR(
        Check(d_.cuMemExportToShareableHandle_(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
              "cuMemExportToShareableHandle"));
    return fd;
  }
  absl::StatusOr<uint64_t> Import(int fd, uint64_t) override {
    CUmemGenericAllocationHandle handle = 0;
    KVD_RETURN_IF_ERROR(
        Check(d_.cuMemImportFromShareableHandle_(&handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
              "cuMemImportFromShareableHandle"));
    return handle;
  }
  absl::Status Unmap(uint64_t va, uint64_t bytes) override { return Check(d_.cuMemUnmap_(va, bytes), "cuMemUnmap"); }
  absl::Status Release(uint64_t handle, uint64_t) override { return Check(d_.cuMemRelease_(handle), "cuMemRelease"); }
  absl::Status Write(uint64_t va, const void* src, uint64_t bytes) override {
    return Check(d_.cuMemcpyHtoD_(va, src, bytes), "cuMemcpyHtoD");
  }
  absl::Status Read(void* dst, uint64_t va, uint64_t bytes) override {
    return Check(d_.cuMemcpyDtoH_(dst, va, bytes), "cuMemcpyDtoH");
  }
  absl::Status Fill(uint64_t va, uint64_t bytes) override {
    KVD_RETURN_IF_ERROR(Check(d_.cuMemsetD8_(va, 0, bytes), "cuMemsetD8"));
    return Check(d_.cuCtxSynchronize_(), "cuCtxSynchronize");
  }
  absl::Status Copy(uint64_t dst, uint64_t src, uint64_t bytes) override {
    KVD_RETURN_IF_ERROR(Check(d_.cuMemcpyDtoD_(dst, src, bytes), "cuMemcpyDtoD"));
    return Check(d_.cuCtxSynchronize_(), "cuCtxSynchronize");
  }

 private:
  explicit RawCudaPath(const CudaDriver& driver) : d_(driver) {}
  absl::Status Check(CUresult r, const char* call) const {
    if (r == CUDA_SUCCESS) [[likely]]
      return absl::OkStatus();
    return CudaStatus(d_, r, call);
  }

  const CudaDriver& d_;
  CUdevice device_ = 0;
  CUcontext context_ = nullptr;
  uint64_t granularity_ = 0;
  CUmemAllocationProp prop_{};
  CUmemAccessDesc access_{};
};
#endif  // KVD_WITH_CUDA

// ---------------------------------------------------------------------------------------------------
// Options, shared by the exporter and the importer (which gets them on its command line).

struct Options {
  std::string backend = "auto";
  int device = 0;
  std::string total;
  std::vector<std::string> chunks;
  int reps = 3;
  int settle_ms = -1;  // -1: 500 on a GPU, 0 on host
  bool json = false;
  bool block_ops = true;
  std::string block_bytes;
  uint64_t block_segments = 0;
  uint64_t block_count = 0;
  std::string host_capacity = "0";
  std::string host_granularity = "2MiB";
  int child_socket = -1;  // set in the importer
};

absl::StatusOr<DeviceOptions> MakeDeviceOptions(const Options& o) {
  DeviceOptions d;
  d.backend = o.backend;
  d.index = o.device;
  KVD_ASSIGN_OR_RETURN(d.host_capacity, ParseBytes(o.host_capacity, "--host-capacity"));
  KVD_ASSIGN_OR_RETURN(d.host_granularity, ParseBytes(o.host_granularity, "--host-granularity"));
  return d;
}

absl::StatusOr<std::unique_ptr<Path>> OpenRawPath(BackendKind kind, const Options& o, bool fabric) {
  switch (kind) {
    case BackendKind::kHost:
      return std::unique_ptr<Path>(new RawHostPath());
    case BackendKind::kCuda:
#ifdef KVD_WITH_CUDA
    {
      KVD_ASSIGN_OR_RETURN(std::unique_ptr<RawCudaPath> raw, RawCudaPath::Open(o.device, fabric));
      return std::unique_ptr<Path>(std::move(raw));
    }
#endif
    case BackendKind::kHip:
      break;
  }
  (void)o;
  (void)fabric;
  return absl::UnimplementedError(absl::StrCat("no raw path for backend ", BackendName(kind)));
}

// ---------------------------------------------------------------------------------------------------
// Phases and rounds.

struct PhaseName {
  const char* key;    // in the importer's reply and in JSON
  const char* label;  // in the table
};
constexpr PhaseName kPhases[] = {
    {"exporter.reserve", "exporter reserve"}, {"exporter.create", "exporter create"},
    {"exporter.map", "exporter map+access"},  {"exporter.export", "exporter export"},
    {"exporter.total", "exporter total"},     {"importer.receive", "importer receive FDs"},
    {"importer.reserve", "importer reserve"}, {"importer.import", "importer import+close"},
    {"importer.map", "importer map+access"},  {"importer.total", "importer total"},
    {"importer.unmap", "importer unmap"},     {"importer.release", "importer release"},
    {"exporter.unmap", "exporter unmap"},     {"exporter.release", "exporter release"},
};
using Times = std::map<std::string, double>;  // phase key -> ms

constexpr size_t kMaxMessage = 4096;

// One exporter round: commit, export, hand the FDs to the importer and wait for its times, give back.
absl::StatusOr<Times> ExporterRound(Path& path, int socket, const char* mode, uint64_t total, uint64_t chunk,
                                    uint64_t token) {
  const uint64_t n = total / chunk;
  Times t;
  uint64_t va = 0;
  std::vector<uint64_t> handles;
  std::vector<int> fds;
  uint64_t mapped_begin = 0, mapped_end = 0, released = 0;
  handles.reserve(n);
  fds.reserve(n);
  absl::Cleanup undo = [&] {
    for (int fd : fds) close(fd);
    for (uint64_t i = mapped_begin; i < mapped_end; ++i) (void)path.Unmap(va + i * chunk, chunk);
    for (uint64_t i = released; i < handles.size(); ++i) (void)path.Release(handles[i], chunk);
    if (va != 0) (void)path.Free(va, total);
  };

  Clock::time_point start = Clock::now();
  KVD_ASSIGN_OR_RETURN(va, path.Reserve(total));
  t["exporter.reserve"] = MsSince(start);
  start = Clock::now();
  for (uint64_t i = 0; i < n; ++i) {
    KVD_ASSIGN_OR_RETURN(uint64_t handle, path.Create(chunk));
    handles.push_back(handle);
  }
  t["exporter.create"] = MsSince(start);
  start = Clock::now();
  for (; mapped_end < n; ++mapped_end)
    KVD_RETURN_IF_ERROR(path.Map(va + mapped_end * chunk, handles[mapped_end], chunk));
  t["exporter.map"] = MsSince(start);
  start = Clock::now();
  for (uint64_t i = 0; i < n; ++i) {
    KVD_ASSIGN_OR_RETURN(int fd, path.Export(handles[i], chunk));
    fds.push_back(fd);
  }
  t["exporter.export"] = MsSince(start);
  t["exporter.total"] = t["exporter.reserve"] + t["exporter.create"] + t["exporter.map"] + t["exporter.export"];

  // The importer checks that it sees these at the start of the first and the last chunk.
  const uint64_t last_token = ~token;
  KVD_RETURN_IF_ERROR(path.Write(va, &token, sizeof(token)));
  KVD_RETURN_IF_ERROR(path.Write(va + (n - 1) * chunk, &last_token, sizeof(last_token)));

  KVD_RETURN_IF_ERROR(SendWithFds(socket, absl::StrCat("round ", mode, " ", chunk, " ", n, " ", token), {}));
  for (uint64_t i = 0; i < n; i += kMaxFdsPerMessage) {
    const size_t count = std::min<uint64_t>(kMaxFdsPerMessage, n - i);
    KVD_RETURN_IF_ERROR(SendWithFds(socket, "fds", absl::MakeConstSpan(fds).subspan(i, count)));
  }
  for (int fd : fds) close(fd);  // in flight, the importer holds its own copies
  fds.clear();

  KVD_ASSIGN_OR_RETURN(MessageWithFds reply, ReceiveWithFds(socket, kMaxMessage));
  for (int fd : reply.fds) close(fd);
  std::vector<std::string> words = absl::StrSplit(reply.payload, ' ');
  if (words.empty() || words[0] != "ok") return absl::InternalError(absl::StrCat("importer: ", reply.payload));
  for (size_t i = 1; i < words.size(); ++i) {
    std::pair<std::string, std::string> kv = absl::StrSplit(words[i], absl::MaxSplits('=', 1));
    double ms = 0;
    if (!absl::SimpleAtod(kv.second, &ms)) return absl::InternalError(absl::StrCat("importer: bad reply ", words[i]));
    t[kv.first] = ms;
  }

  start = Clock::now();
  for (; mapped_begin < mapped_end; ++mapped_begin) KVD_RETURN_IF_ERROR(path.Unmap(va + mapped_begin * chunk, chunk));
  t["exporter.unmap"] = MsSince(start);
  start = Clock::now();
  for (; released < handles.size(); ++released) KVD_RETURN_IF_ERROR(path.Release(handles[released], chunk));
  t["exporter.release"] = MsSince(start);
  const uint64_t reserved = va;
  va = 0;
  KVD_RETURN_IF_ERROR(path.Free(reserved, total));
  return t;
}

// One importer round, after the header "round <mode> <chunk> <n> <token>": receive the FDs, import,
// map, check the tokens, give everything back. Returns the reply's times.
absl::StatusOr<std::string> ImporterRound(Path& path, int socket, uint64_t chunk, uint64_t n, uint64_t token) {
  Times t;
  std::vector<int> fds;
  std::vector<uint64_t> handles;
  uint64_t va = 0, mapped_begin = 0, mapped_end = 0, released = 0;
  size_t closed = 0;
  fds.reserve(n);
  handles.reserve(n);
  absl::Cleanup undo = [&] {
    for (size_t i = closed; i < fds.size(); ++i) close(fds[i]);
    for (uint64_t i = mapped_begin; i < mapped_end; ++i) (void)path.Unmap(va + i * chunk, chunk);
    for (uint64_t i = released; i < handles.size(); ++i) (void)path.Release(handles[i], chunk);
    if (va != 0) (void)path.Free(va, n * chunk);
  };

  Clock::time_point start = Clock::now();
  while (fds.size() < n) {
    KVD_ASSIGN_OR_RETURN(MessageWithFds m, ReceiveWithFds(socket, kMaxMessage));
    fds.insert(fds.end(), m.fds.begin(), m.fds.end());
  }
  t["importer.receive"] = MsSince(start);
  if (fds.size() != n) return absl::InternalError(absl::StrCat("received ", fds.size(), " FDs, expected ", n));

  start = Clock::now();
  KVD_ASSIGN_OR_RETURN(va, path.Reserve(n * chunk));
  t["importer.reserve"] = MsSince(start);
  start = Clock::now();
  for (; closed < n; ++closed) {
    KVD_ASSIGN_OR_RETURN(uint64_t handle, path.Import(fds[closed], chunk));
    handles.push_back(handle);
    close(fds[closed]);  // Note [FD hygiene] in docs/architecture.md: the importer closes each FD right after importing
                         // it
  }
  t["importer.import"] = MsSince(start);
  start = Clock::now();
  for (; mapped_end < n; ++mapped_end)
    KVD_RETURN_IF_ERROR(path.Map(va + mapped_end * chunk, handles[mapped_end], chunk));
  t["importer.map"] = MsSince(start);
  t["importer.total"] = t["importer.reserve"] + t["importer.import"] + t["importer.map"];

  uint64_t first = 0, last = 0;
  KVD_RETURN_IF_ERROR(path.Read(&first, va, sizeof(first)));
  KVD_RETURN_IF_ERROR(path.Read(&last, va + (n - 1) * chunk, sizeof(last)));
  if (first != token || last != ~token) {
    return absl::DataLossError(absl::StrFormat("the imported chunks hold %#x / %#x, not the exporter's %#x / %#x",
                                               first, last, token, ~token));
  }

  start = Clock::now();
  for (; mapped_begin < mapped_end; ++mapped_begin) KVD_RETURN_IF_ERROR(path.Unmap(va + mapped_begin * chunk, chunk));
  t["importer.unmap"] = MsSince(start);
  start = Clock::now();
  for (; released < handles.size(); ++released) KVD_RETURN_IF_ERROR(path.Release(handles[released], chunk));
  t["importer.release"] = MsSince(start);
  const uint64_t reserved = va;
  va = 0;
  KVD_RETURN_IF_ERROR(path.Free(reserved, n * chunk));

  std::string reply = "ok";
  for (const auto& [key, ms] : t) absl::StrAppendFormat(&reply, " %s=%.6f", key, ms);
  return reply;
}

// The importer process: serves rounds until the exporter closes the socket.
int ImporterMain(const Options& o) {
  const int socket = o.child_socket;
  absl::StatusOr<DeviceOptions> device_options = MakeDeviceOptions(o);
  std::unique_ptr<Device> device;
  std::unique_ptr<Path> kvd_path;
  std::unique_ptr<Path> raw_path;
  while (true) {
    absl::StatusOr<MessageWithFds> m = ReceiveWithFds(socket, kMaxMessage);
    if (!m.ok()) {
      if (absl::IsUnavailable(m.status())) return 0;  // the exporter is done
      std::fprintf(stderr, "kvd_device_bench (importer): %s\n", m.status().ToString().c_str());
      return 1;
    }
    for (int fd : m->fds) close(fd);
    std::vector<std::string> w = absl::StrSplit(m->payload, ' ');
    uint64_t chunk = 0, n = 0, token = 0;
    if (w.size() != 5 || w[0] != "round" || !absl::SimpleAtoi(w[2], &chunk) || !absl::SimpleAtoi(w[3], &n) ||
        !absl::SimpleAtoi(w[4], &token) || n == 0) {
      std::fprintf(stderr, "kvd_device_bench (importer): unexpected message \"%s\"\n", m->payload.c_str());
      return 1;
    }
    absl::StatusOr<std::string> reply = [&]() -> absl::StatusOr<std::string> {
      // Open lazily: the warm-up round pays for the driver's start.
      if (w[1] == "kvd" && kvd_path == nullptr) {
        KVD_RETURN_IF_ERROR(device_options.status());
        KVD_ASSIGN_OR_RETURN(device, OpenDevice(*device_options));
        kvd_path = std::make_unique<KvdPath>(device.get());
      }
      if (w[1] == "raw" && raw_path == nullptr) {
        KVD_RETURN_IF_ERROR(device_options.status());
        const BackendKind kind = o.backend == "cuda" ? BackendKind::kCuda : BackendKind::kHost;
        KVD_ASSIGN_OR_RETURN(raw_path, OpenRawPath(kind, o, /*fabric=*/false));
      }
      Path* path = w[1] == "kvd" ? kvd_path.get() : raw_path.get();
      if (path == nullptr) return absl::InvalidArgumentError(absl::StrCat("unknown mode ", w[1]));
      return ImporterRound(*path, socket, chunk, n, token);
    }();
    if (!reply.ok()) {
      // The FDs may still be in flight only if receiving failed, and then the socket is unusable anyway.
      std::string error = absl::StrCat("error ", reply.status().ToString());
      if (error.size() > kMaxMessage) error.resize(kMaxMessage);
      if (!SendWithFds(socket, error, {}).ok()) return 1;
      continue;
    }
    if (absl::Status s = SendWithFds(socket, *reply, {}); !s.ok()) {
      std::fprintf(stderr, "kvd_device_bench (importer): %s\n", s.ToString().c_str());
      return 1;
    }
  }
}

// Starts the importer: this program again, with one end of a SOCK_SEQPACKET pair.
absl::StatusOr<pid_t> SpawnImporter(const Options& o, const char* backend, int* socket) {
  int pair[2];
  if (socketpair(AF_UNIX, SOCK_SEQPACKET, 0, pair) != 0) return ErrnoStatus(errno, "socketpair");
  // Only the importer's end is inherited.
  if (fcntl(pair[0], F_SETFD, FD_CLOEXEC) != 0) return ErrnoStatus(errno, "fcntl(FD_CLOEXEC)");
  char self[4096];
  const ssize_t len = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (len <= 0) return ErrnoStatus(errno, "readlink(/proc/self/exe)");
  self[len] = '\0';
  std::vector<std::string> args = {self,
                                   absl::StrCat("--child-socket=", pair[1]),
                                   absl::StrCat("--backend=", backend),
                                   absl::StrCat("--device=", o.device),
                                   absl::StrCat("--host-capacity=", o.host_capacity),
                                   absl::StrCat("--host-granularity=", o.host_granularity)};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int err = posix_spawn(&pid, self, nullptr, nullptr, argv.data(), environ);
  close(pair[1]);
  if (err != 0) {
    close(pair[0]);
    return ErrnoStatus(err, "posix_spawn");
  }
  *socket = pair[0];
  return pid;
}

// ---------------------------------------------------------------------------------------------------
// Block operations: kvd's kernels against one contiguous raw fill/copy of the same bytes.

struct BlockOpResult {
  std::string op;
  uint64_t block_bytes = 0;
  uint64_t bytes_moved = 0;  // read + written
  double kvd_ms = 0;
  double raw_ms = 0;
};

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

absl::StatusOr<std::vector<BlockOpResult>> BenchBlockOps(Device& device, Path& raw, uint64_t segments,
                                                         uint64_t block_bytes, uint64_t blocks, int reps) {
  const uint64_t g = device.granularity();
  const uint64_t half = blocks / 2;
  const uint64_t stride = (blocks * block_bytes + g - 1) / g * g;
  const uint64_t span_bytes = segments * stride;
  const uint64_t packed_bytes = (half * segments * block_bytes + g - 1) / g * g;
  const uint64_t total = span_bytes + packed_bytes;
  KVD_ASSIGN_OR_RETURN(const uint64_t va, device.Reserve(total));
  absl::Cleanup free_va = [&] { (void)device.Free(va, total); };
  KVD_ASSIGN_OR_RETURN(const Chunk chunk, device.Create(total));
  absl::Cleanup release = [&] { (void)device.Release(chunk); };
  KVD_RETURN_IF_ERROR(device.Map(va, chunk, Access::kReadWrite));
  absl::Cleanup unmap = [&] { (void)device.Unmap(va, total); };

  const BlockSpan span{va, segments, stride, block_bytes, blocks};
  const uint64_t packed = va + span_bytes;
  std::vector<uint64_t> ids(half);
  std::vector<BlockCopy> copies(half);
  for (uint64_t i = 0; i < half; ++i) {
    ids[i] = i;
    copies[i] = {i, half + i};
  }
  const uint64_t moved = half * segments * block_bytes;
  auto time = [&](auto&& op) -> absl::StatusOr<double> {
    std::vector<double> ms;
    for (int r = 0; r <= reps; ++r) {  // the first is a warm-up
      const Clock::time_point start = Clock::now();
      KVD_RETURN_IF_ERROR(op());
      if (r > 0) ms.push_back(MsSince(start));
    }
    return Median(std::move(ms));
  };
  std::vector<BlockOpResult> out;
  auto add = [&](const char* name, uint64_t bytes, auto&& kvd_op, auto&& raw_op) -> absl::Status {
    BlockOpResult r{name, block_bytes, bytes};
    KVD_ASSIGN_OR_RETURN(r.kvd_ms, time(kvd_op));
    KVD_ASSIGN_OR_RETURN(r.raw_ms, time(raw_op));
    out.push_back(r);
    return absl::OkStatus();
  };
  KVD_RETURN_IF_ERROR(add(
      "zero_blocks", moved, [&] { return device.ZeroBlocks(span, ids); }, [&] { return raw.Fill(va, moved); }));
  KVD_RETURN_IF_ERROR(add(
      "copy_blocks", 2 * moved, [&] { return device.CopyBlocks(span, copies); },
      [&] { return raw.Copy(packed, va, moved); }));
  KVD_RETURN_IF_ERROR(add(
      "pack_blocks", 2 * moved, [&] { return device.PackBlocks(span, ids, packed); },
      [&] { return raw.Copy(packed, va, moved); }));
  KVD_RETURN_IF_ERROR(add(
      "unpack_blocks", 2 * moved, [&] { return device.UnpackBlocks(span, packed, ids); },
      [&] { return raw.Copy(va, packed, moved); }));
  return out;
}

// ---------------------------------------------------------------------------------------------------
// The exporter: plans, rounds, tables.

struct PlanResult {
  uint64_t chunk = 0;
  uint64_t handles = 0;
  std::map<std::string, double> kvd_ms, raw_ms;          // medians
  std::map<std::string, double> kvd_min_ms, raw_min_ms;  // fastest rounds
};

std::string Ratio(double kvd, double raw) { return raw > 0 ? absl::StrFormat("%.2f", kvd / raw) : "-"; }

int ExporterMain(const Options& o) {
  auto fail = [](const absl::Status& s) {
    std::fprintf(stderr, "kvd_device_bench: %s\n", s.ToString().c_str());
    return 1;
  };
  absl::StatusOr<DeviceOptions> device_options = MakeDeviceOptions(o);
  if (!device_options.ok()) return fail(device_options.status());
  absl::StatusOr<std::unique_ptr<Device>> opened = OpenDevice(*device_options);
  if (!opened.ok()) return fail(opened.status());
  Device& device = **opened;
  absl::StatusOr<DeviceInfo> info = device.Info();
  if (!info.ok()) return fail(info.status());
  const bool gpu = device.kind() != BackendKind::kHost;

  // Defaults by backend: the floor of docs/GPU.md on a GPU, something a CI machine can hold on host.
  absl::StatusOr<uint64_t> total = ParseBytes(o.total.empty() ? (gpu ? "32GiB" : "1GiB") : o.total, "--total");
  if (!total.ok()) return fail(total.status());
  std::vector<std::string> chunk_texts = o.chunks;
  if (chunk_texts.empty())
    chunk_texts = gpu ? std::vector<std::string>{"1GiB", "2MiB"} : std::vector<std::string>{"64MiB", "2MiB"};
  std::vector<uint64_t> chunks;
  for (const std::string& text : chunk_texts) {
    absl::StatusOr<uint64_t> chunk = ParseBytes(text, "--chunk");
    if (!chunk.ok()) return fail(chunk.status());
    if (*chunk == 0 || *chunk % info->granularity != 0 || *total % *chunk != 0 || *total == 0) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("--chunk=", text, ": must be a positive multiple of the granularity (",
                       FormatBytes(info->granularity), ") dividing --total (", FormatBytes(*total), ")")));
    }
    chunks.push_back(*chunk);
  }

  if (rlimit files{}; getrlimit(RLIMIT_NOFILE, &files) == 0) {
    const uint64_t most = *total / *std::min_element(chunks.begin(), chunks.end());
    if (files.rlim_cur != RLIM_INFINITY && files.rlim_cur < most + 64) {
      return fail(absl::FailedPreconditionError(
          absl::StrCat("the open-file limit (", files.rlim_cur, ") is below the ", most, " FDs a plan holds at once")));
    }
  }

  absl::StatusOr<std::unique_ptr<Path>> raw = OpenRawPath(device.kind(), o, info->fabric_handles);
  if (!raw.ok()) return fail(raw.status());
  KvdPath kvd_path(&device);

  int socket = -1;
  absl::StatusOr<pid_t> child = SpawnImporter(o, BackendName(device.kind()), &socket);
  if (!child.ok()) return fail(child.status());
  absl::Cleanup reap = [&] {
    close(socket);
    int status = 0;
    waitpid(*child, &status, 0);
  };

  const std::string device_line = absl::StrFormat(
      "backend %s: %s %s, driver %s, %s of %s free, granularity %s, fabric handles %s", BackendName(device.kind()),
      info->name, info->uuid, info->driver_version.empty() ? "-" : info->driver_version, FormatBytes(info->free_bytes),
      FormatBytes(info->total_bytes), FormatBytes(info->granularity), info->fabric_handles ? "yes" : "no");
  std::fprintf(stderr, "kvd_device_bench: %s\n", device_line.c_str());

  const int settle_ms = o.settle_ms >= 0 ? o.settle_ms : (gpu ? 500 : 0);
  std::mt19937_64 rng(std::random_device{}());
  std::vector<PlanResult> plans;
  for (const uint64_t chunk : chunks) {
    PlanResult plan{chunk, *total / chunk, {}, {}};
    std::map<std::string, std::vector<double>> kvd_runs, raw_runs;
    for (int round = 0; round <= o.reps; ++round) {
      for (const bool is_kvd : {true, false}) {
        const char* mode = is_kvd ? "kvd" : "raw";
        Path& path = is_kvd ? static_cast<Path&>(kvd_path) : **raw;
        // Let the driver finish with the memory the last round released (its scrubbing otherwise
        // lands on whichever path runs next).
        std::this_thread::sleep_for(std::chrono::milliseconds(settle_ms));
        absl::StatusOr<Times> t = ExporterRound(path, socket, mode, *total, chunk, rng());
        if (!t.ok()) return fail(t.status());
        std::fprintf(
            stderr, "kvd_device_bench: %s as %llu x %s, round %d/%d%s %s: exporter %.1f ms, importer %.1f ms\n",
            FormatBytes(*total).c_str(), static_cast<unsigned long long>(plan.handles), FormatBytes(chunk).c_str(),
            round, o.reps, round == 0 ? " (warm-up)" : "", mode, (*t)["exporter.total"], (*t)["importer.total"]);
        if (round == 0) continue;
        for (const auto& [key, ms] : *t) (is_kvd ? kvd_runs : raw_runs)[key].push_back(ms);
      }
    }
    for (const auto& [key, runs] : kvd_runs) {
      plan.kvd_ms[key] = Median(runs);
      plan.kvd_min_ms[key] = *std::min_element(runs.begin(), runs.end());
    }
    for (const auto& [key, runs] : raw_runs) {
      plan.raw_ms[key] = Median(runs);
      plan.raw_min_ms[key] = *std::min_element(runs.begin(), runs.end());
    }
    plans.push_back(std::move(plan));
  }

  std::vector<BlockOpResult> block_ops;
  if (o.block_ops) {
    const uint64_t segments = o.block_segments ? o.block_segments : (gpu ? 64 : 8);
    const uint64_t count = o.block_count ? o.block_count : (gpu ? 1024 : 128);
    absl::StatusOr<uint64_t> bytes = ParseBytes(o.block_bytes.empty() ? "64KiB" : o.block_bytes, "--block-bytes");
    if (!bytes.ok()) return fail(bytes.status());
    // The aligned geometry and the same one a byte longer (the kernels' unaligned path).
    for (const uint64_t block_bytes : {*bytes, *bytes + 1}) {
      std::fprintf(stderr, "kvd_device_bench: block ops, %llu segments x %llu blocks of %llu bytes\n",
                   static_cast<unsigned long long>(segments), static_cast<unsigned long long>(count),
                   static_cast<unsigned long long>(block_bytes));
      absl::StatusOr<std::vector<BlockOpResult>> r =
          BenchBlockOps(device, **raw, segments, block_bytes, count, std::max(o.reps, 3));
      if (!r.ok()) return fail(r.status());
      block_ops.insert(block_ops.end(), r->begin(), r->end());
    }
  }

  // The tables: on stdout, or on stderr when stdout carries JSON.
  FILE* table = o.json ? stderr : stdout;
  std::fprintf(table, "%s\n", device_line.c_str());
  for (const PlanResult& plan : plans) {
    std::fprintf(table, "\n%s as %llu chunks of %s, median of %d rounds\n", FormatBytes(*total).c_str(),
                 static_cast<unsigned long long>(plan.handles), FormatBytes(plan.chunk).c_str(), o.reps);
    std::fprintf(table, "%-24s %12s %12s %8s %12s %12s\n", "phase", "kvd ms", "raw ms", "kvd/raw", "kvd min ms",
                 "raw min ms");
    for (const PhaseName& p : kPhases) {
      const double k = plan.kvd_ms.count(p.key) ? plan.kvd_ms.at(p.key) : 0;
      const double r = plan.raw_ms.count(p.key) ? plan.raw_ms.at(p.key) : 0;
      const double kmin = plan.kvd_min_ms.count(p.key) ? plan.kvd_min_ms.at(p.key) : 0;
      const double rmin = plan.raw_min_ms.count(p.key) ? plan.raw_min_ms.at(p.key) : 0;
      std::fprintf(table, "%-24s %12.3f %12.3f %8s %12.3f %12.3f\n", p.label, k, r, Ratio(k, r).c_str(), kmin, rmin);
    }
  }
  if (!block_ops.empty()) {
    std::fprintf(table,
                 "\nblock ops (raw: one contiguous memset/memcpy of the same bytes), GB/s of bytes read + written\n");
    std::fprintf(table, "%-14s %11s %10s %10s %10s %10s %8s\n", "op", "block bytes", "MiB moved", "kvd ms", "raw ms",
                 "kvd GB/s", "kvd/raw");
    for (const BlockOpResult& r : block_ops) {
      std::fprintf(table, "%-14s %11llu %10.1f %10.3f %10.3f %10.1f %8s\n", r.op.c_str(),
                   static_cast<unsigned long long>(r.block_bytes), r.bytes_moved / 1048576.0, r.kvd_ms, r.raw_ms,
                   r.kvd_ms > 0 ? r.bytes_moved / r.kvd_ms / 1e6 : 0.0, Ratio(r.kvd_ms, r.raw_ms).c_str());
    }
  }
  std::fflush(table);

  if (o.json) {
    auto quote = [](absl::string_view s) {
      std::string out = "\"";
      for (char c : s) {
        if (c == '"' || c == '\\') out.push_back('\\');
        if (static_cast<unsigned char>(c) >= 0x20) out.push_back(c);
      }
      return out + "\"";
    };
    std::string j = absl::StrFormat(
        "{\"backend\": %s, \"device\": {\"name\": %s, \"uuid\": %s, \"driver_version\": %s, \"total_bytes\": %d, "
        "\"free_bytes\": %d, \"granularity\": %d, \"fabric_handles\": %s},\n \"total_bytes\": %d, \"reps\": %d, "
        "\"plans\": [",
        quote(BackendName(device.kind())), quote(info->name), quote(info->uuid), quote(info->driver_version),
        info->total_bytes, info->free_bytes, info->granularity, info->fabric_handles ? "true" : "false", *total,
        o.reps);
    for (size_t i = 0; i < plans.size(); ++i) {
      const PlanResult& plan = plans[i];
      absl::StrAppendFormat(&j, "%s\n  {\"chunk_bytes\": %d, \"handles\": %d, \"phases\": {", i ? "," : "", plan.chunk,
                            plan.handles);
      bool first = true;
      for (const PhaseName& p : kPhases) {
        const double k = plan.kvd_ms.count(p.key) ? plan.kvd_ms.at(p.key) : 0;
        const double r = plan.raw_ms.count(p.key) ? plan.raw_ms.at(p.key) : 0;
        const double kmin = plan.kvd_min_ms.count(p.key) ? plan.kvd_min_ms.at(p.key) : 0;
        const double rmin = plan.raw_min_ms.count(p.key) ? plan.raw_min_ms.at(p.key) : 0;
        absl::StrAppendFormat(
            &j,
            "%s\n    \"%s\": {\"kvd_ms\": %.4f, \"raw_ms\": %.4f, \"ratio\": %s, \"kvd_min_ms\": %.4f, "
            "\"raw_min_ms\": %.4f}",
            first ? "" : ",", p.key, k, r, r > 0 ? absl::StrFormat("%.4f", k / r) : "null", kmin, rmin);
        first = false;
      }
      j += "}}";
    }
    j += "],\n \"block_ops\": [";
    for (size_t i = 0; i < block_ops.size(); ++i) {
      const BlockOpResult& r = block_ops[i];
      absl::StrAppendFormat(&j,
                            "%s\n  {\"op\": \"%s\", \"block_bytes\": %d, \"bytes_moved\": %d, \"kvd_ms\": %.4f, "
                            "\"raw_ms\": %.4f, \"kvd_gbps\": %.2f, \"raw_gbps\": %.2f}",
                            i ? "," : "", r.op, r.block_bytes, r.bytes_moved, r.kvd_ms, r.raw_ms,
                            r.kvd_ms > 0 ? r.bytes_moved / r.kvd_ms / 1e6 : 0.0,
                            r.raw_ms > 0 ? r.bytes_moved / r.raw_ms / 1e6 : 0.0);
    }
    j += "]}\n";
    std::fputs(j.c_str(), stdout);
  }
  return 0;
}

}  // namespace
}  // namespace kvd

int main(int argc, char** argv) {
  // Both processes hold one FD per chunk at once (16384 for 32 GiB as 2 MiB chunks): lift the soft limit.
  kvd::RaiseOpenFileLimit();
  kvd::Options o;
  CLI::App app{
      "kvd_device_bench: commits --total bytes as chunks of each --chunk size through kvd::Device and through the raw "
      "driver calls, imports them in a second process, and prints ms per phase for both with the ratio kvd/raw (the "
      "floor of docs/GPU.md), then the block operations' throughput."};
  app.add_option("--backend", o.backend, "auto, cuda or host")->capture_default_str();
  app.add_option("--device", o.device, "device index")->capture_default_str();
  app.add_option("--total", o.total, "bytes committed per plan (default 32GiB on a GPU, 1GiB on host)");
  app.add_option("--chunk", o.chunks, "chunk sizes, one plan each (default 1GiB,2MiB on a GPU, 64MiB,2MiB on host)")
      ->delimiter(',');
  app.add_option("--settle-ms", o.settle_ms, "pause before each round (default 500 on a GPU, 0 on host)");
  app.add_option("--reps", o.reps, "timed rounds per plan and path, after one warm-up round")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  app.add_flag("--json", o.json, "print the results as JSON on stdout (the tables go to stderr)");
  app.add_flag("--block-ops,!--no-block-ops", o.block_ops, "also time the block operations")->capture_default_str();
  app.add_option("--block-bytes", o.block_bytes, "block bytes per segment for the block operations (default 64KiB)");
  app.add_option("--block-segments", o.block_segments, "segments for the block operations (default 64 GPU, 8 host)");
  app.add_option("--block-count", o.block_count,
                 "committed blocks for the block operations (default 1024 GPU, 128 host)");
  app.add_option("--host-capacity", o.host_capacity, "host backend: capacity (0: physical memory)")
      ->capture_default_str();
  app.add_option("--host-granularity", o.host_granularity, "host backend: granularity")->capture_default_str();
  app.add_option("--child-socket", o.child_socket, "internal: run as the importer on this socket")->group("");
  CLI11_PARSE(app, argc, argv);
  return o.child_socket >= 0 ? kvd::ImporterMain(o) : kvd::ExporterMain(o);
}
