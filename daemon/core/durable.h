// What of a pool outlives the daemon process (Note [Durable pools] in docs/architecture.md): a record of
// each pool (SavedPool) written on every change, and each chunk's exported FD, held by the service
// manager's file-descriptor store where there is one. The PoolManager calls a StateStore with the pool's
// op_mu held, so the records of one pool are written in order; different pools share nothing here.
//
// The StateStore interface is the seam: FileStateStore (daemon/state/state_store.h) is the daemon's with
// --state-dir, MemoryStateStore (memory_state_store.h) the complete in-memory one that tests run on and
// that the daemon uses when nothing must outlive it. A PoolManager always has one.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "daemon/core/geometry.h"
#include "daemon/core/host_tier.h"
#include "daemon/core/layout_chain.h"
#include "daemon/core/pool_spec.h"
#include "daemon/core/pool_types.h"
#include "kvd/unique_fd.h"

namespace kvd::daemon {

// Everything a restart restores of one pool. Clients, sessions, leases and transactions are not in it:
// they belong to processes that reconnect.
struct SavedPool {
  std::string name;
  PoolDims dims;
  LayoutResolution layout;
  uint64_t granularity = 0;
  uint32_t owner_uid = 0;
  std::vector<uint32_t> allowed_uids;
  GroupMembership group;
  std::vector<std::string> peer_devices;
  absl::Time created_at;
  PoolState state = PoolState::kAwake;  // never kRecovering: the state to return to
  uint64_t prefix_bytes = 0;
  uint64_t wake_blocks = 0;
  uint64_t generation = 0;
  std::vector<ChunkInfo> chunks;       // by (segment, offset)
  uint64_t pending_release_bytes = 0;  // released chunks clients still mapped when saved
  PoolMetadata metadata;
  PoolPolicy policy;                 // the Arbiter's (policy.h)
  std::optional<KeptContents> kept;  // sleeping with its contents in the host tier
};

// Thread-safe: the PoolManager calls it from many threads (one pool's calls in order, under its op_mu).
class StateStore {
 public:
  virtual ~StateStore() = default;

  // What keeps the pools' memory across a restart with this store (DeviceInfo.durability).
  virtual Durability durability() const = 0;
  // Writes (replaces) the record of `pool.name`, atomically: a successor reads the old record or the new
  // one, never a mix. A failure leaves the old record (or none) in place.
  [[nodiscard]] virtual absl::Status SavePool(const SavedPool& pool) = 0;
  // Removes the record of `name` (OK when there is none).
  [[nodiscard]] virtual absl::Status ForgetPool(absl::string_view name) = 0;
  // Hands a copy of chunk `id`'s FD to the file-descriptor store (OK and nothing without one).
  // RESOURCE_EXHAUSTED naming the limit when the store is full: the chunk must not be made.
  [[nodiscard]] virtual absl::Status KeepChunkFd(uint64_t id, int fd) = 0;
  // Takes chunk `id`'s FD out of the store (nothing without one, or when it is not there). Cannot fail
  // the caller: a store that could not take it out reports that itself (the next start releases it).
  virtual void DropChunkFd(uint64_t id) = 0;
  // Hands a copy of the host tier's memfd to the FD store as "host-tier", in place of one kept before, so
  // that the contents sleeping pools keep there outlive the daemon (Note [The host tier]). OK and nothing
  // without a store; its failure leaves the tier working, its contents lost by a restart.
  [[nodiscard]] virtual absl::Status KeepHostTierFd(int fd) = 0;
  // Takes the host tier's FD out of the store (a daemon started without a tier). Cannot fail the caller.
  virtual void DropHostTierFd() = 0;
};

// What a starting daemon found of its predecessor: the records, and the FDs the service manager handed
// back, by chunk id.
struct SavedState {
  uint64_t epoch = 0;  // the predecessor's; 0: nothing saved
  std::vector<SavedPool> pools;
  std::map<uint64_t, UniqueFd> fds;
  UniqueFd host_tier_fd;              // the predecessor's host tier ("host-tier"), if the store had it
  std::vector<std::string> problems;  // records that could not be read, one line each
};

// What PoolManager::Restore did, for the log and the tests.
struct RestoreReport {
  uint32_t pools_restored = 0;    // with all their memory
  uint32_t pools_recovering = 0;  // waiting for clients to give chunks back
  uint64_t chunks_adopted = 0;
  uint64_t chunks_missing = 0;
  uint64_t bytes_adopted = 0;
  uint64_t fds_released = 0;       // FDs in the store that no record accounts for
  std::vector<std::string> lines;  // one per chunk or pool that did not come back as saved
};

}  // namespace kvd::daemon
