// HostTier: host memory kvd owns, where a sleeping pool keeps its contents (Note [The host tier] in
// docs/architecture.md; operators: docs/operations.md, "The host tier").
//
// One memfd of --host-tier-bytes, mapped once into the daemon, bound to the GPU's NUMA node where the
// machine says which it is, its pages allocated, mapped and registered with the driver
// (Device::RegisterHost, one piece at a time), in the background after start, so that neither the sleep nor the wake
// path pins or faults in anything. Pools take extents of it (first fit, granularity-aligned) for their kept bytes and
// give them back on wake or delete. Copies between a pool's mapped memory and its extent are split into pieces copied
// by several threads at once.
//
// Threads. Every method is thread-safe. mu_ is a leaf: it is never held across a device call or a copy.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvd/device.h"
#include "kvd/unique_fd.h"

namespace kvd::daemon {

// One run of a pool's bytes kept in the tier: `bytes` at `pool_offset` from the pool's base. A pool's
// runs lie back to back in its extent, in order.
struct KeptRun {
  uint64_t pool_offset = 0;
  uint64_t bytes = 0;
};

// What a sleeping pool keeps in the tier.
struct KeptContents {
  uint64_t tier_offset = 0;   // its extent's start in the tier
  uint64_t extent_bytes = 0;  // the extent taken (bytes, rounded up to the tier's alignment)
  uint64_t bytes = 0;         // the sum of the runs' bytes
  std::vector<KeptRun> runs;
  uint64_t live_blocks = 0;  // blocks kept when the engine named them; 0: every committed byte
};

struct HostTierOptions {
  uint64_t bytes = 0;                               // 0: no tier
  uint32_t copy_threads = 4;                        // copies in flight at once per sleep or wake
  uint64_t copy_piece_bytes = uint64_t{256} << 20;  // each copy is at most this large
  // Each registration with the driver is at most this large (a multiple of the alignment): one call over the
  // whole tier holds the process's mmap lock and the driver's for as long as it pins every page.
  uint64_t register_piece_bytes = uint64_t{256} << 20;
  std::function<void(const std::string&)> info;  // where the background preparation reports
};

// What the tier has done, for metrics.
struct HostTierStats {
  uint64_t bytes = 0;       // the tier's size
  uint64_t used_bytes = 0;  // taken by kept contents
  bool ready = false;       // pages allocated and registered (or registration failed and said so)
  bool registered = false;  // registered with the driver (host backend: true, nothing to do)
  int numa_node = -1;       // the node it is bound to; -1: not bound (the machine did not say)
  uint64_t copied_to_host_bytes = 0;
  uint64_t copied_to_device_bytes = 0;
  double copy_to_host_seconds = 0;
  double copy_to_device_seconds = 0;
};

class HostTier {
 public:
  // Creates the memfd and its mapping (`device` must outlive the tier) and starts the background
  // preparation. `predecessor`, the memfd of the tier of the daemon before this one (from the FD store), is
  // adopted with the contents kept in it when it has the size asked for (adopted() says so; Claim then gives
  // the restored pools their extents back); otherwise it is closed and the tier starts empty.
  // INVALID_ARGUMENT for a size that is not a multiple of `alignment` (a power of two); the system's errors
  // for memfd_create, ftruncate and mmap.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<HostTier>> Create(Device* device, const HostTierOptions& options,
                                                                        uint64_t alignment, UniqueFd predecessor = {});
  // Waits for the preparation, unregisters and unmaps.
  ~HostTier();
  HostTier(const HostTier&) = delete;
  HostTier& operator=(const HostTier&) = delete;

  uint64_t bytes() const { return bytes_; }
  int fd() const { return fd_.get(); }
  // Whether the tier is its predecessor's memfd, with what that one's pools kept.
  bool adopted() const { return adopted_; }
  // Takes exactly the extent [offset, offset + extent_bytes) a restored pool's record names (adopted tiers).
  // FAILED_PRECONDITION when it is not free in full (another pool's, or past the tier's end).
  [[nodiscard]] absl::Status Claim(uint64_t offset, uint64_t extent_bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // An extent for `bytes` bytes of `pool`, once the background preparation is done (waiting for it until
  // `ready_by`: DEADLINE_EXCEEDED past it, nothing taken). RESOURCE_EXHAUSTED naming the bytes asked, the
  // tier's size and the largest free extent when none fits.
  [[nodiscard]] absl::StatusOr<uint64_t> Take(absl::string_view pool, uint64_t bytes, uint64_t* extent_bytes,
                                              absl::Time ready_by = absl::InfiniteFuture()) ABSL_LOCKS_EXCLUDED(mu_);
  // Gives an extent Take returned back.
  void Give(uint64_t offset, uint64_t extent_bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // Copies the runs of the pool mapped at `base` into `kept`'s extent, or back. Each returns once every
  // byte is in place; on an error (the device's, of the first piece that failed) some pieces may have
  // been copied.
  [[nodiscard]] absl::Status CopyOut(uint64_t base, const KeptContents& kept) ABSL_LOCKS_EXCLUDED(mu_);
  [[nodiscard]] absl::Status CopyIn(uint64_t base, const KeptContents& kept) ABSL_LOCKS_EXCLUDED(mu_);
  HostTierStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);

  class Copy;

 private:
  HostTier(Device* device, const HostTierOptions& options, uint64_t alignment, UniqueFd fd, uint8_t* map, bool adopted);

  // The background preparation: NUMA binding, page allocation, registration.
  void Prepare();
  // The tier is registered in pieces of options_.register_piece_bytes (the last one shorter), each its own
  // registration with the driver; a copy never crosses a piece's end.
  size_t Pieces() const { return static_cast<size_t>((bytes_ + piece_ - 1) / piece_); }
  // What a Copy did, for the stats.
  void Copied(bool out, uint64_t bytes, absl::Duration took) ABSL_LOCKS_EXCLUDED(mu_);

  Device* const device_;
  const HostTierOptions options_;
  const uint64_t alignment_;
  const uint64_t bytes_;
  const uint64_t piece_;  // options_.register_piece_bytes
  const UniqueFd fd_;
  uint8_t* const map_;
  const bool adopted_;
  std::thread preparer_;

  mutable absl::Mutex mu_;
  bool ready_ ABSL_GUARDED_BY(mu_) = false;
  bool registered_ ABSL_GUARDED_BY(mu_) = false;
  int numa_node_ ABSL_GUARDED_BY(mu_) = -1;
  std::map<uint64_t, uint64_t> free_ ABSL_GUARDED_BY(mu_);  // offset -> bytes, coalesced
  uint64_t used_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t copied_out_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t copied_in_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Duration out_time_ ABSL_GUARDED_BY(mu_);
  absl::Duration in_time_ ABSL_GUARDED_BY(mu_);
};

// One copy of `kept`'s runs between the pool mapped at `base` and the tier, in pieces of at most
// copy_piece_bytes (never across a registered piece's end) copied by copy_threads threads (with no thread to
// spare, by Finish's caller). A piece is copied
// once Ready has said that every byte of its pool range is mapped, so that a wake copies into its first chunks
// while the next ones are still being made (Note [The host tier]). The tier must outlive it.
class HostTier::Copy {
 public:
  enum class Direction { kToHost, kToDevice };
  Copy(HostTier* tier, uint64_t base, const KeptContents& kept, Direction direction);
  // Stop, if Finish was not called.
  ~Copy();
  Copy(const Copy&) = delete;
  Copy& operator=(const Copy&) = delete;

  // [pool_offset, pool_offset + bytes) of the pool is mapped in the daemon's view: the pieces inside what is
  // mapped so far start.
  void Ready(uint64_t pool_offset, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // No piece starts after this; returns once the pieces being copied are done (before what they copy into
  // is unmapped). Finish after it gives CANCELLED.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);
  // Waits for every piece: OK once every byte is in place; the device's error of the first piece that
  // failed (the others stop at their next piece; some may have been copied); INTERNAL naming the first
  // byte nothing made ready, after the pieces that were ready are done.
  [[nodiscard]] absl::Status Finish() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Piece {
    uint64_t pool_offset = 0;
    uint8_t* host = nullptr;
    uint64_t bytes = 0;
  };
  void Work() ABSL_LOCKS_EXCLUDED(mu_);
  // Whether a worker has a piece to copy, or should return.
  bool HasWorkOrEnds() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether [offset, end) lies in one run of what is ready.
  bool Covered(uint64_t offset, uint64_t end) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Join();

  HostTier* const tier_;
  const uint64_t base_;
  const uint64_t bytes_;
  const Direction direction_;
  std::vector<Piece> pieces_;  // sorted by pool_offset, disjoint
  const absl::Time start_;
  std::vector<std::thread> workers_;

  absl::Mutex mu_;
  std::map<uint64_t, uint64_t> ready_ ABSL_GUARDED_BY(mu_);  // pool offset -> end, coalesced
  std::vector<bool> queued_ ABSL_GUARDED_BY(mu_);            // per piece
  std::vector<size_t> queue_ ABSL_GUARDED_BY(mu_);           // ready pieces not yet taken
  size_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  size_t copied_ ABSL_GUARDED_BY(mu_) = 0;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status first_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvd::daemon
