#include "daemon/state/state_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "daemon/codec/codec.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "kvd/state.pb.h"
#include "kvd/status.h"
#include "kvd/unique_fd.h"
#include "spdlog/spdlog.h"

namespace kvd::daemon {
namespace {

constexpr uint32_t kFormat = 1;
constexpr absl::string_view kHostTierFdName = "host-tier";

absl::Status MakeDir(const std::string& path) {
  if (mkdir(path.c_str(), 0700) == 0 || errno == EEXIST) return absl::OkStatus();
  return ErrnoStatus(errno, absl::StrCat("mkdir ", path));
}

// Replaces `path` with `bytes`: written to a temporary beside it and renamed over it, so a reader sees the
// old record or the new one. Not fsync'ed: the record must outlive the daemon process, not the machine
// (whose reboot frees the device memory it describes anyway), and the page cache outlives the process.
absl::Status WriteAtomically(const std::string& dir, absl::string_view name, const std::string& bytes) {
  const std::string tmp = absl::StrCat(dir, "/.", name, ".tmp");
  UniqueFd fd(open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  if (!fd.valid()) return ErrnoStatus(errno, absl::StrCat("open ", tmp));
  for (size_t done = 0; done < bytes.size();) {
    const ssize_t n = write(fd.get(), bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus(errno, absl::StrCat("write ", tmp));
    done += static_cast<size_t>(n);
  }
  fd.reset();
  const std::string path = absl::StrCat(dir, "/", name);
  if (rename(tmp.c_str(), path.c_str()) != 0) return ErrnoStatus(errno, absl::StrCat("rename to ", path));
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return ErrnoStatus(errno, absl::StrCat("open ", path));
  std::stringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

// The record but its chunks (SerializePoolRecord appends those).
state::PoolRecord ToRecord(const SavedPool& pool) {
  state::PoolRecord r;
  r.set_format(kFormat);
  r.set_name(pool.name);
  *r.mutable_dims() = ToProto(pool.dims);
  *r.mutable_layout() = ToProto(pool.layout);
  r.set_granularity_bytes(pool.granularity);
  r.set_owner_uid(pool.owner_uid);
  for (uint32_t uid : pool.allowed_uids) r.add_allowed_uids(uid);
  if (!pool.group.name.empty()) {
    r.mutable_group()->set_name(pool.group.name);
    r.mutable_group()->set_rank(pool.group.rank);
    r.mutable_group()->set_size(pool.group.size);
  }
  for (const std::string& d : pool.peer_devices) r.add_peer_devices(d);
  r.set_created_at_unix_ms(static_cast<uint64_t>(absl::ToUnixMillis(pool.created_at)));
  r.set_state(ToProto(pool.state));
  r.set_prefix_bytes(pool.prefix_bytes);
  r.set_wake_blocks(pool.wake_blocks);
  r.set_generation(pool.generation);
  r.set_pending_release_bytes(pool.pending_release_bytes);
  *r.mutable_metadata() = ToProto(pool.name, pool.metadata);
  *r.mutable_policy() = ToProto(pool.policy);
  r.set_policy_operator_bounds(pool.policy.operator_bounds);
  if (pool.kept.has_value()) {
    state::KeptRecord* k = r.mutable_kept();
    k->set_tier_offset(pool.kept->tier_offset);
    k->set_extent_bytes(pool.kept->extent_bytes);
    k->set_bytes(pool.kept->bytes);
    for (const KeptRun& run : pool.kept->runs) {
      state::KeptRecord::Run* out = k->add_runs();
      out->set_pool_offset(run.pool_offset);
      out->set_bytes(run.bytes);
    }
    k->set_live_blocks(pool.kept->live_blocks);
  }
  return r;
}

absl::StatusOr<SavedPool> FromRecord(const state::PoolRecord& r) {
  if (r.format() != kFormat) {
    return absl::FailedPreconditionError(absl::StrCat("format ", r.format(), ", this kvd reads ", kFormat));
  }
  SavedPool pool{.name = r.name(),
                 .dims = FromProto(r.dims()),
                 .granularity = r.granularity_bytes(),
                 .owner_uid = r.owner_uid(),
                 .allowed_uids = {r.allowed_uids().begin(), r.allowed_uids().end()},
                 .group = {.name = r.group().name(), .rank = r.group().rank(), .size = r.group().size()},
                 .peer_devices = {r.peer_devices().begin(), r.peer_devices().end()},
                 .created_at = absl::FromUnixMillis(static_cast<int64_t>(r.created_at_unix_ms())),
                 .prefix_bytes = r.prefix_bytes(),
                 .wake_blocks = r.wake_blocks(),
                 .generation = r.generation(),
                 .pending_release_bytes = r.pending_release_bytes(),
                 .metadata = FromProto(r.metadata())};
  KVD_ASSIGN_OR_RETURN(pool.layout, FromProto(r.layout()));
  KVD_ASSIGN_OR_RETURN(pool.policy, FromProto(r.policy(), "policy"));
  pool.policy.operator_bounds = r.policy_operator_bounds();
  switch (r.state()) {
    case v1::POOL_STATE_AWAKE:
      pool.state = PoolState::kAwake;
      break;
    case v1::POOL_STATE_SLEEPING:
      pool.state = PoolState::kSleeping;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("state ", v1::PoolState_Name(r.state()), " cannot be saved"));
  }
  for (const v1::Chunk& c : r.chunks()) pool.chunks.push_back(FromProto(c));
  if (r.has_kept()) {
    KeptContents kept{.tier_offset = r.kept().tier_offset(),
                      .extent_bytes = r.kept().extent_bytes(),
                      .bytes = r.kept().bytes(),
                      .live_blocks = r.kept().live_blocks()};
    uint64_t sum = 0;
    for (const state::KeptRecord::Run& run : r.kept().runs()) {
      kept.runs.push_back({.pool_offset = run.pool_offset(), .bytes = run.bytes()});
      sum += run.bytes();
    }
    if (sum != kept.bytes || kept.bytes > kept.extent_bytes || pool.state != PoolState::kSleeping) {
      return absl::DataLossError("its kept contents do not add up (runs, bytes, extent) or the pool is not sleeping");
    }
    pool.kept = std::move(kept);
  }
  KVD_RETURN_IF_ERROR(ValidateName(pool.name, "name"));
  return pool;
}

}  // namespace

// Note [The daemon's own memory] in docs/architecture.md: a PoolRecord message holding the chunks would be a
// heap object per chunk on every save (every grow). The wire format lets a repeated field come after the
// others, in pieces: the other fields are serialized as a message, then each chunk is appended as one more
// `chunks` field from one stack-held v1::Chunk. A parser reads the same message as from PoolRecord holding all.
std::string SerializePoolRecord(const SavedPool& pool) {
  constexpr uint32_t kChunkTag = (state::PoolRecord::kChunksFieldNumber << 3) | 2;  // wire type 2: length-delimited
  std::string bytes;
  ToRecord(pool).AppendToString(&bytes);
  bytes.reserve(bytes.size() + pool.chunks.size() * 24);  // a chunk without a fabric handle takes 13 to 24 bytes
  {
    google::protobuf::io::StringOutputStream stream(&bytes);
    google::protobuf::io::CodedOutputStream out(&stream);  // its destructor gives back what it did not write
    for (const ChunkInfo& c : pool.chunks) {
      const v1::Chunk chunk = ToProto(c);
      out.WriteTag(kChunkTag);
      out.WriteVarint32(static_cast<uint32_t>(chunk.ByteSizeLong()));
      chunk.SerializeWithCachedSizes(&out);
    }
  }
  return bytes;
}

absl::StatusOr<SavedPool> ParsePoolRecord(absl::string_view bytes) {
  state::PoolRecord record;
  if (!record.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return absl::DataLossError("not a kvd.state.PoolRecord");
  }
  return FromRecord(record);
}

namespace {

// The FDs the service manager handed this process ($LISTEN_FDS), by chunk id, and the host tier's; others
// are closed.
std::map<uint64_t, UniqueFd> ReceiveFds(UniqueFd* host_tier, std::vector<std::string>* problems) {
  std::map<uint64_t, UniqueFd> fds;
  char** names = nullptr;
  const int n = sd_listen_fds_with_names(1, &names);
  if (n < 0) {
    problems->push_back(absl::StrCat("$LISTEN_FDS could not be read: ", ErrnoStatus(-n, "sd_listen_fds").message()));
    return fds;
  }
  for (int i = 0; i < n; ++i) {
    UniqueFd fd(SD_LISTEN_FDS_START + i);
    fcntl(fd.get(), F_SETFD, FD_CLOEXEC);
    const absl::string_view name = names != nullptr && names[i] != nullptr ? names[i] : "";
    if (name == kHostTierFdName) {
      *host_tier = std::move(fd);
      continue;
    }
    uint64_t id = 0;
    absl::string_view digits = name;
    if (!absl::ConsumePrefix(&digits, "c") || !absl::SimpleAtoi(digits, &id)) {
      problems->push_back(absl::StrCat("FD ", i, " from the service manager is named \"", name,
                                       "\", not a chunk (c<id>) nor the host tier: closed"));
      continue;
    }
    fds[id] = std::move(fd);
  }
  if (names != nullptr) {
    for (int i = 0; i < n; ++i) free(names[i]);
    free(names);
  }
  return fds;
}

}  // namespace

absl::StatusOr<std::unique_ptr<FileStateStore>> FileStateStore::Open(Options options, const DeviceInfo& device,
                                                                     SavedState* saved) {
  KVD_RETURN_IF_ERROR(MakeDir(options.dir));
  const std::string pools_dir = options.dir + "/pools";
  KVD_RETURN_IF_ERROR(MakeDir(pools_dir));
  *saved = SavedState{};

  // The daemon record: whose state this is.
  const std::string daemon_path = options.dir + "/daemon";
  if (absl::StatusOr<std::string> bytes = ReadFile(daemon_path); bytes.ok()) {
    state::DaemonRecord record;
    if (!record.ParseFromString(*bytes) || record.format() != kFormat) {
      return absl::FailedPreconditionError(absl::StrCat(daemon_path, " is not a kvd state record this version reads (",
                                                        "format ", record.format(), "): move it away to start empty"));
    }
    if (record.device_uuid() != device.uuid) {
      return absl::FailedPreconditionError(absl::StrCat("the state in ", options.dir, " belongs to device ",
                                                        record.device_uuid(), ", this daemon serves ", device.uuid,
                                                        ": give each device its own --state-dir"));
    }
    saved->epoch = record.epoch();
  }

  // The pools.
  std::unique_ptr<DIR, int (*)(DIR*)> dir(opendir(pools_dir.c_str()), closedir);
  if (dir == nullptr) return ErrnoStatus(errno, absl::StrCat("opendir ", pools_dir));
  while (dirent* entry = readdir(dir.get())) {
    const std::string name = entry->d_name;
    if (name.empty() || name[0] == '.' || absl::EndsWith(name, ".unreadable")) continue;
    const std::string path = absl::StrCat(pools_dir, "/", name);
    absl::StatusOr<SavedPool> pool = absl::InternalError("unreadable");
    if (absl::StatusOr<std::string> bytes = ReadFile(path); !bytes.ok()) {
      pool = bytes.status();
    } else {
      pool = ParsePoolRecord(*bytes);
      if (pool.ok() && pool->name != name) pool = absl::DataLossError(absl::StrCat("it names pool ", pool->name));
    }
    if (!pool.ok()) {
      saved->problems.push_back(absl::StrCat("pool record ", path, " is unreadable (", pool.status().message(),
                                             "): moved aside as ", name, ".unreadable"));
      rename(path.c_str(), absl::StrCat(path, ".unreadable").c_str());
      continue;
    }
    saved->pools.push_back(*std::move(pool));
  }

  auto store = std::unique_ptr<FileStateStore>(new FileStateStore(std::move(options)));
  saved->fds = ReceiveFds(&saved->host_tier_fd, &saved->problems);
  {
    absl::MutexLock lock(&store->mu_);
    for (const auto& [id, fd] : saved->fds) store->stored_.insert(id);
    store->host_tier_stored_ = saved->host_tier_fd.valid();
  }

  state::DaemonRecord record;
  record.set_format(kFormat);
  record.set_epoch(saved->epoch + 1);
  record.set_device_uuid(device.uuid);
  record.set_backend(ToProto(device.backend));
  record.set_granularity_bytes(device.granularity);
  KVD_RETURN_IF_ERROR(WriteAtomically(store->options_.dir, "daemon", record.SerializeAsString()));
  return store;
}

std::string FileStateStore::PoolPath(absl::string_view name) const {
  return absl::StrCat(options_.dir, "/pools/", name);
}

absl::Status FileStateStore::Failed(absl::Status status, bool log) {
  write_errors_.fetch_add(1, std::memory_order_relaxed);
  if (log) spdlog::error("saved state: {} (a restart may not restore this change)", std::string(status.message()));
  return status;
}

// A record that is not written is the manager's to report (it makes the pool stale: PoolManager::Save).
absl::Status FileStateStore::SavePool(const SavedPool& pool) {
  absl::Status written = WriteAtomically(options_.dir + "/pools", pool.name, SerializePoolRecord(pool));
  return written.ok() ? written : Failed(written, /*log=*/false);
}

absl::Status FileStateStore::ForgetPool(absl::string_view name) {
  const std::string path = PoolPath(name);
  if (unlink(path.c_str()) == 0 || errno == ENOENT) return absl::OkStatus();
  return Failed(ErrnoStatus(errno, absl::StrCat("unlink ", path)), /*log=*/false);
}

absl::Status FileStateStore::KeepChunkFd(uint64_t id, int fd) {
  if (!options_.fd_store) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  if (const uint64_t held = stored_.size() + (host_tier_stored_ ? 1 : 0); held >= options_.fd_store_max) {
    return absl::ResourceExhaustedError(
        absl::StrCat("chunks: the service manager's file-descriptor store holds ", held, " of ", options_.fd_store_max,
                     " FDs (", stored_.size(), " chunks", host_tier_stored_ ? " and the host tier" : "",
                     "; --fdstore-max, FileDescriptorStoreMax= of the unit): grow in larger steps, or raise both"));
  }
  const std::string message = absl::StrCat("FDSTORE=1\nFDPOLL=0\nFDNAME=c", id);
  const int sent = sd_pid_notify_with_fds(0, 0, message.c_str(), &fd, 1);
  if (sent <= 0) {
    return Failed(sent == 0 ? absl::FailedPreconditionError("chunks: $NOTIFY_SOCKET is not set: no FD store")
                            : ErrnoStatus(-sent, "chunks: handing a chunk FD to the service manager"));
  }
  stored_.insert(id);
  return absl::OkStatus();
}

void FileStateStore::DropChunkFd(uint64_t id) {
  if (!options_.fd_store) return;
  absl::MutexLock lock(&mu_);
  if (stored_.erase(id) == 0) return;
  const std::string message = absl::StrCat("FDSTOREREMOVE=1\nFDNAME=c", id);
  if (const int sent = sd_notify(0, message.c_str()); sent <= 0) {
    Failed(ErrnoStatus(sent == 0 ? ENOENT : -sent, absl::StrCat("removing chunk ", id, "'s FD from the store")))
        .IgnoreError();
  }
}

absl::Status FileStateStore::KeepHostTierFd(int fd) {
  if (!options_.fd_store) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  if (host_tier_stored_) {
    // The predecessor's, of another size: the service manager would keep both under the one name.
    const std::string remove = absl::StrCat("FDSTOREREMOVE=1\nFDNAME=", kHostTierFdName);
    if (sd_notify(0, remove.c_str()) <= 0) spdlog::warn("saved state: the old host tier's FD could not be removed");
    host_tier_stored_ = false;
  }
  const std::string message = absl::StrCat("FDSTORE=1\nFDPOLL=0\nFDNAME=", kHostTierFdName);
  const int sent = sd_pid_notify_with_fds(0, 0, message.c_str(), &fd, 1);
  if (sent <= 0) {
    return Failed(sent == 0 ? absl::FailedPreconditionError("host tier: $NOTIFY_SOCKET is not set: no FD store")
                            : ErrnoStatus(-sent, "host tier: handing its FD to the service manager"));
  }
  host_tier_stored_ = true;
  return absl::OkStatus();
}

void FileStateStore::DropHostTierFd() {
  if (!options_.fd_store) return;
  absl::MutexLock lock(&mu_);
  if (!host_tier_stored_) return;
  host_tier_stored_ = false;
  const std::string message = absl::StrCat("FDSTOREREMOVE=1\nFDNAME=", kHostTierFdName);
  if (const int sent = sd_notify(0, message.c_str()); sent <= 0) {
    Failed(ErrnoStatus(sent == 0 ? ENOENT : -sent, "removing the host tier's FD from the store")).IgnoreError();
  }
}

uint64_t FileStateStore::stored_fds() const {
  absl::MutexLock lock(&mu_);
  return stored_.size();
}

}  // namespace kvd::daemon
