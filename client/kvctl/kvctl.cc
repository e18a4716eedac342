// kvctl: the operator's command line for a kvd daemon, built on libkvd (docs/integrating.md, "kvctl").
//
//   kvctl [--socket=PATH] [--device=N] [--json] VERB ...
//
// Output: human-readable text (byte sizes with FormatBytes), or with --json one JSON document on stdout:
// the daemon's reply message as proto3 JSON, wrapped in kvctl's own keys where it adds any (Note [kvctl
// JSON] in docs/integrating.md).
// Exit status: 0 on success; 1 when the daemon (or the connection) fails the request; 2 for a usage
// error. Every failure prints exactly one line "kvctl: <reason>" on stderr.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "google/protobuf/message.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "kvd/client.h"
#include "kvd/group.h"
#include "kvd/status.h"
#include "kvd/units.h"
#include "kvd/v1/kvd.pb.h"
#include "kvd/wire.h"

namespace kvd {
namespace {

// ---------------------------------------------------------------------------------------------
// --json: the daemon's replies as protobuf's JSON printer renders them (docs/integrating.md, "--json"),
// so that a field added to kvd.proto appears in kvctl's output without a change here. kvctl's own keys
// (the socket, timings, a group's ranks) are put around them.

// The reply messages libkvd received (ConnectOptions::on_reply), in order. Thread-safe: a Group's
// ranks answer on several threads.
class Replies {
 public:
  std::function<void(const google::protobuf::Message&)> Observer() {
    return [this](const google::protobuf::Message& reply) {
      std::unique_ptr<google::protobuf::Message> copy(reply.New());
      copy->CopyFrom(reply);
      absl::MutexLock lock(&mu_);
      replies_.push_back(std::move(copy));
    };
  }

  void Clear() {
    absl::MutexLock lock(&mu_);
    replies_.clear();
  }

  // Every reply of type M received since the last Clear(), in order.
  template <typename M>
  std::vector<M> All() const {
    absl::MutexLock lock(&mu_);
    std::vector<M> out;
    for (const auto& r : replies_) {
      if (r->GetDescriptor() == M::descriptor()) out.push_back(static_cast<const M&>(*r));
    }
    return out;
  }

  // The last reply of type M; INTERNAL when libkvd reported none.
  template <typename M>
  absl::StatusOr<M> Last() const {
    std::vector<M> all = All<M>();
    if (all.empty()) return absl::InternalError(absl::StrCat("no ", M::descriptor()->full_name(), " reply to print"));
    return std::move(all.back());
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<google::protobuf::Message>> replies_ ABSL_GUARDED_BY(mu_);
};

// A message as proto3 JSON: kvd.proto's field names, every scalar and repeated field present (a message
// field only when set), 64-bit integers as strings, enums by name.
absl::StatusOr<std::string> ProtoJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string out;
  if (!google::protobuf::util::MessageToJsonString(message, &out, options).ok()) {
    return absl::InternalError(absl::StrCat("cannot render ", message.GetDescriptor()->full_name(), " as JSON"));
  }
  return out;
}

// A JSON string, escaped by protobuf's printer.
std::string JsonString(absl::string_view s) {
  google::protobuf::Value value;
  value.set_string_value(std::string(s));
  std::string out;
  (void)google::protobuf::util::MessageToJsonString(value, &out);  // a string value always renders
  return out;
}

std::string JsonMs(double ms) { return absl::StrFormat("%.3f", ms); }

// {"key": value, ...} of rendered values, in order.
std::string JsonObject(const std::vector<std::pair<absl::string_view, std::string>>& members) {
  std::vector<std::string> parts;
  for (const auto& [key, value] : members) parts.push_back(absl::StrCat(JsonString(key), ":", value));
  return absl::StrCat("{", absl::StrJoin(parts, ","), "}");
}

std::string JsonArray(const std::vector<std::string>& items) {
  return absl::StrCat("[", absl::StrJoin(items, ","), "]");
}

// Prints one JSON document (compact, as protobuf renders it) indented by two spaces a level.
void PrintJson(absl::string_view json) {
  std::string out;
  int depth = 0;
  bool in_string = false, escaped = false;
  auto newline = [&] {
    out += '\n';
    out.append(2 * depth, ' ');
  };
  for (size_t i = 0; i < json.size(); ++i) {
    const char c = json[i];
    if (in_string) {
      out += c;
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    switch (c) {
      case '"':
        in_string = true;
        out += c;
        break;
      case '{':
      case '[':
        out += c;
        if (i + 1 < json.size() && (json[i + 1] == '}' || json[i + 1] == ']')) {
          out += json[++i];
        } else {
          ++depth;
          newline();
        }
        break;
      case '}':
      case ']':
        --depth;
        newline();
        out += c;
        break;
      case ',':
        out += c;
        newline();
        break;
      case ':':
        out += ": ";
        break;
      default:
        out += c;
    }
  }
  out += '\n';
  std::fwrite(out.data(), 1, out.size(), stdout);
}

// Prints the last reply of type M; with `extras`, an object of kvctl's keys followed by the reply as "reply".
template <typename M>
absl::Status PrintReply(const Replies& replies, std::vector<std::pair<absl::string_view, std::string>> extras = {}) {
  KVD_ASSIGN_OR_RETURN(M reply, replies.Last<M>());
  KVD_ASSIGN_OR_RETURN(std::string json, ProtoJson(reply));
  if (extras.empty()) {
    PrintJson(json);
  } else {
    extras.emplace_back("reply", std::move(json));
    PrintJson(JsonObject(extras));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Helpers

class Timer {
 public:
  double ms() const {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

std::string Ms(double ms) { return ms < 10 ? absl::StrFormat("%.2f ms", ms) : absl::StrFormat("%.1f ms", ms); }

// "BACKEND=L1,L2" -> a requirement.
absl::StatusOr<LayoutRequest::Requirement> ParseRequirement(const std::string& text) {
  std::vector<std::string> kv = absl::StrSplit(text, absl::MaxSplits('=', 1));
  if (kv.size() != 2 || kv[0].empty() || kv[1].empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--require ", text, ": expected BACKEND=LAYOUT[,LAYOUT...]"));
  }
  return LayoutRequest::Requirement{kv[0], absl::StrSplit(kv[1], ',', absl::SkipEmpty())};
}

// "NAME=LAYOUT" -> a preference.
absl::StatusOr<LayoutRequest::Preference> ParsePreference(const std::string& text) {
  std::vector<std::string> kv = absl::StrSplit(text, absl::MaxSplits('=', 1));
  if (kv.size() != 2 || kv[0].empty() || kv[1].empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--connector ", text, ": expected NAME=LAYOUT"));
  }
  return LayoutRequest::Preference{kv[0], kv[1]};
}

struct LayoutFlags {
  std::vector<std::string> require;
  std::vector<std::string> connector;
  std::string override_layout;
  std::string env;
  bool env_given = false;

  void Add(CLI::App* app) {
    app->add_option("--require", require, "A backend requirement BACKEND=LAYOUT[,LAYOUT...] (repeatable)");
    app->add_option("--connector", connector, "A connector preference NAME=LAYOUT (repeatable)");
  }

  absl::StatusOr<LayoutRequest> Build() const {
    LayoutRequest r;
    r.override_layout = override_layout;
    for (const std::string& t : require) {
      KVD_ASSIGN_OR_RETURN(LayoutRequest::Requirement req, ParseRequirement(t));
      r.backend_requirements.push_back(std::move(req));
    }
    for (const std::string& t : connector) {
      KVD_ASSIGN_OR_RETURN(LayoutRequest::Preference p, ParsePreference(t));
      r.connector_preferences.push_back(std::move(p));
    }
    if (env_given) {
      r.env_layout_set = true;
      r.env_layout = env;
    }
    return r;
  }
};

struct Flags {
  std::string socket;
  std::string device = "0";
  bool json = false;
  std::string pool;
  bool all = false;
  bool wait = false;
  bool force = false;
  uint64_t blocks = 0;
  std::string bytes;
  PoolDims dims;
  uint64_t initial_blocks = 0;
  std::vector<uint32_t> allowed_uids;
  LayoutFlags layout;
  GroupMembership group;
  std::vector<std::string> peers;
  std::string device_uuid;           // grant / revoke
  std::vector<std::string> sockets;  // group: the daemons to search
  std::string socket_dir;
  std::string ttl = "30s";
  std::string block_list;    // transfer: "1,2,5-9"
  std::string metadata_out;  // metadata: write the data to this file
  std::string metadata_in;   // metadata --set: the file to store
  int64_t expected_version = -1;
  bool whole_chunks = false;         // shrink --whole-chunks
  bool live_given = false;           // shrink --live-blocks (an empty list is a compaction shrink too)
  bool keep = false;                 // sleep --keep, group sleep --keep
  std::string keep_live;             // sleep --live-blocks
  std::string live_blocks;           // "1,2,5-9" or "@FILE"
  std::string pause_timeout;         // shrink, compact: empty for the daemon's --pause-timeout
  bool detach_unresponsive = false;  // shrink, compact
  uint32_t chunks_per_pause = 0;     // compact: 0 for the daemon's --compact-chunks-per-pause
  // Arbitration: create and policy (empty: not given), grow/wake --wait-for, top.
  std::string priority;
  std::string min_bytes;
  std::string max_bytes;  // a size or "none"
  std::string reclaim_timeout;
  std::string on_reclaim_timeout;  // none, shrink, sleep
  std::string wait_for;
  std::string interval = "1s";
  uint32_t count = 0;  // top: refreshes before it exits; 0: until interrupted
};

// --priority, --min-bytes, --max-bytes, --reclaim-timeout, --on-reclaim-timeout: the fields given.
absl::StatusOr<PolicyChange> PolicyFlags(const Flags& f) {
  PolicyChange change;
  if (!f.priority.empty()) {
    uint32_t priority = 0;
    if (!absl::SimpleAtoi(f.priority, &priority)) {
      return absl::InvalidArgumentError(absl::StrCat("--priority: \"", f.priority, "\" is not a number (0..1000)"));
    }
    change.priority = priority;
  }
  if (!f.min_bytes.empty()) {
    KVD_ASSIGN_OR_RETURN(change.min_bytes, ParseBytes(f.min_bytes, "--min-bytes"));
  }
  if (!f.max_bytes.empty()) {
    if (f.max_bytes == "none") {
      change.max_bytes = 0;
    } else {
      KVD_ASSIGN_OR_RETURN(change.max_bytes, ParseBytes(f.max_bytes, "--max-bytes"));
    }
  }
  if (!f.reclaim_timeout.empty()) {
    absl::Duration d;
    if (!absl::ParseDuration(f.reclaim_timeout, &d) || d < absl::ZeroDuration()) {
      return absl::InvalidArgumentError(absl::StrCat("--reclaim-timeout: \"", f.reclaim_timeout,
                                                     "\" is not a duration (e.g. 5s; 0 for the daemon's)"));
    }
    change.reclaim_timeout = d;
  }
  if (!f.on_reclaim_timeout.empty()) {
    if (f.on_reclaim_timeout == "none") {
      change.on_reclaim_timeout = ReclaimAction::kNone;
    } else if (f.on_reclaim_timeout == "shrink") {
      change.on_reclaim_timeout = ReclaimAction::kShrink;
    } else if (f.on_reclaim_timeout == "sleep") {
      change.on_reclaim_timeout = ReclaimAction::kSleep;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("--on-reclaim-timeout: \"", f.on_reclaim_timeout, "\" is not none, shrink or sleep"));
    }
  }
  return change;
}

// "prio 5, min 2.00 GiB, max none, on timeout shrink (5s)".
std::string PolicyText(const PoolPolicy& p) {
  return absl::StrCat("priority ", p.priority, ", min ", FormatBytes(p.min_bytes), ", max ",
                      p.max_bytes == 0 ? std::string("none") : FormatBytes(p.max_bytes), ", on reclaim timeout ",
                      ReclaimActionName(p.on_reclaim_timeout),
                      p.reclaim_timeout > absl::ZeroDuration()
                          ? absl::StrCat(" after ", absl::FormatDuration(p.reclaim_timeout))
                          : std::string(" after the daemon's --reclaim-timeout"));
}

// --wait and --wait-for of grow and wake.
absl::StatusOr<WaitOptions> Wait(const Flags& f) {
  WaitOptions wait{.wait = f.wait};
  if (!f.wait_for.empty() &&
      (!absl::ParseDuration(f.wait_for, &wait.wait_for) || wait.wait_for <= absl::ZeroDuration())) {
    return absl::InvalidArgumentError(
        absl::StrCat("--wait-for: \"", f.wait_for, "\" is not a positive duration (e.g. 30s)"));
  }
  if (!f.wait_for.empty()) wait.wait = true;
  return wait;
}

// --blocks or --bytes -> a target block count for `pool`.
absl::StatusOr<uint64_t> TargetBlocks(Client& client, const Flags& f, bool round_up) {
  if (f.bytes.empty()) return f.blocks;
  KVD_ASSIGN_OR_RETURN(uint64_t bytes, ParseBytes(f.bytes, "--bytes"));
  KVD_ASSIGN_OR_RETURN(PoolInfo pool, client.GetPool(f.pool));
  const uint64_t per_block = pool.geometry.block_bytes();
  if (per_block == 0) return absl::InternalError("the pool's geometry has zero-sized blocks");
  return round_up ? (bytes + per_block - 1) / per_block : bytes / per_block;
}

// ---------------------------------------------------------------------------------------------
// Verbs

// A duration in the two largest units that matter: "3d 4h", "1h 2m", "5m 3s", "42s".
std::string HumanDuration(uint64_t seconds) {
  const uint64_t d = seconds / 86400, h = seconds / 3600 % 24, m = seconds / 60 % 60, s = seconds % 60;
  if (d > 0) return absl::StrCat(d, "d ", h, "h");
  if (h > 0) return absl::StrCat(h, "h ", m, "m");
  if (m > 0) return absl::StrCat(m, "m ", s, "s");
  return absl::StrCat(s, "s");
}

// What each Durability means for a restart of the daemon (docs/operations.md).
const char* DurabilityMeaning(absl::string_view durability) {
  if (durability == "none") return "a restart loses every pool";
  if (durability == "clients") return "pools survive a restart where attached clients still map them";
  if (durability == "fd_store") return "every pool survives a restart (systemd file-descriptor store)";
  return "not reported by this daemon";
}

absl::Status Status(Client& client, const Flags& f, const Replies& replies) {
  KVD_ASSIGN_OR_RETURN(DeviceStatus d, client.DeviceInfo());
  if (f.json) return PrintReply<v1::DeviceInfo>(replies, {{"socket", JsonString(client.socket())}});
  std::printf("socket       %s\n", client.socket().c_str());
  std::printf("device       %u: %s (%s backend)\n", d.device_index, d.name.c_str(), d.backend.c_str());
  if (!d.uuid.empty()) std::printf("uuid         %s\n", d.uuid.c_str());
  if (!d.driver_version.empty()) std::printf("driver       %s\n", d.driver_version.c_str());
  std::printf("kvd          %s\n", d.daemon_version.c_str());
  std::printf("epoch        %lu\n", d.epoch);
  if (d.started_at_unix_ms > 0) {
    const int64_t now_ms = absl::ToUnixMillis(absl::Now());
    const uint64_t up_s = now_ms > static_cast<int64_t>(d.started_at_unix_ms)
                              ? (static_cast<uint64_t>(now_ms) - d.started_at_unix_ms) / 1000
                              : 0;
    std::printf("uptime       %s (started %s)\n", HumanDuration(up_s).c_str(),
                absl::FormatTime("%Y-%m-%d %H:%M:%S UTC",
                                 absl::FromUnixMillis(static_cast<int64_t>(d.started_at_unix_ms)), absl::UTCTimeZone())
                    .c_str());
  }
  std::printf("durability   %s: %s\n", d.durability.c_str(), DurabilityMeaning(d.durability));
  if (d.state_degraded) {
    std::printf("saved state  DEGRADED: %s (%lu saves failed since start; a restart now restores older records)\n",
                d.state_error.c_str(), d.state_save_failures);
  } else if (d.state_save_failures > 0) {
    std::printf("saved state  current (%lu saves failed since start, each saved again since)\n", d.state_save_failures);
  }
  std::printf("memory       %s total, %s free\n", FormatBytes(d.total_bytes).c_str(),
              FormatBytes(d.free_bytes).c_str());
  std::printf("committed    %s of a %s budget\n", FormatBytes(d.committed_bytes).c_str(),
              FormatBytes(d.budget_bytes).c_str());
  std::printf("reserved VA  %s\n", FormatBytes(d.reserved_bytes).c_str());
  std::printf("granularity  %s (chunks up to %s)\n", FormatBytes(d.granularity_bytes).c_str(),
              FormatBytes(d.max_chunk_bytes).c_str());
  std::printf("pools        %u\n", d.pool_count);
  std::printf("admission    %s available to a grow now (headroom %s; other processes use %s)\n",
              FormatBytes(d.available_bytes).c_str(), FormatBytes(d.headroom_bytes).c_str(),
              FormatBytes(d.foreign_bytes).c_str());
  std::printf("waiting      %u grows or wakes for %s\n", d.waiting_requests, FormatBytes(d.waiting_bytes).c_str());
  if (d.host_tier_bytes > 0) {
    std::printf("host tier    %s, %s kept by sleeping pools%s\n", FormatBytes(d.host_tier_bytes).c_str(),
                FormatBytes(d.host_tier_used_bytes).c_str(),
                d.host_tier_ready ? "" : " (still being allocated and registered: keeping sleeps wait)");
  }
  if (d.driver_out_of_memory > 0) {
    std::printf("driver OOM   %lu creations refused by the driver after admission (raise --device-headroom)\n",
                d.driver_out_of_memory);
  }
  return absl::OkStatus();
}

// kvctl caps: what the device's memory can be shared as, for connector operators.
absl::Status Caps(Client& client, const Flags& f, const Replies& replies) {
  KVD_ASSIGN_OR_RETURN(DeviceStatus d, client.DeviceInfo());
  if (f.json) return PrintReply<v1::DeviceInfo>(replies, {{"socket", JsonString(client.socket())}});
  const CapabilityReport& c = d.capabilities;
  std::printf("device          %u: %s (%s backend)%s%s\n", d.device_index, d.name.c_str(), d.backend.c_str(),
              d.uuid.empty() ? "" : ", ", d.uuid.c_str());
  std::printf("granularity     %s, chunks up to %s\n", FormatBytes(c.granularity_bytes).c_str(),
              FormatBytes(c.max_chunk_bytes).c_str());
  std::printf("handle types    %s\n", d.handle_types.empty() ? "none" : absl::StrJoin(d.handle_types, ", ").c_str());
  auto line = [](const char* what, const CapabilityReport::Item& item) {
    std::printf("%-15s %-3s %s\n", what, item.supported ? "yes" : "no", item.detail.c_str());
  };
  line("POSIX FD", c.posix_fd);
  line("FABRIC", c.fabric);
  line("DMA-BUF", c.dma_buf);
  line("GPUDirect RDMA", c.gpu_direct_rdma_vmm);
  std::printf("%-15s %s\n", "range FDs",
              c.range_spans_chunks ? "one FD may span several chunks" : "one FD per chunk (with an offset into it)");
  if (c.peers.empty()) std::printf("%-15s none visible to the daemon\n", "peers");
  for (const CapabilityReport::Peer& p : c.peers) {
    std::printf("%-15s %-3s device %u %s: %s\n", "peer access", p.access ? "yes" : "no", p.device_index,
                p.device_uuid.c_str(), p.detail.c_str());
  }
  return absl::OkStatus();
}

// "2", or "2 (1 pausable)" when some attached clients take part in pauses (AttachRequest.pausable).
std::string Clients(const PoolInfo& p) {
  const size_t pausable =
      std::count_if(p.clients.begin(), p.clients.end(), [](const ClientInfo& c) { return c.pausable; });
  return pausable == 0 ? absl::StrCat(p.client_count) : absl::StrCat(p.client_count, " (", pausable, " pausable)");
}

std::vector<std::vector<std::string>> PoolRows(const std::vector<PoolInfo>& pools);
void PrintTable(const std::vector<std::vector<std::string>>& rows);

absl::Status Pools(Client& client, const Flags& f, const Replies& replies) {
  KVD_ASSIGN_OR_RETURN(std::vector<PoolInfo> pools, client.ListPools());
  if (f.json) {
    // Every page as one ListPoolsResponse (next_page_token empty).
    v1::ListPoolsResponse all;
    for (const v1::ListPoolsResponse& page : replies.All<v1::ListPoolsResponse>()) {
      for (const v1::Pool& p : page.pools()) *all.add_pools() = p;
    }
    KVD_ASSIGN_OR_RETURN(std::string json, ProtoJson(all));
    PrintJson(json);
    return absl::OkStatus();
  }
  PrintTable(PoolRows(pools));
  return absl::OkStatus();
}

// "-", "asked 2.00 GiB, gave 512 MiB, 3.2s left", or the last reclaim's outcome ("last: gave …").
std::string ReclaimText(const ReclaimState& r) {
  if (r.reclaim_id != 0) {
    const int64_t left_ms = static_cast<int64_t>(r.deadline_unix_ms) - absl::ToUnixMillis(absl::Now());
    return absl::StrCat("#", r.reclaim_id, " asked ", FormatBytes(r.asked_bytes), ", gave ", FormatBytes(r.given_bytes),
                        ", ", absl::FormatDuration(absl::Milliseconds(std::max<int64_t>(left_ms, 0) / 100 * 100)),
                        " left");
  }
  return r.last_outcome.empty() ? std::string("-") : absl::StrCat("last: ", r.last_outcome);
}

// "-", or "#1 for 4.00 GiB, 2.3s" per waiting request.
std::string WaitingText(const std::vector<WaitingRequest>& waiting) {
  if (waiting.empty()) return "-";
  std::vector<std::string> parts;
  for (const WaitingRequest& w : waiting) {
    const int64_t ms = absl::ToUnixMillis(absl::Now()) - static_cast<int64_t>(w.waiting_since_unix_ms);
    parts.push_back(absl::StrCat("#", w.position, " for ", FormatBytes(w.asked_bytes), ", ",
                                 absl::FormatDuration(absl::Milliseconds(std::max<int64_t>(ms, 0) / 100 * 100))));
  }
  return absl::StrJoin(parts, "; ");
}

std::vector<std::vector<std::string>> PoolRows(const std::vector<PoolInfo>& pools) {
  std::vector<std::vector<std::string>> rows = {{"NAME", "STATE", "LAYOUT", "BLOCKS", "COMMITTED", "PENDING", "CLIENTS",
                                                 "PRIO", "MIN", "MAX", "WAITING", "RECLAIM"}};
  for (const PoolInfo& p : pools) {
    rows.push_back({p.name, PoolStateName(p.state), p.geometry.layout,
                    absl::StrCat(p.committed_blocks, "/", p.geometry.dims.capacity_blocks),
                    FormatBytes(p.committed_bytes), FormatBytes(p.pending_release_bytes), Clients(p),
                    absl::StrCat(p.policy.priority), FormatBytes(p.policy.min_bytes),
                    p.policy.max_bytes == 0 ? std::string("none") : FormatBytes(p.policy.max_bytes),
                    WaitingText(p.waiting), ReclaimText(p.reclaim)});
  }
  return rows;
}

void PrintTable(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width(rows[0].size(), 0);
  for (const auto& r : rows) {
    for (size_t i = 0; i < r.size(); ++i) width[i] = std::max(width[i], r[i].size());
  }
  for (const auto& r : rows) {
    std::string line;
    for (size_t i = 0; i < r.size(); ++i) {
      absl::StrAppend(&line, r[i], i + 1 < r.size() ? std::string(width[i] - r[i].size() + 2, ' ') : "");
    }
    std::printf("%s\n", line.c_str());
  }
}

// kvctl policy: set a pool's policy (the fields given) and print it.
absl::Status Policy(Client& client, const Flags& f, const Replies& replies) {
  KVD_ASSIGN_OR_RETURN(PolicyChange change, PolicyFlags(f));
  const bool any =
      change.priority || change.min_bytes || change.max_bytes || change.reclaim_timeout || change.on_reclaim_timeout;
  KVD_ASSIGN_OR_RETURN(PoolInfo p, any ? client.SetPoolPolicy(f.pool, change) : client.GetPool(f.pool));
  if (f.json) return PrintReply<v1::Pool>(replies);
  std::printf("%s: %s%s\n", p.name.c_str(), PolicyText(p.policy).c_str(),
              p.policy_operator_bounds ? " (cap and reclaim policy set by an operator)" : "");
  if (p.usage.has_value()) {
    std::printf("usage        %lu live, %lu evictable, all below block %lu (reported %s ago)\n", p.usage->live_blocks,
                p.usage->evictable_blocks, p.usage->used_blocks,
                absl::FormatDuration(
                    absl::Trunc(absl::Now() - absl::FromUnixMillis(static_cast<int64_t>(p.usage->reported_at_unix_ms)),
                                absl::Milliseconds(100)))
                    .c_str());
  }
  std::printf("reclaim      %s\n", ReclaimText(p.reclaim).c_str());
  std::printf("waiting      %s\n", WaitingText(p.waiting).c_str());
  return absl::OkStatus();
}

// kvctl top: the device's memory and every pool's claim, refreshed every --interval (--count times; 0:
// until interrupted). On a terminal each refresh replaces the one before.
absl::Status Top(Client& client, const Flags& f, const Replies&) {
  absl::Duration interval;
  if (!absl::ParseDuration(f.interval, &interval) || interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("--interval: \"", f.interval, "\" is not a positive duration"));
  }
  const bool tty = isatty(fileno(stdout)) != 0;
  for (uint32_t n = 0; f.count == 0 || n < f.count; ++n) {
    if (n > 0) absl::SleepFor(interval);
    KVD_ASSIGN_OR_RETURN(DeviceStatus d, client.DeviceInfo());
    KVD_ASSIGN_OR_RETURN(std::vector<PoolInfo> pools, client.ListPools());
    if (tty) std::printf("\033[H\033[2J");
    std::printf("%s  device %u %s: %s total, %s free, other processes %s, headroom %s\n",
                absl::FormatTime("%H:%M:%S", absl::Now(), absl::LocalTimeZone()).c_str(), d.device_index,
                d.name.c_str(), FormatBytes(d.total_bytes).c_str(), FormatBytes(d.free_bytes).c_str(),
                FormatBytes(d.foreign_bytes).c_str(), FormatBytes(d.headroom_bytes).c_str());
    std::printf("kvd: %s committed of a %s budget, %s available to a grow, %u waiting for %s\n\n",
                FormatBytes(d.committed_bytes).c_str(), FormatBytes(d.budget_bytes).c_str(),
                FormatBytes(d.available_bytes).c_str(), d.waiting_requests, FormatBytes(d.waiting_bytes).c_str());
    PrintTable(PoolRows(pools));
    std::printf("\n");
    std::fflush(stdout);
  }
  return absl::OkStatus();
}

void PrintResolution(const LayoutResolution& r) {
  std::printf("layout       %s (rule %s%s%s)\n", r.layout.c_str(), r.rule.c_str(), r.rule_detail.empty() ? "" : ": ",
              r.rule_detail.c_str());
  if (!r.allowed_layouts.empty()) std::printf("allowed      %s\n", absl::StrJoin(r.allowed_layouts, " ").c_str());
  for (const std::string& w : r.warnings) std::printf("warning      %s\n", w.c_str());
}

void PrintGeometry(const Geometry& g) {
  const PoolDims& d = g.dims;
  std::printf("dims         L=%lu B=%lu H=%lu N=%lu C=%lu e=%lu (%s per block)\n", d.layers, d.capacity_blocks, d.heads,
              d.block_tokens, d.channels, d.element_bytes, FormatBytes(g.block_bytes()).c_str());
  std::printf("strides      l=%lu b=%lu h=%lu n=%lu c=%lu (bytes), offset %lu\n", g.stride_l, g.stride_b, g.stride_h,
              g.stride_n, g.stride_c, g.offset);
  std::printf("segments     %lu x %s (stride %lu), %s reserved\n", g.segments, FormatBytes(g.segment_stride).c_str(),
              g.segment_stride, FormatBytes(g.reserved_bytes).c_str());
}

absl::Status Describe(Client& client, const Flags& f, const Replies& replies) {
  KVD_ASSIGN_OR_RETURN(PoolInfo p, client.GetPool(f.pool));
  if (f.json) return PrintReply<v1::Pool>(replies);
  std::printf("pool         %s (%s), owner uid %u, generation %lu\n", p.name.c_str(), PoolStateName(p.state),
              p.owner_uid, p.generation);
  if (!p.group.name.empty()) {
    std::printf("group        %s, rank %u of %u\n", p.group.name.c_str(), p.group.rank, p.group.size);
  }
  if (!p.peer_devices.empty()) std::printf("peers        %s\n", absl::StrJoin(p.peer_devices, ", ").c_str());
  if (!p.transaction.empty()) std::printf("held by      group transaction %s\n", p.transaction.c_str());
  PrintResolution(p.layout);
  PrintGeometry(p.geometry);
  std::printf("committed    %lu/%lu blocks, %s", p.committed_blocks, p.geometry.dims.capacity_blocks,
              FormatBytes(p.committed_bytes).c_str());
  if (p.state == PoolState::kSleeping) std::printf(" (wakes to %lu blocks)", p.wake_blocks);
  if (p.kept_bytes > 0)
    std::printf("\nkept         %s in the host tier (Wake copies them back)", FormatBytes(p.kept_bytes).c_str());
  std::printf("\npending      %s\n", FormatBytes(p.pending_release_bytes).c_str());
  if (!p.missing_chunk_ids.empty()) {
    std::printf("missing      %zu chunks no client has given back yet (recovering after a restart): %s\n",
                p.missing_chunk_ids.size(), absl::StrJoin(p.missing_chunk_ids, " ").c_str());
  }
  std::printf("chunks       %zu\n", p.chunks.size());
  for (const ChunkInfo& c : p.chunks) {
    std::printf("  #%-6lu segment %-4lu offset %-14lu %s\n", c.id, c.segment, c.offset, FormatBytes(c.bytes).c_str());
  }
  std::printf("clients      %zu\n", p.clients.size());
  for (const ClientInfo& c : p.clients) {
    std::printf("  %s %s uid %u pid %d, %s mapped%s%s\n", c.client_id.c_str(), c.name.c_str(), c.uid, c.pid,
                FormatBytes(c.mapped_bytes).c_str(),
                c.device_uuid.empty() ? "" : absl::StrCat(", from device ", c.device_uuid).c_str(),
                c.pausable ? ", pausable" : "");
  }
  return absl::OkStatus();
}

absl::Status Create(Client& client, const Flags& f, const Replies& replies) {
  KVD_ASSIGN_OR_RETURN(LayoutRequest layout, f.layout.Build());
  PoolOptions options{.name = f.pool, .dims = f.dims, .initial_blocks = f.initial_blocks, .layout = layout};
  options.allowed_uids = f.allowed_uids;
  options.group = f.group;
  options.peer_devices = f.peers;
  KVD_ASSIGN_OR_RETURN(PolicyChange policy, PolicyFlags(f));
  options.policy.priority = policy.priority.value_or(0);
  options.policy.min_bytes = policy.min_bytes.value_or(0);
  options.policy.max_bytes = policy.max_bytes.value_or(0);
  options.policy.reclaim_timeout = policy.reclaim_timeout.value_or(absl::ZeroDuration());
  options.policy.on_reclaim_timeout = policy.on_reclaim_timeout.value_or(ReclaimAction::kNone);
  Timer t;
  KVD_ASSIGN_OR_RETURN(PoolInfo p, client.CreatePool(options));
  if (f.json) return PrintReply<v1::Pool>(replies);
  std::printf("created %s: layout %s (rule %s), %lu blocks committed (%s), %s reserved, in %s\n", p.name.c_str(),
              p.geometry.layout.c_str(), p.layout.rule.c_str(), p.committed_blocks,
              FormatBytes(p.committed_bytes).c_str(), FormatBytes(p.reserved_bytes).c_str(), Ms(t.ms()).c_str());
  for (const std::string& w : p.layout.warnings) std::printf("warning: %s\n", w.c_str());
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint64_t>> ParseBlockList(absl::string_view text, absl::string_view flag);

// --pause-timeout and --detach-unresponsive.
absl::StatusOr<PauseOptions> Pause(const Flags& f) {
  PauseOptions pause{.detach_unresponsive = f.detach_unresponsive};
  if (!f.pause_timeout.empty() &&
      (!absl::ParseDuration(f.pause_timeout, &pause.timeout) || pause.timeout <= absl::ZeroDuration())) {
    return absl::InvalidArgumentError(
        absl::StrCat("--pause-timeout: \"", f.pause_timeout, "\" is not a positive duration (e.g. 5s, 500ms)"));
  }
  return pause;
}

// --live-blocks: "1,2,5-9", or "@FILE" holding such a list (commas, spaces or newlines between items).
// An empty list (no block is live) is a compaction shrink that moves nothing.
absl::StatusOr<std::vector<uint64_t>> LiveBlocks(const std::string& text) {
  std::string list = text;
  if (absl::StartsWith(text, "@")) {
    std::ifstream in(text.substr(1));
    if (!in) return absl::NotFoundError(absl::StrCat("--live-blocks: cannot read ", text.substr(1)));
    list.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    for (char& c : list) {
      if (absl::ascii_isspace(static_cast<unsigned char>(c))) c = ',';
    }
  }
  if (absl::StripAsciiWhitespace(absl::StrReplaceAll(list, {{",", ""}})).empty()) return std::vector<uint64_t>{};
  return ParseBlockList(list, "--live-blocks");
}

// What a Shrink or Compact did to the pool's physical shape (PoolUpdate.reshape).
void PrintReshape(const Reshape& r) {
  std::printf("chunks       %u before, %u after (%u replaced, %u new)\n", r.chunks_before, r.chunks_after,
              r.chunks_replaced, r.chunks_added);
  if (r.copied_bytes == 0) {
    std::printf("copied       nothing\n");
  } else {
    std::printf("copied       %s on the device in %s\n", FormatBytes(r.copied_bytes).c_str(),
                Ms(r.copy_us / 1000.0).c_str());
  }
  if (r.paused_clients == 0) {
    std::printf("pause        none (no client paused)\n");
  } else {
    std::printf("pause        %s: %u clients paused, %u resumed before the reply\n", Ms(r.pause_us / 1000.0).c_str(),
                r.paused_clients, r.resumed_clients);
  }
  if (r.steps > 1) {
    // Steps are bounded by --chunks-per-pause and by the memory free beside the chunks they replace.
    std::printf("steps        %u, the longest pause %s\n", r.steps, Ms(r.max_pause_us / 1000.0).c_str());
  }
  if (!r.detached_client_ids.empty()) {
    std::printf("detached     %s (did not acknowledge the pause)\n",
                absl::StrJoin(r.detached_client_ids, ", ").c_str());
  }
}

absl::Status Resize(Client& client, const Flags& f, const Replies& replies, bool grow) {
  if (f.bytes.empty() == (f.blocks == 0)) {
    return absl::InvalidArgumentError("give exactly one of --blocks and --bytes");
  }
  KVD_ASSIGN_OR_RETURN(uint64_t target, TargetBlocks(client, f, grow));
  ShrinkOptions options{.wait = f.wait, .whole_chunks_only = f.whole_chunks, .force = f.force};
  if (!grow) {
    if (f.live_given) {
      KVD_ASSIGN_OR_RETURN(options.live_blocks, LiveBlocks(f.live_blocks));
    }
    KVD_ASSIGN_OR_RETURN(options.pause, Pause(f));
  }
  KVD_ASSIGN_OR_RETURN(const WaitOptions wait, Wait(f));
  Timer t;
  absl::StatusOr<PoolChange> change = grow ? client.Grow(f.pool, target, wait) : client.Shrink(f.pool, target, options);
  KVD_RETURN_IF_ERROR(change.status());
  const double ms = t.ms();
  if (f.json) return PrintReply<v1::PoolUpdate>(replies, {{"round_trip_ms", JsonMs(ms)}});
  std::printf("%s %s to %lu blocks (%s) in %s", grow ? "grew" : "shrank", f.pool.c_str(), change->pool.committed_blocks,
              FormatBytes(change->pool.committed_bytes).c_str(), Ms(ms).c_str());
  if (grow) {
    std::printf(", %zu new chunks\n", change->added.size());
    return absl::OkStatus();
  }
  std::printf(", %zu chunks released, %s pending release\n", change->released_chunk_ids.size(),
              FormatBytes(change->pool.pending_release_bytes).c_str());
  if (!change->reshape.has_value()) return absl::OkStatus();  // a daemon from before reshaping
  const Reshape& r = *change->reshape;
  if (r.target_reached) {
    std::printf("target       reached: every segment ends at block %lu\n", change->pool.committed_blocks);
  } else {
    std::printf("target       NOT reached: %lu blocks committed for a target of %lu (%s)\n",
                change->pool.committed_blocks, target,
                f.whole_chunks ? "--whole-chunks releases whole chunks only" : "whole chunks only");
  }
  if (options.live_blocks.has_value()) {
    std::printf("moved        %zu live blocks below the target%s\n", r.moved_blocks.size(),
                r.moved_blocks.empty() ? "" : " (--json lists each src -> dst)");
  }
  PrintReshape(r);
  return absl::OkStatus();
}

absl::Status CompactVerb(Client& client, const Flags& f, const Replies& replies) {
  CompactOptions options{.max_chunks_per_pause = f.chunks_per_pause};
  KVD_ASSIGN_OR_RETURN(options.pause, Pause(f));
  Timer t;
  KVD_ASSIGN_OR_RETURN(PoolChange change, client.Compact(f.pool, options));
  const double ms = t.ms();
  if (f.json) return PrintReply<v1::PoolUpdate>(replies, {{"round_trip_ms", JsonMs(ms)}});
  std::printf("compacted %s: %lu blocks (%s) in %s\n", f.pool.c_str(), change.pool.committed_blocks,
              FormatBytes(change.pool.committed_bytes).c_str(), Ms(ms).c_str());
  if (change.reshape.has_value()) PrintReshape(*change.reshape);
  return absl::OkStatus();
}

absl::Status SleepWake(Client& client, const Flags& f, const Replies& replies, bool sleep) {
  if (f.pool.empty() == !f.all) return absl::InvalidArgumentError("give exactly one of POOL and --all");
  Timer t;
  SleepOptions options{.wait = f.wait, .force = f.force, .keep = f.keep};
  if (sleep) {
    KVD_ASSIGN_OR_RETURN(options.pause, Pause(f));
    if (!f.keep_live.empty()) {
      if (!f.keep) return absl::InvalidArgumentError("--live-blocks: give --keep too (they name what the sleep keeps)");
      KVD_ASSIGN_OR_RETURN(options.live_blocks, LiveBlocks(f.keep_live));
    }
  }
  KVD_ASSIGN_OR_RETURN(const WaitOptions wait, Wait(f));
  absl::StatusOr<std::vector<PoolChange>> changes = sleep ? client.Sleep(f.pool, options) : client.Wake(f.pool, wait);
  KVD_RETURN_IF_ERROR(changes.status());
  const double ms = t.ms();
  if (f.json) return PrintReply<v1::PoolUpdates>(replies, {{"round_trip_ms", JsonMs(ms)}});
  if (changes->empty()) std::printf("no pool to %s\n", sleep ? "put to sleep" : "wake");
  for (const PoolChange& c : *changes) {
    if (sleep) {
      std::printf("%s is sleeping: released %zu chunks, wakes to %lu blocks, %s pending release", c.pool.name.c_str(),
                  c.released_chunk_ids.size(), c.pool.wake_blocks, FormatBytes(c.pool.pending_release_bytes).c_str());
      if (c.pool.kept_bytes > 0) std::printf(", %s kept in the host tier", FormatBytes(c.pool.kept_bytes).c_str());
      std::printf("\n");
    } else {
      std::printf("%s is awake: %lu blocks (%s) in %zu chunks\n", c.pool.name.c_str(), c.pool.committed_blocks,
                  FormatBytes(c.pool.committed_bytes).c_str(), c.added.size());
    }
  }
  std::printf("in %s\n", Ms(ms).c_str());
  return absl::OkStatus();
}

absl::Status Delete(Client& client, const Flags& f, const Replies& replies) {
  KVD_ASSIGN_OR_RETURN(PauseOptions pause, Pause(f));
  KVD_ASSIGN_OR_RETURN(uint64_t released, client.DeletePool(f.pool, f.force, pause));
  if (f.json) return PrintReply<v1::DeletePoolResponse>(replies, {{"pool", JsonString(f.pool)}});
  std::printf("deleted %s, released %s\n", f.pool.c_str(), FormatBytes(released).c_str());
  return absl::OkStatus();
}

// kvctl drain: force-deletes every pool the caller may change, one by one, so that the device's memory
// is really given back (before a stop that should not keep the pools: docs/operations.md). A pool the
// daemon refuses to this uid (PERMISSION_DENIED) or that is gone meanwhile (NOT_FOUND) is skipped;
// any other failure is reported and makes the exit status 1 once every pool was tried.
absl::Status Drain(Client& client, const Flags& f, const Replies& replies) {
  KVD_ASSIGN_OR_RETURN(PauseOptions pause, Pause(f));
  KVD_ASSIGN_OR_RETURN(std::vector<PoolInfo> pools, client.ListPools());
  uint64_t released = 0;
  size_t deleted = 0, skipped = 0, failed = 0;
  std::vector<std::string> items;
  absl::Status first_failure;
  for (size_t i = 0; i < pools.size(); ++i) {
    const PoolInfo& p = pools[i];
    absl::StatusOr<uint64_t> r = client.DeletePool(p.name, /*force=*/true, pause);
    const std::string progress = absl::StrCat("(", i + 1, "/", pools.size(), ")");
    if (r.ok()) {
      ++deleted;
      released += *r;
      if (f.json) {
        KVD_ASSIGN_OR_RETURN(v1::DeletePoolResponse reply, replies.Last<v1::DeletePoolResponse>());
        KVD_ASSIGN_OR_RETURN(std::string json, ProtoJson(reply));
        items.push_back(JsonObject({{"pool", JsonString(p.name)}, {"reply", json}}));
      } else {
        std::printf("deleted %s %s, released %s, %zu clients detached\n", p.name.c_str(), progress.c_str(),
                    FormatBytes(*r).c_str(), p.clients.size());
        std::fflush(stdout);
      }
      continue;
    }
    const bool skip = absl::IsPermissionDenied(r.status()) || absl::IsNotFound(r.status());
    ++(skip ? skipped : failed);
    if (!skip && first_failure.ok()) first_failure = r.status();
    if (f.json) {
      items.push_back(JsonObject({{"pool", JsonString(p.name)},
                                  {"code", JsonString(absl::StatusCodeToString(r.status().code()))},
                                  {"message", JsonString(r.status().message())},
                                  {"skipped", skip ? "true" : "false"}}));
    } else {
      std::printf("%s %s %s: %s\n", skip ? "skipped" : "FAILED", p.name.c_str(), progress.c_str(),
                  r.status().ToString().c_str());
      std::fflush(stdout);
    }
  }
  if (f.json) {
    PrintJson(JsonObject({{"socket", JsonString(client.socket())},
                          {"pools", JsonArray(items)},
                          {"deleted", absl::StrCat(deleted)},
                          {"skipped", absl::StrCat(skipped)},
                          {"failed", absl::StrCat(failed)},
                          {"released_bytes", JsonString(absl::StrCat(released))}}));
  } else {
    std::printf("drained %zu of %zu pools, released %s%s%s\n", deleted, pools.size(), FormatBytes(released).c_str(),
                skipped > 0 ? absl::StrCat(", ", skipped, " skipped").c_str() : "",
                failed > 0 ? absl::StrCat(", ", failed, " failed").c_str() : "");
  }
  if (failed > 0) {
    return absl::Status(first_failure.code(),
                        absl::StrCat("drain: ", failed, " of ", pools.size(),
                                     " pools could not be deleted; first: ", first_failure.message()));
  }
  return absl::OkStatus();
}

absl::Status Resolve(Client& client, const Flags& f, const Replies& replies) {
  KVD_ASSIGN_OR_RETURN(LayoutRequest layout, f.layout.Build());
  const PoolDims& d = f.dims;
  const bool any_dim = d.layers || d.capacity_blocks || d.heads || d.block_tokens || d.channels || d.element_bytes;
  KVD_ASSIGN_OR_RETURN(ResolvedLayout r, client.ResolveLayout(layout, any_dim ? &d : nullptr));
  if (f.json) return PrintReply<v1::ResolveLayoutResponse>(replies);
  PrintResolution(r.resolution);
  if (r.has_geometry) PrintGeometry(r.geometry);
  return absl::OkStatus();
}

absl::Status Grant(Client& client, const Flags& f, const Replies& replies, bool revoke) {
  KVD_ASSIGN_OR_RETURN(PoolInfo p, client.GrantPeerAccess(f.pool, f.device_uuid, revoke));
  if (f.json) return PrintReply<v1::Pool>(replies);
  std::printf("%s %s %s %s; peer devices now: %s\n", revoke ? "revoked" : "granted", f.device_uuid.c_str(),
              revoke ? "from" : "on", p.name.c_str(),
              p.peer_devices.empty() ? "none" : absl::StrJoin(p.peer_devices, ", ").c_str());
  return absl::OkStatus();
}

// kvctl metadata POOL [--out FILE] | --set FILE --expected-version N: the pool's metadata blob.
absl::Status Metadata(Client& client, const Flags& f, const Replies& replies) {
  PoolMetadata m;
  if (!f.metadata_in.empty()) {
    if (f.expected_version < 0) {
      return absl::InvalidArgumentError(
          "--expected-version: required with --set (0 for a pool never set; "
          "`kvctl metadata POOL` shows the version)");
    }
    std::ifstream in(f.metadata_in, std::ios::binary);
    if (!in) return absl::NotFoundError(absl::StrCat("--set: cannot read ", f.metadata_in));
    std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    KVD_ASSIGN_OR_RETURN(m, client.SetPoolMetadata(f.pool, static_cast<uint64_t>(f.expected_version), std::move(data)));
  } else {
    KVD_ASSIGN_OR_RETURN(m, client.GetPoolMetadata(f.pool));
  }
  if (!f.metadata_out.empty()) {
    std::ofstream out(f.metadata_out, std::ios::binary | std::ios::trunc);
    if (!out || !out.write(m.data.data(), static_cast<std::streamsize>(m.data.size()))) {
      return absl::UnavailableError(absl::StrCat("--out: cannot write ", f.metadata_out));
    }
  }
  if (f.json) return PrintReply<v1::PoolMetadata>(replies);
  std::printf("%s metadata: version %lu, %s", m.pool.c_str(), static_cast<unsigned long>(m.version),
              FormatBytes(m.data.size()).c_str());
  if (m.version > 0)
    std::printf(", updated %s", absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", m.updated_at, absl::UTCTimeZone()).c_str());
  constexpr size_t kShown = 64;
  if (!m.data.empty() && f.metadata_out.empty()) {
    std::printf("\n%s%s", absl::CHexEscape(absl::string_view(m.data).substr(0, kShown)).c_str(),
                m.data.size() > kShown ? " ... (--out FILE for all of it)" : "");
  }
  std::printf("\n");
  return absl::OkStatus();
}

// "1,2,5-9" -> {1, 2, 5, 6, 7, 8, 9} (order kept; the daemon refuses repeats). `flag` names the option in
// errors.
absl::StatusOr<std::vector<uint64_t>> ParseBlockList(absl::string_view text, absl::string_view flag) {
  constexpr uint64_t kMaxIds = uint64_t{1} << 22;
  std::vector<uint64_t> ids;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    item = absl::StripAsciiWhitespace(item);
    const std::vector<absl::string_view> ends = absl::StrSplit(item, absl::MaxSplits('-', 1));
    uint64_t first = 0, last = 0;
    if (!absl::SimpleAtoi(ends[0], &first) || (ends.size() == 2 && !absl::SimpleAtoi(ends[1], &last))) {
      return absl::InvalidArgumentError(absl::StrCat(flag, ": \"", item, "\" is not a block id or a range A-B"));
    }
    if (ends.size() == 1) last = first;
    if (last < first) return absl::InvalidArgumentError(absl::StrCat(flag, ": range \"", item, "\" is empty"));
    if (last - first >= kMaxIds || ids.size() + (last - first + 1) > kMaxIds) {
      return absl::InvalidArgumentError(absl::StrCat(flag, ": more than ", kMaxIds, " block ids"));
    }
    for (uint64_t b = first; b <= last; ++b) ids.push_back(b);
  }
  if (ids.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, ": names no block (e.g. ", flag, " 0,4,8-15)"));
  return ids;
}

absl::Status Transfer(Client& client, const Flags& f, const Replies& replies) {
  std::vector<uint64_t> ids;
  if (!f.block_list.empty()) {
    KVD_ASSIGN_OR_RETURN(ids, ParseBlockList(f.block_list, "--blocks"));
  }
  KVD_ASSIGN_OR_RETURN(TransferPlan plan, client.DescribeTransfer(f.pool, ids));
  if (f.json) return PrintReply<v1::DescribeTransferResponse>(replies, {{"pool", JsonString(f.pool)}});
  std::printf("%s: %lu blocks (%s) as %zu descriptors; %lu blocks committed, generation %lu\n", f.pool.c_str(),
              plan.blocks, FormatBytes(plan.bytes).c_str(), plan.descriptors.size(), plan.committed_blocks,
              plan.generation);
  if (plan.descriptors.empty()) return absl::OkStatus();
  std::printf("%-8s %16s %14s %14s %10s\n", "SEGMENT", "OFFSET", "BYTES", "STRIDE", "COUNT");
  for (const TransferDescriptor& d : plan.descriptors) {
    std::printf("%-8lu %16lu %14lu %14lu %10lu\n", d.segment, d.offset, d.bytes, d.stride, d.count);
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// kvctl group: one engine's ranks on several daemons, as one unit.

absl::StatusOr<std::unique_ptr<Group>> OpenGroup(const Flags& f, Replies& replies) {
  absl::Duration ttl;
  if (!absl::ParseDuration(f.ttl, &ttl) || ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("--ttl: \"", f.ttl, "\" is not a positive duration (e.g. 30s)"));
  }
  std::vector<std::string> sockets;
  for (const std::string& s : f.sockets) {
    for (absl::string_view part : absl::StrSplit(s, ',', absl::SkipEmpty())) sockets.emplace_back(part);
  }
  if (sockets.empty()) {
    KVD_ASSIGN_OR_RETURN(sockets, NodeSockets(f.socket_dir));
  }
  return Group::Open(f.pool, sockets,
                     {.connect = {.client_name = "kvctl", .on_reply = replies.Observer()}, .ttl = ttl});
}

// The replies of type M (kvd.v1.Pool or kvd.v1.PoolUpdate) of a group operation, one per rank of
// `ranks`, by the group rank of the pool they carry.
template <typename M>
absl::StatusOr<std::vector<M>> ByRank(const Replies& replies, const std::vector<uint32_t>& ranks) {
  auto pool_of = [](const M& m) -> const v1::Pool& {
    if constexpr (std::is_same_v<M, v1::Pool>) {
      return m;
    } else {
      return m.pool();
    }
  };
  std::vector<M> all = replies.All<M>();
  std::vector<M> out;
  for (uint32_t rank : ranks) {
    auto it = std::find_if(all.rbegin(), all.rend(), [&](const M& m) { return pool_of(m).group().rank() == rank; });
    if (it == all.rend()) return absl::InternalError(absl::StrCat("no reply of rank ", rank, " to print"));
    out.push_back(*it);
  }
  return out;
}

// Every rank in the same state with the same committed blocks.
bool Consistent(const std::vector<GroupRank>& ranks) {
  for (const GroupRank& r : ranks) {
    if (r.pool.state != ranks.front().pool.state || r.pool.committed_blocks != ranks.front().pool.committed_blocks) {
      return false;
    }
  }
  return true;
}

void PrintRanks(const std::vector<GroupRank>& ranks) {
  for (const GroupRank& r : ranks) {
    std::printf("  rank %-3u %-20s %-9s %8lu blocks %10s  %u clients  %s (%s)%s\n", r.rank, r.pool.name.c_str(),
                PoolStateName(r.pool.state), r.pool.committed_blocks, FormatBytes(r.pool.committed_bytes).c_str(),
                r.pool.client_count, r.socket.c_str(), r.device_uuid.c_str(),
                r.pool.transaction.empty() ? "" : absl::StrCat(" held by ", r.pool.transaction).c_str());
  }
}

absl::Status GroupStatus(Group& group, const Flags& f, Replies& replies) {
  replies.Clear();
  KVD_ASSIGN_OR_RETURN(std::vector<GroupRank> ranks, group.Refresh());
  const bool consistent = Consistent(ranks);
  if (f.json) {
    std::vector<uint32_t> numbers;
    for (const GroupRank& r : ranks) numbers.push_back(r.rank);
    KVD_ASSIGN_OR_RETURN(std::vector<v1::Pool> pools, ByRank<v1::Pool>(replies, numbers));
    std::vector<std::string> items;
    for (size_t i = 0; i < ranks.size(); ++i) {
      KVD_ASSIGN_OR_RETURN(std::string pool, ProtoJson(pools[i]));
      items.push_back(JsonObject({{"rank", absl::StrCat(ranks[i].rank)},
                                  {"socket", JsonString(ranks[i].socket)},
                                  {"device_uuid", JsonString(ranks[i].device_uuid)},
                                  {"pool", std::move(pool)}}));
    }
    PrintJson(JsonObject({{"group", JsonString(group.name())},
                          {"size", absl::StrCat(ranks.size())},
                          {"consistent", consistent ? "true" : "false"},
                          {"ranks", JsonArray(items)}}));
    return absl::OkStatus();
  }
  std::printf("group %s: %zu ranks, %s\n", group.name().c_str(), ranks.size(),
              consistent ? absl::StrCat(PoolStateName(ranks.front().pool.state), ", ",
                                        ranks.front().pool.committed_blocks, " blocks on every rank")
                               .c_str()
                         : "INCONSISTENT: the ranks differ in state or committed blocks");
  PrintRanks(ranks);
  return absl::OkStatus();
}

absl::Status GroupChangeVerb(Group& group, const Flags& f, Replies& replies, GroupOp op) {
  uint64_t target = f.blocks;
  if ((op == GroupOp::kGrow || op == GroupOp::kShrink) && !f.bytes.empty()) {
    KVD_ASSIGN_OR_RETURN(uint64_t bytes, ParseBytes(f.bytes, "--bytes"));
    const uint64_t per_block = group.ranks().front().pool.geometry.block_bytes();
    if (per_block == 0) return absl::InternalError("rank 0's geometry has zero-sized blocks");
    target = op == GroupOp::kGrow ? (bytes + per_block - 1) / per_block : bytes / per_block;
  }
  replies.Clear();
  Timer t;
  absl::StatusOr<GroupChange> change;
  switch (op) {
    case GroupOp::kGrow:
      change = group.Grow(target);
      break;
    case GroupOp::kShrink:
      change = group.Shrink(target, f.wait, f.force);
      break;
    case GroupOp::kSleep:
      change = group.Sleep(f.wait, f.force, f.keep);
      break;
    case GroupOp::kWake:
      change = group.Wake();
      break;
  }
  KVD_RETURN_IF_ERROR(change.status());
  const double ms = t.ms();
  const std::vector<GroupRank> ranks = group.ranks();
  if (f.json) {
    std::vector<uint32_t> numbers;
    for (const PoolChange& c : change->ranks) numbers.push_back(c.pool.group.rank);
    KVD_ASSIGN_OR_RETURN(std::vector<v1::PoolUpdate> updates, ByRank<v1::PoolUpdate>(replies, numbers));
    std::vector<std::string> items;
    for (const v1::PoolUpdate& u : updates) {
      KVD_ASSIGN_OR_RETURN(std::string update, ProtoJson(u));
      items.push_back(std::move(update));
    }
    PrintJson(JsonObject({{"group", JsonString(group.name())},
                          {"operation", JsonString(GroupOpName(op))},
                          {"prepared_bytes", absl::StrCat(change->prepared_bytes)},
                          {"prepare_us", absl::StrCat(change->prepare_us)},
                          {"commit_us", absl::StrCat(change->commit_us)},
                          {"round_trip_ms", JsonMs(ms)},
                          {"ranks", JsonArray(items)}}));
    return absl::OkStatus();
  }
  uint64_t bytes = 0;
  for (const GroupRank& r : ranks) bytes += r.pool.committed_bytes;
  const PoolInfo& first = ranks.front().pool;
  const char* verb = op == GroupOp::kGrow     ? "grew"
                     : op == GroupOp::kShrink ? "shrank"
                     : op == GroupOp::kSleep  ? "put to sleep"
                                              : "woke";
  std::printf("%s group %s: %zu ranks, %s, %lu blocks per rank, %s committed in all, in %s (prepare %s, commit %s)\n",
              verb, group.name().c_str(), ranks.size(), PoolStateName(first.state),
              first.state == PoolState::kSleeping ? first.wake_blocks : first.committed_blocks,
              FormatBytes(bytes).c_str(), Ms(ms).c_str(), Ms(change->prepare_us / 1000.0).c_str(),
              Ms(change->commit_us / 1000.0).c_str());
  PrintRanks(ranks);
  return absl::OkStatus();
}

void AddDims(CLI::App* app, Flags& f, bool required) {
  auto opt = [&](const char* name, uint64_t& v, const char* help) {
    CLI::Option* o = app->add_option(name, v, help);
    if (required) o->required();
  };
  opt("--layers", f.dims.layers, "L: attention layers");
  opt("--capacity-blocks", f.dims.capacity_blocks, "B: most blocks the pool can hold");
  opt("--heads", f.dims.heads, "H: KV heads per layer");
  opt("--block-tokens", f.dims.block_tokens, "N: tokens per block");
  opt("--channels", f.dims.channels, "C: channels per head");
  opt("--element-bytes", f.dims.element_bytes, "e: bytes per element");
}

int Fail(const std::string& reason, int code) {
  std::string line = reason;
  for (char& c : line) {
    if (c == '\n') c = ' ';
  }
  std::fprintf(stderr, "kvctl: %s\n", line.c_str());
  return code;
}

int Main(int argc, char** argv) {
  CLI::App app{"kvctl: inspect and manage a kvd daemon's KV-cache pools"};
  app.require_subcommand(1);
  Flags f;
  const std::string default_socket =
      absl::StrCat(wire::kDefaultSocketDir, "/", wire::kSocketPrefix, "<N>", wire::kSocketSuffix);
  app.add_option(
      "--socket", f.socket,
      absl::StrCat("kvd's gRPC socket (default: $", wire::kSocketEnv, ", else ", default_socket, " for --device N)"));
  app.add_option("--device", f.device,
                 absl::StrCat("The device whose kvd to use: an index (socket ", default_socket,
                              "), or a device UUID or unique prefix of one, looked up among the kvds in $",
                              wire::kSocketDirEnv, " (default ", wire::kDefaultSocketDir, ")"))
      ->capture_default_str();
  app.add_flag("--json", f.json,
               "Machine-readable output: the daemon's reply as proto3 JSON (64-bit integers as strings; see "
               "docs/integrating.md)");
  app.fallthrough();

  CLI::App* status = app.add_subcommand(
      "status", "The device, the daemon (version, epoch, uptime, durability), its memory and the daemon's totals");
  CLI::App* caps = app.add_subcommand(
      "caps", "What the device's memory can be shared as (POSIX FD, fabric, DMA-BUF, GPUDirect RDMA, peers), probed");
  CLI::App* pools = app.add_subcommand("pools", "List pools");
  CLI::App* describe = app.add_subcommand("describe", "One pool: geometry, strides, segments, chunks, clients");
  describe->add_option("pool", f.pool, "Pool name")->required();

  CLI::App* create = app.add_subcommand("create", "Create a pool");
  create->add_option("pool", f.pool, "Pool name")->required();
  AddDims(create, f, /*required=*/true);
  create->add_option("--initial-blocks", f.initial_blocks, "Blocks committed at creation");
  create->add_option("--layout", f.layout.override_layout, "Explicit layout (overrides everything)");
  create->add_option("--allow-uid", f.allowed_uids, "Further uid that may attach and resize (repeatable)");
  create->add_option("--group", f.group.name, "Engine group this pool is one rank of (see kvctl group)");
  create->add_option("--rank", f.group.rank, "This pool's rank in --group");
  create->add_option("--group-size", f.group.size, "The number of ranks in --group");
  create->add_option("--peer", f.peers, "Device UUID (or '*') whose clients may attach (repeatable)");
  f.layout.Add(create);
  CLI::App* policy = app.add_subcommand(
      "policy",
      "Show a pool's policy, usage report, reclaim and waiting requests, or set the policy's fields given (a uid "
      "other than root and kvd's may lower its pool's claim, and raise it only as far as the operator grants it)");
  policy->add_option("pool", f.pool, "Pool name")->required();
  for (CLI::App* sub : {create, policy}) {
    sub->add_option("--priority", f.priority,
                    "0..1000: waiting grows of higher priority are served first and may reclaim memory from pools of "
                    "lower priority");
    sub->add_option("--min-bytes", f.min_bytes, "Guaranteed bytes: never asked for, nor shrunk below, by a reclaim");
    sub->add_option("--max-bytes", f.max_bytes, "Cap on the pool's committed bytes (a size, or none)");
    sub->add_option("--reclaim-timeout", f.reclaim_timeout,
                    "How long its engine has to answer a reclaim (e.g. 5s; 0: the daemon's --reclaim-timeout)");
    sub->add_option("--on-reclaim-timeout", f.on_reclaim_timeout,
                    "What kvd does when its engine does not give back in time or declines: none, shrink (to the "
                    "blocks it reported in use), sleep")
        ->check(CLI::IsMember({"none", "shrink", "sleep"}));
  }
  CLI::App* top = app.add_subcommand(
      "top", "A live view of the device's memory, every pool's policy and claim, and the requests waiting for memory");
  top->add_option("--interval", f.interval, "Between refreshes")->capture_default_str();
  top->add_option("--count", f.count, "Refreshes before exiting (0: until interrupted)")->capture_default_str();

  CLI::App* grow = app.add_subcommand("grow", "Grow a pool to --blocks or --bytes (rounded up to whole blocks)");
  CLI::App* shrink = app.add_subcommand(
      "shrink",
      "Shrink a pool to --blocks or --bytes (rounded down): every segment's prefix ends at the target (rounded up to "
      "the granularity), a chunk straddling it is replaced by a smaller copy while the attached clients pause");
  for (CLI::App* sub : {grow, shrink}) {
    sub->add_option("pool", f.pool, "Pool name")->required();
    CLI::Option* b = sub->add_option("--blocks", f.blocks, "Target committed blocks");
    CLI::Option* s = sub->add_option("--bytes", f.bytes, "Target committed size (e.g. 100GiB)");
    b->excludes(s);
  }
  shrink->add_flag("--wait", f.wait, "Return once every attached client unmapped the released chunks");
  grow->add_flag("--wait", f.wait,
                 "When memory is short, wait for it in the daemon's queue (by the pool's priority, then arrival; "
                 "memory may be reclaimed from pools of lower priority) instead of failing at once");
  grow->add_option("--wait-for", f.wait_for, "With --wait: wait at most this long (default 30s)");
  CLI::Option* whole = shrink->add_flag(
      "--whole-chunks", f.whole_chunks,
      "Release whole chunks only and move no byte: the pool may stay above the target (the output says so)");
  CLI::Option* live = shrink->add_option(
      "--live-blocks", f.live_blocks,
      "Compaction shrink: the blocks still in use, e.g. 0,4,8-15, or @FILE with such a list (commas, spaces or "
      "newlines); live blocks at or above the target move to free blocks below it first");
  live->excludes(whole);
  CLI::App* compact = app.add_subcommand(
      "compact",
      "Rewrite a fragmented pool as one chunk per segment (split at the daemon's maximum chunk size), copying on the "
      "device while the attached clients pause");
  compact->add_option("pool", f.pool, "Pool name")->required();
  compact
      ->add_option("--chunks-per-pause", f.chunks_per_pause,
                   "With clients attached, replace at most this many chunks under one pause, in as many steps as it "
                   "takes (each paused client unmaps every replaced chunk; default: the daemon's "
                   "--compact-chunks-per-pause)")
      ->check(CLI::Range(1u, 1u << 20));
  CLI::App* sleep = app.add_subcommand(
      "sleep",
      "Release a pool's (or every pool's) memory, keeping its VA; attached engines that are pausable pause first");
  CLI::App* wake = app.add_subcommand("wake", "Recommit a sleeping pool (or every sleeping pool)");
  for (CLI::App* sub : {sleep, wake}) {
    sub->add_option("pool", f.pool, "Pool name");
    sub->add_flag("--all", f.all, "Every pool");
  }
  sleep->add_flag("--wait", f.wait, "Return once every attached client unmapped the released chunks");
  wake->add_flag("--wait", f.wait, "When memory is short, wait for it (one pool; as grow --wait)");
  wake->add_option("--wait-for", f.wait_for, "With --wait: wait at most this long (default 30s)");
  sleep->add_flag("--keep", f.keep,
                  "Keep the contents in the daemon's host tier (--host-tier-bytes); wake copies them back");
  sleep->add_option("--live-blocks", f.keep_live,
                    "With --keep: keep only these blocks, e.g. 0,4,8-15, or @FILE with such a list");

  CLI::App* del = app.add_subcommand("delete", "Delete a pool");
  del->add_option("pool", f.pool, "Pool name")->required();
  del->add_flag("--force", f.force,
                "Delete even with clients attached: pausable engines pause first, the others keep what they map "
                "(counted as pending release) until they detach");
  CLI::App* drain = app.add_subcommand(
      "drain",
      "Force-delete every pool this uid may change, giving the device's memory back (before a stop that should "
      "not keep the pools); pausable engines pause first, the others keep what they map until they detach");
  for (CLI::App* sub : {shrink, sleep}) {
    sub->add_flag("--force", f.force,
                  "Go on past attached engines of other sessions that are not pausable (default: refused naming "
                  "them): they keep what they map, counted as pending release, until they detach; pausable ones "
                  "that do not acknowledge the pause in time are detached");
  }
  for (CLI::App* sub : {shrink, compact, sleep, del, drain}) {
    sub->add_option("--pause-timeout", f.pause_timeout,
                    "How long each attached client has to acknowledge the pause, e.g. 5s (default: the daemon's "
                    "--pause-timeout)");
  }
  for (CLI::App* sub : {shrink, compact, sleep}) {
    sub->add_flag("--detach-unresponsive", f.detach_unresponsive,
                  "Detach a client that does not acknowledge the pause in time and go on (default: fail with "
                  "DEADLINE_EXCEEDED naming it, nothing changed)");
  }

  CLI::App* grant = app.add_subcommand("grant", "Let clients on another device of the node attach a pool");
  CLI::App* revoke = app.add_subcommand("revoke", "Take a peer-access grant back (attached clients keep theirs)");
  for (CLI::App* sub : {grant, revoke}) {
    sub->add_option("pool", f.pool, "Pool name")->required();
    sub->add_option("device", f.device_uuid, "Device UUID as `kvctl status` of that device's kvd shows it, or '*'")
        ->required();
  }

  CLI::App* metadata = app.add_subcommand(
      "metadata", "A pool's metadata: engine-defined bytes kept with it across restarts (show, save, or --set)");
  metadata->add_option("pool", f.pool, "Pool name")->required();
  metadata->add_option("--out", f.metadata_out, "Write the data to this file");
  metadata->add_option("--set", f.metadata_in, "Store this file's bytes as the metadata (compare-and-set)");
  metadata->add_option("--expected-version", f.expected_version,
                       "With --set: the version it replaces (0 for a pool never set); another one is ABORTED");

  CLI::App* transfer = app.add_subcommand(
      "transfer", "A pool's blocks as strided transfer descriptors {segment, offset, bytes, stride, count}");
  transfer->add_option("pool", f.pool, "Pool name")->required();
  transfer->add_option("--blocks", f.block_list,
                       "Block ids and ranges, e.g. 0,4,8-15 (default: every committed block)");

  CLI::App* group = app.add_subcommand("group", "One engine's pools on several daemons (its tensor-parallel ranks)");
  group->require_subcommand(1);
  CLI::App* group_status = group->add_subcommand("status", "Every rank of a group and whether they agree");
  CLI::App* group_grow = group->add_subcommand("grow", "Grow every rank to --blocks or --bytes, or none of them");
  CLI::App* group_shrink = group->add_subcommand("shrink", "Shrink every rank to --blocks or --bytes, or none");
  CLI::App* group_sleep = group->add_subcommand("sleep", "Put every rank to sleep, or none");
  CLI::App* group_wake = group->add_subcommand("wake", "Wake every rank, or none");
  group_sleep->add_flag("--keep", f.keep, "Every rank keeps its contents in its daemon's host tier, or none sleeps");
  for (CLI::App* sub : {group_status, group_grow, group_shrink, group_sleep, group_wake}) {
    sub->add_option("group", f.pool, "Group name (the pools' --group)")->required();
    sub->add_option("--sockets", f.sockets,
                    absl::StrCat("The daemons to search, comma-separated (default: every *", wire::kSocketSuffix,
                                 " in --socket-dir)"));
    sub->add_option("--socket-dir", f.socket_dir,
                    absl::StrCat("Where the node's kvd sockets are (default: $", wire::kSocketDirEnv, ", else ",
                                 wire::kDefaultSocketDir, ")"));
    sub->add_option("--ttl", f.ttl, "How long each daemon holds a prepared rank before aborting it")
        ->capture_default_str();
  }
  for (CLI::App* sub : {group_grow, group_shrink}) {
    CLI::Option* b = sub->add_option("--blocks", f.blocks, "Target committed blocks per rank");
    CLI::Option* s = sub->add_option("--bytes", f.bytes, "Target committed size per rank (e.g. 10GiB)");
    b->excludes(s);
  }
  for (CLI::App* sub : {group_shrink, group_sleep}) {
    sub->add_flag("--wait", f.wait, "Return once every attached client unmapped the released chunks");
    sub->add_flag("--force", f.force,
                  "Go on past attached engines of other sessions that are not pausable (default: refused naming "
                  "them); they keep what they map, counted as pending release, until they detach");
  }

  CLI::App* layout = app.add_subcommand("layout", "Layout tools");
  layout->require_subcommand(1);
  CLI::App* resolve = layout->add_subcommand("resolve", "Dry run of the layout precedence chain (and geometry)");
  resolve->add_option("--override", f.layout.override_layout, "Explicit layout (rule 1)");
  CLI::Option* env = resolve->add_option(
      "--env", f.layout.env, absl::StrCat("The engine's ", wire::kLayoutEnv, " (default: this process's environment)"));
  f.layout.Add(resolve);
  AddDims(resolve, f, /*required=*/false);

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return Fail(e.what(), 2);
  }
  f.layout.env_given = env->count() > 0;
  f.live_given = live->count() > 0;
  if (transfer->parsed() && transfer->count("--blocks") > 0 && f.block_list.empty()) {
    return Fail("--blocks: names no block (e.g. --blocks 0,4,8-15)", 2);
  }
  if ((grow->parsed() || shrink->parsed() || group_grow->parsed() || group_shrink->parsed()) &&
      f.bytes.empty() == (f.blocks == 0)) {
    return Fail("give exactly one of --blocks and --bytes", 2);
  }
  if ((sleep->parsed() || wake->parsed()) && f.pool.empty() == !f.all) {
    return Fail("give exactly one of POOL and --all", 2);
  }

  Replies replies;  // what --json prints
  if (group->parsed()) {
    absl::StatusOr<std::unique_ptr<Group>> g = OpenGroup(f, replies);
    if (!g.ok()) return Fail(g.status().ToString(), 1);
    absl::Status s;
    if (group_status->parsed()) {
      s = GroupStatus(**g, f, replies);
    } else if (group_grow->parsed()) {
      s = GroupChangeVerb(**g, f, replies, GroupOp::kGrow);
    } else if (group_shrink->parsed()) {
      s = GroupChangeVerb(**g, f, replies, GroupOp::kShrink);
    } else if (group_sleep->parsed()) {
      s = GroupChangeVerb(**g, f, replies, GroupOp::kSleep);
    } else {
      s = GroupChangeVerb(**g, f, replies, GroupOp::kWake);
    }
    if (!s.ok()) return Fail(s.ToString(), 1);
    std::fflush(stdout);
    return 0;
  }

  // --device: an index names the default socket; anything else is a device UUID (prefix) to look up.
  int device_index = 0;
  std::string socket = f.socket;
  if (socket.empty() && !absl::SimpleAtoi(f.device, &device_index)) {
    absl::StatusOr<std::string> found = FindSocket(f.device);
    if (!found.ok()) return Fail(absl::StrCat("--device: ", found.status().ToString()), 1);
    socket = *found;
  }
  if (device_index < 0) return Fail("--device: an index must not be negative", 2);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(
      {.socket = socket, .device = device_index, .client_name = "kvctl", .on_reply = replies.Observer()});
  if (!client.ok()) return Fail(client.status().ToString(), 1);
  Client& c = **client;
  absl::Status s;
  if (status->parsed()) {
    s = Status(c, f, replies);
  } else if (caps->parsed()) {
    s = Caps(c, f, replies);
  } else if (pools->parsed()) {
    s = Pools(c, f, replies);
  } else if (describe->parsed()) {
    s = Describe(c, f, replies);
  } else if (create->parsed()) {
    s = Create(c, f, replies);
  } else if (grow->parsed() || shrink->parsed()) {
    s = Resize(c, f, replies, grow->parsed());
  } else if (compact->parsed()) {
    s = CompactVerb(c, f, replies);
  } else if (sleep->parsed() || wake->parsed()) {
    s = SleepWake(c, f, replies, sleep->parsed());
  } else if (del->parsed()) {
    s = Delete(c, f, replies);
  } else if (drain->parsed()) {
    s = Drain(c, f, replies);
  } else if (resolve->parsed()) {
    s = Resolve(c, f, replies);
  } else if (grant->parsed() || revoke->parsed()) {
    s = Grant(c, f, replies, revoke->parsed());
  } else if (transfer->parsed()) {
    s = Transfer(c, f, replies);
  } else if (metadata->parsed()) {
    s = Metadata(c, f, replies);
  } else if (policy->parsed()) {
    s = Policy(c, f, replies);
  } else if (top->parsed()) {
    s = Top(c, f, replies);
  }
  if (!s.ok()) return Fail(s.ToString(), 1);
  std::fflush(stdout);
  return 0;
}

}  // namespace
}  // namespace kvd

int main(int argc, char** argv) { return kvd::Main(argc, argv); }
