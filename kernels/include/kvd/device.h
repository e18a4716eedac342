// The device layer: the one interface between kvd and a memory backend (host memfd, CUDA VMM,
// HIP VMM). Everything vendor-specific lives behind it; no CUresult, hipError_t or errno crosses it.
//
// Ownership. A Device owns nothing the caller cannot see: every reservation, chunk and mapping it
// hands out must be given back by the caller (Free, Release, Unmap). Exported FDs belong to the
// caller, who closes them; Import never takes ownership of the FD it is given, so an importer can
// close it right after importing (the imported chunk keeps the memory alive).
//
// Threads. Every method is safe to call from any thread, concurrently.
//
// Errors. absl::Status with the vendor call and its raw code in the message: out of memory is
// RESOURCE_EXHAUSTED, bad size/alignment INVALID_ARGUMENT, no driver/device UNAVAILABLE, a backend
// that was not built UNIMPLEMENTED, anything else INTERNAL. A failed call leaves nothing allocated.
//
// Sizes and addresses passed to Reserve/Create/Map/Unmap are multiples of granularity().
//
// Misuse. Every backend tracks its reservations, mappings and live chunks (kernels/va_book.h) and
// checks each call before the driver sees it, so a mistake is a Status, never a GPU fault or memory
// corruption, and the same mistake gives the same code on every backend (the conformance suite checks
// it). The rule: INVALID_ARGUMENT when the call names something that is not this device's (an
// unaligned size or address, a range outside every reservation, a handle that is not a live chunk);
// FAILED_PRECONDITION when it names this device's memory in the wrong state (mapped where it must
// not be, unmapped or read-only where it must be mapped and writable). Messages name the call and the
// range or chunk. Per call:
//   Reserve, Create, Import  size 0 or not a multiple of granularity(): INVALID_ARGUMENT.
//   Free        [va, va + bytes) is not exactly one live reservation: INVALID_ARGUMENT;
//               it still holds mappings: FAILED_PRECONDITION.
//   Release     not a live chunk (unknown handle, another size, released already): INVALID_ARGUMENT.
//   Map         va unaligned, chunk not live (unknown handle or another size), or the range not
//               inside one reservation: INVALID_ARGUMENT; the range overlaps a mapping:
//               FAILED_PRECONDITION. A chunk may be mapped at several places.
//   Unmap       va or bytes unaligned, the range not inside one reservation, or it cuts a mapping
//               (holds part of one): INVALID_ARGUMENT. Unmapped parts of the range are left alone,
//               so unmapping a whole reservation with holes is fine.
//   Export      not a live chunk: INVALID_ARGUMENT.
//   CopyToHost, CopyFromHost, CopyRange, ZeroBlocks, CopyBlocks, PackBlocks, UnpackBlocks
//               a null host pointer, a malformed span (its extent overflows, its segments overlap),
//               CopyRange's two ranges overlapping, or a range touched that is not inside one
//               reservation of this device: INVALID_ARGUMENT; any byte touched that is reserved but
//               not mapped, or mapped read-only where the call writes: FAILED_PRECONDITION. Nothing
//               is touched then.
// A call that fails, for misuse or in the driver, leaves the device's bookkeeping as it was (an Unmap
// over several mappings that fails in the driver part way leaves the ones before unmapped). Backend
// rules beyond these (HIP before 7.12 refuses a second mapping in a reservation) are
// FAILED_PRECONDITION and stated in the backend's header.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvd {

enum class BackendKind { kHost, kCuda, kHip };

// "host", "cuda", "hip".
const char* BackendName(BackendKind kind);

struct DeviceInfo {
  BackendKind backend = BackendKind::kHost;
  int index = 0;
  std::string name;             // "NVIDIA H200", "host memory (memfd)"
  std::string uuid;             // "GPU-…" on CUDA and HIP, "host-<boot id>-<index>" on host
  std::string driver_version;   // empty on host
  uint64_t total_bytes = 0;     // physical memory of the device (host: the configured capacity)
  uint64_t free_bytes = 0;      // as the driver reports it now
  uint64_t granularity = 0;     // allocation and mapping granularity
  bool fabric_handles = false;  // chunks can also be exported as CU_MEM_HANDLE_TYPE_FABRIC bytes
};

// One physical allocation. A plain value: copying it does not duplicate the memory, and exactly one
// copy must be passed to Device::Release. `handle` is backend-specific (a CUDA/HIP generic
// allocation handle; a memfd on host).
struct Chunk {
  uint64_t handle = 0;
  uint64_t bytes = 0;
};

// Where one pool's blocks live, in the terms the block operations need. The pool is `segments`
// contiguous runs starting at base + s * segment_stride; block b of segment s is the
// `block_bytes` bytes at base + s * segment_stride + b * block_bytes. A packed block is its
// segments' runs back to back in segment order (segments * block_bytes bytes).
// See Note [Block operations see runs, not dims] in docs/architecture.md.
struct BlockSpan {
  uint64_t base = 0;
  uint64_t segments = 0;
  uint64_t segment_stride = 0;
  uint64_t block_bytes = 0;
  uint64_t blocks = 0;  // valid block ids are [0, blocks): the committed blocks
  uint64_t packed_block_bytes() const { return segments * block_bytes; }
};

struct BlockCopy {
  uint64_t src = 0;
  uint64_t dst = 0;
};

enum class Access { kReadWrite, kRead };

// One way of sharing memory, as established by a probe with a real allocation when the device was
// opened (an attribute alone is not trusted: CUDA reports fabric support on nodes without an IMEX
// channel, where every fabric export fails).
struct Capability {
  bool supported = false;
  std::string detail;  // how it was established, or why not ("UNIMPLEMENTED: ...", the failed call)
};

struct PeerCapability {
  int index = 0;     // as this process numbers the devices
  std::string uuid;  // DeviceInfo::uuid of that device
  bool access = false;
  std::string detail;  // the query that decided
};

// What a device's memory can be shared as, for KV connectors (docs/connectors.md).
struct DeviceCapabilities {
  Capability posix_fd;  // Export: one FD per chunk, imported with Import
  Capability fabric;    // CU_MEM_HANDLE_TYPE_FABRIC bytes per chunk (across an NVLink domain)
  // ExportRange: one FD over a mapped range (CUDA: a DMA-BUF that an RDMA NIC registers; host: the
  // range's memfd, which a host-memory connector maps or registers).
  Capability dma_buf;
  // Whether ExportRange covers a range of several chunks with one FD (CUDA's DMA-BUF does). When false,
  // a range is exported chunk by chunk: each chunk's Export FD with the offset into it.
  bool range_spans_chunks = false;
  // An RDMA NIC can register this device's VMM chunks (GPUDirect RDMA with VMM): chunks are created
  // with the RDMA flag and their DMA-BUF export was probed; no NIC registration is tried.
  Capability gpu_direct_rdma;
  std::vector<PeerCapability> peers;  // every other device this process can see
};

class Device {
 public:
  virtual ~Device() = default;

  virtual BackendKind kind() const = 0;
  virtual uint64_t granularity() const = 0;
  // Name, UUID and the memory the driver reports now.
  [[nodiscard]] virtual absl::StatusOr<DeviceInfo> Info() = 0;

  // Virtual address space, no physical memory. The VA stays reserved until Free.
  [[nodiscard]] virtual absl::StatusOr<uint64_t> Reserve(uint64_t bytes) = 0;
  // `va` and `bytes` exactly as Reserve gave them (else INVALID_ARGUMENT), with every mapping in
  // the reservation unmapped first (else FAILED_PRECONDITION).
  [[nodiscard]] virtual absl::Status Free(uint64_t va, uint64_t bytes) = 0;

  // Physical memory, really allocated now: RESOURCE_EXHAUSTED here, never a fault on first touch.
  [[nodiscard]] virtual absl::StatusOr<Chunk> Create(uint64_t bytes) = 0;
  // Drops this holder's reference; the memory is freed once no mapping or FD of any process holds it.
  // A chunk may be released while mapped (the mapping keeps the memory); from then on its handle is
  // not live: Release, Export and Map of it are INVALID_ARGUMENT.
  [[nodiscard]] virtual absl::Status Release(const Chunk& chunk) = 0;

  // Maps the whole chunk at `va` (inside a reservation) with `access` for this device.
  // INVALID_ARGUMENT: unaligned va, chunk not live, range not inside one reservation.
  // FAILED_PRECONDITION: the range overlaps a mapping.
  [[nodiscard]] virtual absl::Status Map(uint64_t va, const Chunk& chunk, Access access) = 0;
  // The range becomes reserved-but-unbacked again and can be mapped anew. It lies inside one
  // reservation and holds whole mappings only (INVALID_ARGUMENT otherwise); holes are fine.
  [[nodiscard]] virtual absl::Status Unmap(uint64_t va, uint64_t bytes) = 0;

  // A new FD referring to the chunk's memory, owned by the caller. Export once per chunk and
  // dup() the FD for each consumer: re-exporting is slow on GPUs. INVALID_ARGUMENT for a chunk that
  // is not live.
  [[nodiscard]] virtual absl::StatusOr<int> Export(const Chunk& chunk) = 0;
  // A chunk of this process referring to the memory behind `fd` (which stays the caller's). `bytes`
  // is the caller's word: the host backend checks it against the memfd (INVALID_ARGUMENT), GPU drivers
  // cannot report an imported allocation's size, so there a too-large `bytes` fails at Map instead.
  [[nodiscard]] virtual absl::StatusOr<Chunk> Import(int fd, uint64_t bytes) = 0;

  // Copies between mapped device memory and host memory (for tests, tools and preserve-on-sleep).
  // The device range must be mapped by this device, and mapped read-write for CopyFromHost
  // (codes: "Misuse" above); bytes == 0 is a no-op. Each returns once the bytes are in place (a GPU
  // backend waits for the DMA), so the range may be unmapped right after.
  [[nodiscard]] virtual absl::Status CopyToHost(void* dst, uint64_t src_va, uint64_t bytes) = 0;
  [[nodiscard]] virtual absl::Status CopyFromHost(uint64_t dst_va, const void* src, uint64_t bytes) = 0;
  // Copies between two ranges of this device's mapped memory, on the device: [src_va, src_va + bytes)
  // mapped, [dst_va, dst_va + bytes) mapped read-write (codes: "Misuse" above), the two not overlapping
  // (INVALID_ARGUMENT). Returns once the bytes are in place; bytes == 0 is a no-op. The daemon moves a
  // chunk's bytes into its replacement with it (Note [Chunks are replaced, not cut] in docs/architecture.md).
  [[nodiscard]] virtual absl::Status CopyRange(uint64_t dst_va, uint64_t src_va, uint64_t bytes) = 0;

  // Host memory the daemon keeps (the host tier, docs/operations.md "The host tier"), registered with the driver
  // once so that CopyToHost and CopyFromHost to it run at DMA speed with no pinning on the copy's path
  // (CUDA: cuMemHostRegister, portable; HIP: hipHostRegister, portable; host: nothing to do, OK). `host` and
  // `bytes` are page-aligned, `bytes` > 0 (INVALID_ARGUMENT otherwise). RESOURCE_EXHAUSTED when the driver
  // cannot pin that much. UnregisterHost takes exactly the `host` a RegisterHost was given.
  [[nodiscard]] virtual absl::Status RegisterHost(void* host, uint64_t bytes);
  [[nodiscard]] virtual absl::Status UnregisterHost(void* host);
  // The host NUMA node the device is attached to, from the PCI device's sysfs numa_node
  // (/sys/bus/pci/devices/<bus id>/numa_node); -1 when the machine does not say (no NUMA, a host backend,
  // sysfs unreadable).
  virtual int NumaNode() const;

  // Block operations (Note [Block operations see runs, not dims] in docs/architecture.md). Block ids must be <
  // span.blocks; in CopyBlocks no dst may repeat or also be a src. Pack writes blocks.size() packed blocks to device
  // memory at `dst`; Unpack reads them from `src`. Each returns once the device has finished. Every run the call reads
  // must be mapped, and every run it writes mapped read-write (codes: "Misuse" above); an empty
  // list of blocks or copies is a no-op.
  [[nodiscard]] virtual absl::Status ZeroBlocks(const BlockSpan& span, absl::Span<const uint64_t> blocks) = 0;
  [[nodiscard]] virtual absl::Status CopyBlocks(const BlockSpan& span, absl::Span<const BlockCopy> copies) = 0;
  [[nodiscard]] virtual absl::Status PackBlocks(const BlockSpan& span, absl::Span<const uint64_t> blocks,
                                                uint64_t dst) = 0;
  [[nodiscard]] virtual absl::Status UnpackBlocks(const BlockSpan& span, uint64_t src,
                                                  absl::Span<const uint64_t> blocks) = 0;

  // OK when memory created on the device whose DeviceInfo::uuid is `owner_uuid` (another device of this
  // node, or this one) can be imported here and mapped with access for this device (peer access).
  // FAILED_PRECONDITION naming both devices when the pair has no peer access (CUDA:
  // cuDeviceCanAccessPeer == 0; HIP: hipDeviceCanAccessPeer) or the owner belongs to another backend;
  // NOT_FOUND when this process cannot see the owner (say so: CUDA_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES).
  // INVALID_ARGUMENT for an empty `owner_uuid`. Map of an imported chunk grants this device access
  // (docs/backends.md, "Peer access"); no other call is needed.
  // See Note [Peer access is granted by the pool and checked by the importer] in docs/architecture.md.
  [[nodiscard]] virtual absl::Status CheckPeerAccess(absl::string_view owner_uuid) = 0;

  // What this device's memory can be shared as: probed once when the device was opened (the probes
  // allocate and release real memory then), so this is cheap. The default describes a backend with
  // POSIX-FD chunk exports only.
  virtual DeviceCapabilities Capabilities() const;
  // A new FD (the caller's) referring to [va, va + bytes) of this device's mapped memory, for backends
  // whose Capabilities() say range_spans_chunks (CUDA: cuMemGetHandleForAddressRange, a DMA-BUF).
  // `va` and `bytes` are multiples of granularity(); every byte must be mapped by this device.
  // INVALID_ARGUMENT / FAILED_PRECONDITION as "Misuse" above; UNIMPLEMENTED where the backend has no
  // range export (the default).
  [[nodiscard]] virtual absl::StatusOr<int> ExportRange(uint64_t va, uint64_t bytes);
  // The chunk as CU_MEM_HANDLE_TYPE_FABRIC bytes (64 opaque bytes an importer anywhere in the NVLink
  // domain passes to cuMemImportFromShareableHandle), for backends whose Capabilities() say fabric.
  // INVALID_ARGUMENT for a chunk that is not live; UNIMPLEMENTED where the backend has none (the default).
  [[nodiscard]] virtual absl::StatusOr<std::string> ExportFabricHandle(const Chunk& chunk);
};

struct DeviceOptions {
  // "auto" (CUDA when a driver and device are present, else host), "host", "cuda", "hip".
  std::string backend = "auto";
  // The device ordinal as the backend enumerates it (CUDA/HIP: after CUDA_VISIBLE_DEVICES /
  // ROCR_VISIBLE_DEVICES). The host backend opens any non-negative index: each is a distinct stand-in
  // for one GPU of a node, with its own UUID, all backed by the same host memory.
  int index = 0;
  // Host backend only: the most bytes it commits at once (0: the machine's physical memory) and
  // its allocation granularity (a multiple of the page size).
  uint64_t host_capacity = 0;
  uint64_t host_granularity = uint64_t{2} << 20;
};

// Opens the backend `options` asks for. UNAVAILABLE when its driver or device is missing,
// UNIMPLEMENTED when it was not built, INVALID_ARGUMENT for an unknown name.
[[nodiscard]] absl::StatusOr<std::unique_ptr<Device>> OpenDevice(const DeviceOptions& options);

// Every device of options.backend ("host", "cuda", "hip"; "auto": CUDA when a driver and device answer,
// else host) that this process can see, by index, with name/uuid/memory filled in. GPU backends fill
// index, name, uuid, driver_version and total_bytes without creating a context on any device, so
// free_bytes and granularity stay 0 there (open the device for them). The host backend opens any index
// but reports index 0 only (with its capacity, free bytes and granularity from `options`).
// UNAVAILABLE / UNIMPLEMENTED / INVALID_ARGUMENT as OpenDevice.
[[nodiscard]] absl::StatusOr<std::vector<DeviceInfo>> ListDevices(const DeviceOptions& options);

// The device index `selector` names for options.backend: a decimal index, or a device UUID or a unique,
// case-insensitive prefix of one ("GPU-5f3a"; the "GPU-" may be left out). NOT_FOUND listing the visible
// UUIDs when nothing matches; INVALID_ARGUMENT naming the candidates when a prefix is ambiguous.
// An exact UUID wins over a longer UUID it is a prefix of. On host any non-negative index exists, and
// "host-<boot id>-<N>" names index N for any N; other prefixes match the listed index 0. Messages start
// with "device <selector>: ", so that a caller can prefix its flag's dashes ("--device 3: this node has
// 1 CUDA device ...").
[[nodiscard]] absl::StatusOr<int> ResolveDeviceSelector(const DeviceOptions& options, absl::string_view selector);

// The numa_node sysfs gives for PCI device `bus_id` ("0000:3b:00.0", any case); -1 when it says -1 or
// cannot be read.
int PciNumaNode(absl::string_view bus_id);

// Checks block ids and copy pairs against `span` (shared by every backend): INVALID_ARGUMENT naming
// the offending id.
[[nodiscard]] absl::Status ValidateBlocks(const BlockSpan& span, absl::Span<const uint64_t> blocks);
[[nodiscard]] absl::Status ValidateCopies(const BlockSpan& span, absl::Span<const BlockCopy> copies);

}  // namespace kvd
