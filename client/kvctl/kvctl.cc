// kvctl: the operator's command line for a kvd daemon, built on libkvd (docs/integrating.md, "kvctl").
//
//   kvctl [--socket=PATH] [--device=N] [--json] VERB ...
//
// Output: human-readable text (byte sizes with FormatBytes), or with --json one JSON document on stdout
// whose field names are the proto's (snake_case) and whose shape is documented in docs/integrating.md.
// Exit status: 0 on success; 1 when the daemon (or the connection) fails the request; 2 for a usage
// error. Every failure prints exactly one line "kvctl: <reason>" on stderr.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "kvd/client.h"
#include "kvd/group.h"
#include "kvd/status.h"
#include "kvd/units.h"
#include "kvd/wire.h"

namespace kvd {
namespace {

// ---------------------------------------------------------------------------------------------
// A minimal ordered JSON value: objects keep insertion order, so output is stable.

class Json {
 public:
  static Json Null() { return Json(Kind::kScalar, "null"); }
  static Json Str(absl::string_view s) { return Json(Kind::kScalar, Quote(s)); }
  static Json Num(uint64_t v) { return Json(Kind::kScalar, absl::StrCat(v)); }
  static Json Int(int64_t v) { return Json(Kind::kScalar, absl::StrCat(v)); }
  static Json Double(double v) { return Json(Kind::kScalar, absl::StrFormat("%.3f", v)); }
  static Json Bool(bool v) { return Json(Kind::kScalar, v ? "true" : "false"); }
  static Json Object() { return Json(Kind::kObject, ""); }
  static Json Array() { return Json(Kind::kArray, ""); }
  template <typename T, typename F>
  static Json ArrayOf(const std::vector<T>& items, F&& f) {
    Json a = Array();
    for (const T& item : items) a.Push(f(item));
    return a;
  }

  Json& Set(absl::string_view key, Json value) {
    members_.emplace_back(std::string(key), std::move(value));
    return *this;
  }
  Json& Push(Json value) {
    members_.emplace_back("", std::move(value));
    return *this;
  }

  std::string Render(int indent = 0) const {
    if (kind_ == Kind::kScalar) return scalar_;
    const char open = kind_ == Kind::kObject ? '{' : '[';
    const char close = kind_ == Kind::kObject ? '}' : ']';
    if (members_.empty()) return std::string{open, close};
    const std::string pad(indent + 2, ' ');
    std::string out(1, open);
    for (size_t i = 0; i < members_.size(); ++i) {
      absl::StrAppend(&out, i == 0 ? "\n" : ",\n", pad);
      if (kind_ == Kind::kObject) absl::StrAppend(&out, Quote(members_[i].first), ": ");
      absl::StrAppend(&out, members_[i].second.Render(indent + 2));
    }
    absl::StrAppend(&out, "\n", std::string(indent, ' '), std::string(1, close));
    return out;
  }

 private:
  enum class Kind { kScalar, kObject, kArray };
  Json(Kind kind, std::string scalar) : kind_(kind), scalar_(std::move(scalar)) {}

  static std::string Quote(absl::string_view s) {
    std::string out = "\"";
    for (char c : s) {
      switch (c) {
        case '"':
          out += "\\\"";
          break;
        case '\\':
          out += "\\\\";
          break;
        case '\n':
          out += "\\n";
          break;
        case '\t':
          out += "\\t";
          break;
        default:
          if (static_cast<unsigned char>(c) < 0x20) {
            absl::StrAppend(&out, absl::StrFormat("\\u%04x", static_cast<unsigned char>(c)));
          } else {
            out += c;
          }
      }
    }
    return out + "\"";
  }

  Kind kind_;
  std::string scalar_;
  std::vector<std::pair<std::string, Json>> members_;
};

Json StrArray(const std::vector<std::string>& v) {
  return Json::ArrayOf(v, [](const std::string& s) { return Json::Str(s); });
}

Json DimsJson(const PoolDims& d) {
  return Json::Object()
      .Set("layers", Json::Num(d.layers))
      .Set("capacity_blocks", Json::Num(d.capacity_blocks))
      .Set("heads", Json::Num(d.heads))
      .Set("block_tokens", Json::Num(d.block_tokens))
      .Set("channels", Json::Num(d.channels))
      .Set("element_bytes", Json::Num(d.element_bytes));
}

Json GeometryJson(const Geometry& g) {
  return Json::Object()
      .Set("layout", Json::Str(g.layout))
      .Set("dims", DimsJson(g.dims))
      .Set("stride_l", Json::Num(g.stride_l))
      .Set("stride_b", Json::Num(g.stride_b))
      .Set("stride_h", Json::Num(g.stride_h))
      .Set("stride_n", Json::Num(g.stride_n))
      .Set("stride_c", Json::Num(g.stride_c))
      .Set("offset", Json::Num(g.offset))
      .Set("layer_stride", Json::Num(g.layer_stride))
      .Set("block_stride", Json::Num(g.block_stride))
      .Set("segments", Json::Num(g.segments))
      .Set("segment_stride", Json::Num(g.segment_stride))
      .Set("reserved_bytes", Json::Num(g.reserved_bytes))
      .Set("granularity_bytes", Json::Num(g.granularity_bytes));
}

Json ResolutionJson(const LayoutResolution& r) {
  return Json::Object()
      .Set("layout", Json::Str(r.layout))
      .Set("rule", Json::Str(r.rule))
      .Set("rule_detail", Json::Str(r.rule_detail))
      .Set("allowed_layouts", StrArray(r.allowed_layouts))
      .Set("warnings", StrArray(r.warnings));
}

Json ChunkJson(const ChunkInfo& c) {
  return Json::Object()
      .Set("id", Json::Num(c.id))
      .Set("segment", Json::Num(c.segment))
      .Set("offset", Json::Num(c.offset))
      .Set("bytes", Json::Num(c.bytes));
}

Json PoolJson(const PoolInfo& p) {
  return Json::Object()
      .Set("name", Json::Str(p.name))
      .Set("state", Json::Str(PoolStateName(p.state)))
      .Set("geometry", GeometryJson(p.geometry))
      .Set("layout", ResolutionJson(p.layout))
      .Set("committed_blocks", Json::Num(p.committed_blocks))
      .Set("committed_bytes", Json::Num(p.committed_bytes))
      .Set("reserved_bytes", Json::Num(p.reserved_bytes))
      .Set("pending_release_bytes", Json::Num(p.pending_release_bytes))
      .Set("wake_blocks", Json::Num(p.wake_blocks))
      .Set("owner_uid", Json::Num(p.owner_uid))
      .Set("allowed_uids", Json::ArrayOf(p.allowed_uids, [](uint32_t u) { return Json::Num(u); }))
      .Set("clients", Json::ArrayOf(p.clients,
                                    [](const ClientInfo& c) {
                                      return Json::Object()
                                          .Set("client_id", Json::Str(c.client_id))
                                          .Set("name", Json::Str(c.name))
                                          .Set("uid", Json::Num(c.uid))
                                          .Set("pid", Json::Int(c.pid))
                                          .Set("mapped_bytes", Json::Num(c.mapped_bytes))
                                          .Set("attached_at_unix_ms", Json::Num(c.attached_at_unix_ms))
                                          .Set("device_uuid", Json::Str(c.device_uuid));
                                    }))
      .Set("chunks", Json::ArrayOf(p.chunks, ChunkJson))
      .Set("generation", Json::Num(p.generation))
      .Set("created_at_unix_ms", Json::Num(p.created_at_unix_ms))
      .Set("group", p.group.name.empty() ? Json::Null()
                                         : Json::Object()
                                               .Set("name", Json::Str(p.group.name))
                                               .Set("rank", Json::Num(p.group.rank))
                                               .Set("size", Json::Num(p.group.size)))
      .Set("peer_devices", StrArray(p.peer_devices))
      .Set("transaction", Json::Str(p.transaction));
}

Json ChangeJson(const PoolChange& c, double round_trip_ms) {
  return Json::Object()
      .Set("pool", PoolJson(c.pool))
      .Set("added", Json::ArrayOf(c.added, ChunkJson))
      .Set("released_chunk_ids", Json::ArrayOf(c.released_chunk_ids, [](uint64_t id) { return Json::Num(id); }))
      .Set("release_id", Json::Num(c.release_id))
      .Set("elapsed_us", Json::Num(c.elapsed_us))
      .Set("round_trip_ms", Json::Double(round_trip_ms));
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

void Print(const std::string& s) { std::fwrite(s.data(), 1, s.size(), stdout); }

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
};

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

absl::Status Status(Client& client, const Flags& f) {
  KVD_ASSIGN_OR_RETURN(DeviceStatus d, client.DeviceInfo());
  if (f.json) {
    Print(Json::Object()
              .Set("socket", Json::Str(client.socket()))
              .Set("backend", Json::Str(d.backend))
              .Set("device_index", Json::Num(d.device_index))
              .Set("device_name", Json::Str(d.name))
              .Set("device_uuid", Json::Str(d.uuid))
              .Set("driver_version", Json::Str(d.driver_version))
              .Set("daemon_version", Json::Str(d.daemon_version))
              .Set("total_bytes", Json::Num(d.total_bytes))
              .Set("free_bytes", Json::Num(d.free_bytes))
              .Set("committed_bytes", Json::Num(d.committed_bytes))
              .Set("budget_bytes", Json::Num(d.budget_bytes))
              .Set("reserved_bytes", Json::Num(d.reserved_bytes))
              .Set("granularity_bytes", Json::Num(d.granularity_bytes))
              .Set("max_chunk_bytes", Json::Num(d.max_chunk_bytes))
              .Set("pool_count", Json::Num(d.pool_count))
              .Render() +
          "\n");
    return absl::OkStatus();
  }
  std::printf("socket       %s\n", client.socket().c_str());
  std::printf("device       %u: %s (%s backend)\n", d.device_index, d.name.c_str(), d.backend.c_str());
  if (!d.uuid.empty()) std::printf("uuid         %s\n", d.uuid.c_str());
  if (!d.driver_version.empty()) std::printf("driver       %s\n", d.driver_version.c_str());
  std::printf("kvd          %s\n", d.daemon_version.c_str());
  std::printf("memory       %s total, %s free\n", FormatBytes(d.total_bytes).c_str(),
              FormatBytes(d.free_bytes).c_str());
  std::printf("committed    %s of a %s budget\n", FormatBytes(d.committed_bytes).c_str(),
              FormatBytes(d.budget_bytes).c_str());
  std::printf("reserved VA  %s\n", FormatBytes(d.reserved_bytes).c_str());
  std::printf("granularity  %s (chunks up to %s)\n", FormatBytes(d.granularity_bytes).c_str(),
              FormatBytes(d.max_chunk_bytes).c_str());
  std::printf("pools        %u\n", d.pool_count);
  return absl::OkStatus();
}

absl::Status Pools(Client& client, const Flags& f) {
  KVD_ASSIGN_OR_RETURN(std::vector<PoolInfo> pools, client.ListPools());
  if (f.json) {
    Print(Json::Object().Set("pools", Json::ArrayOf(pools, PoolJson)).Render() + "\n");
    return absl::OkStatus();
  }
  std::vector<std::vector<std::string>> rows = {
      {"NAME", "STATE", "LAYOUT", "BLOCKS", "COMMITTED", "PENDING", "CLIENTS"}};
  for (const PoolInfo& p : pools) {
    rows.push_back({p.name, PoolStateName(p.state), p.geometry.layout,
                    absl::StrCat(p.committed_blocks, "/", p.geometry.dims.capacity_blocks),
                    FormatBytes(p.committed_bytes), FormatBytes(p.pending_release_bytes),
                    absl::StrCat(p.clients.size())});
  }
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

absl::Status Describe(Client& client, const Flags& f) {
  KVD_ASSIGN_OR_RETURN(PoolInfo p, client.GetPool(f.pool));
  if (f.json) {
    Print(PoolJson(p).Render() + "\n");
    return absl::OkStatus();
  }
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
  std::printf("\npending      %s\n", FormatBytes(p.pending_release_bytes).c_str());
  std::printf("chunks       %zu\n", p.chunks.size());
  for (const ChunkInfo& c : p.chunks) {
    std::printf("  #%-6lu segment %-4lu offset %-14lu %s\n", c.id, c.segment, c.offset, FormatBytes(c.bytes).c_str());
  }
  std::printf("clients      %zu\n", p.clients.size());
  for (const ClientInfo& c : p.clients) {
    std::printf("  %s %s uid %u pid %d, %s mapped%s\n", c.client_id.c_str(), c.name.c_str(), c.uid, c.pid,
                FormatBytes(c.mapped_bytes).c_str(),
                c.device_uuid.empty() ? "" : absl::StrCat(", from device ", c.device_uuid).c_str());
  }
  return absl::OkStatus();
}

absl::Status Create(Client& client, const Flags& f) {
  KVD_ASSIGN_OR_RETURN(LayoutRequest layout, f.layout.Build());
  PoolOptions options{.name = f.pool, .dims = f.dims, .initial_blocks = f.initial_blocks, .layout = layout};
  options.allowed_uids = f.allowed_uids;
  options.group = f.group;
  options.peer_devices = f.peers;
  Timer t;
  KVD_ASSIGN_OR_RETURN(PoolInfo p, client.CreatePool(options));
  if (f.json) {
    Print(PoolJson(p).Render() + "\n");
    return absl::OkStatus();
  }
  std::printf("created %s: layout %s (rule %s), %lu blocks committed (%s), %s reserved, in %s\n", p.name.c_str(),
              p.geometry.layout.c_str(), p.layout.rule.c_str(), p.committed_blocks,
              FormatBytes(p.committed_bytes).c_str(), FormatBytes(p.reserved_bytes).c_str(), Ms(t.ms()).c_str());
  for (const std::string& w : p.layout.warnings) std::printf("warning: %s\n", w.c_str());
  return absl::OkStatus();
}

absl::Status Resize(Client& client, const Flags& f, bool grow) {
  if (f.bytes.empty() == (f.blocks == 0)) {
    return absl::InvalidArgumentError("give exactly one of --blocks and --bytes");
  }
  KVD_ASSIGN_OR_RETURN(uint64_t target, TargetBlocks(client, f, grow));
  Timer t;
  absl::StatusOr<PoolChange> change = grow ? client.Grow(f.pool, target) : client.Shrink(f.pool, target, f.wait);
  KVD_RETURN_IF_ERROR(change.status());
  const double ms = t.ms();
  if (f.json) {
    Print(ChangeJson(*change, ms).Render() + "\n");
    return absl::OkStatus();
  }
  std::printf("%s %s to %lu blocks (%s) in %s", grow ? "grew" : "shrank", f.pool.c_str(), change->pool.committed_blocks,
              FormatBytes(change->pool.committed_bytes).c_str(), Ms(ms).c_str());
  if (grow) {
    std::printf(", %zu new chunks\n", change->added.size());
  } else {
    std::printf(", %zu chunks released, %s pending release\n", change->released_chunk_ids.size(),
                FormatBytes(change->pool.pending_release_bytes).c_str());
  }
  return absl::OkStatus();
}

absl::Status SleepWake(Client& client, const Flags& f, bool sleep) {
  if (f.pool.empty() == !f.all) return absl::InvalidArgumentError("give exactly one of POOL and --all");
  Timer t;
  absl::StatusOr<std::vector<PoolChange>> changes = sleep ? client.Sleep(f.pool, f.wait) : client.Wake(f.pool);
  KVD_RETURN_IF_ERROR(changes.status());
  const double ms = t.ms();
  if (f.json) {
    Print(Json::Object()
              .Set("updates", Json::ArrayOf(*changes, [ms](const PoolChange& c) { return ChangeJson(c, ms); }))
              .Set("round_trip_ms", Json::Double(ms))
              .Render() +
          "\n");
    return absl::OkStatus();
  }
  if (changes->empty()) std::printf("no pool to %s\n", sleep ? "put to sleep" : "wake");
  for (const PoolChange& c : *changes) {
    if (sleep) {
      std::printf("%s is sleeping: released %zu chunks, wakes to %lu blocks, %s pending release\n", c.pool.name.c_str(),
                  c.released_chunk_ids.size(), c.pool.wake_blocks, FormatBytes(c.pool.pending_release_bytes).c_str());
    } else {
      std::printf("%s is awake: %lu blocks (%s) in %zu chunks\n", c.pool.name.c_str(), c.pool.committed_blocks,
                  FormatBytes(c.pool.committed_bytes).c_str(), c.added.size());
    }
  }
  std::printf("in %s\n", Ms(ms).c_str());
  return absl::OkStatus();
}

absl::Status Delete(Client& client, const Flags& f) {
  KVD_ASSIGN_OR_RETURN(uint64_t released, client.DeletePool(f.pool, f.force));
  if (f.json) {
    Print(Json::Object().Set("pool", Json::Str(f.pool)).Set("released_bytes", Json::Num(released)).Render() + "\n");
    return absl::OkStatus();
  }
  std::printf("deleted %s, released %s\n", f.pool.c_str(), FormatBytes(released).c_str());
  return absl::OkStatus();
}

absl::Status Resolve(Client& client, const Flags& f) {
  KVD_ASSIGN_OR_RETURN(LayoutRequest layout, f.layout.Build());
  const PoolDims& d = f.dims;
  const bool any_dim = d.layers || d.capacity_blocks || d.heads || d.block_tokens || d.channels || d.element_bytes;
  KVD_ASSIGN_OR_RETURN(ResolvedLayout r, client.ResolveLayout(layout, any_dim ? &d : nullptr));
  if (f.json) {
    Json out = Json::Object().Set("resolution", ResolutionJson(r.resolution));
    out.Set("geometry", r.has_geometry ? GeometryJson(r.geometry) : Json::Null());
    Print(out.Render() + "\n");
    return absl::OkStatus();
  }
  PrintResolution(r.resolution);
  if (r.has_geometry) PrintGeometry(r.geometry);
  return absl::OkStatus();
}

absl::Status Grant(Client& client, const Flags& f, bool revoke) {
  KVD_ASSIGN_OR_RETURN(PoolInfo p, client.GrantPeerAccess(f.pool, f.device_uuid, revoke));
  if (f.json) {
    Print(PoolJson(p).Render() + "\n");
    return absl::OkStatus();
  }
  std::printf("%s %s %s %s; peer devices now: %s\n", revoke ? "revoked" : "granted", f.device_uuid.c_str(),
              revoke ? "from" : "on", p.name.c_str(),
              p.peer_devices.empty() ? "none" : absl::StrJoin(p.peer_devices, ", ").c_str());
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// kvctl group: one engine's ranks on several daemons, as one unit.

absl::StatusOr<std::unique_ptr<Group>> OpenGroup(const Flags& f) {
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
  return Group::Open(f.pool, sockets, {.connect = {.client_name = "kvctl"}, .ttl = ttl});
}

Json RankJson(const GroupRank& r) {
  return Json::Object()
      .Set("rank", Json::Num(r.rank))
      .Set("socket", Json::Str(r.socket))
      .Set("device_uuid", Json::Str(r.device_uuid))
      .Set("pool", PoolJson(r.pool));
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
    std::printf("  rank %-3u %-20s %-9s %8lu blocks %10s  %zu clients  %s (%s)%s\n", r.rank, r.pool.name.c_str(),
                PoolStateName(r.pool.state), r.pool.committed_blocks, FormatBytes(r.pool.committed_bytes).c_str(),
                r.pool.clients.size(), r.socket.c_str(), r.device_uuid.c_str(),
                r.pool.transaction.empty() ? "" : absl::StrCat(" held by ", r.pool.transaction).c_str());
  }
}

absl::Status GroupStatus(Group& group, const Flags& f) {
  KVD_ASSIGN_OR_RETURN(std::vector<GroupRank> ranks, group.Refresh());
  const bool consistent = Consistent(ranks);
  if (f.json) {
    Print(Json::Object()
              .Set("group", Json::Str(group.name()))
              .Set("size", Json::Num(ranks.size()))
              .Set("consistent", Json::Bool(consistent))
              .Set("ranks", Json::ArrayOf(ranks, RankJson))
              .Render() +
          "\n");
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

absl::Status GroupChangeVerb(Group& group, const Flags& f, GroupOp op) {
  uint64_t target = f.blocks;
  if ((op == GroupOp::kGrow || op == GroupOp::kShrink) && !f.bytes.empty()) {
    KVD_ASSIGN_OR_RETURN(uint64_t bytes, ParseBytes(f.bytes, "--bytes"));
    const uint64_t per_block = group.ranks().front().pool.geometry.block_bytes();
    if (per_block == 0) return absl::InternalError("rank 0's geometry has zero-sized blocks");
    target = op == GroupOp::kGrow ? (bytes + per_block - 1) / per_block : bytes / per_block;
  }
  Timer t;
  absl::StatusOr<GroupChange> change;
  switch (op) {
    case GroupOp::kGrow:
      change = group.Grow(target);
      break;
    case GroupOp::kShrink:
      change = group.Shrink(target, f.wait);
      break;
    case GroupOp::kSleep:
      change = group.Sleep(f.wait);
      break;
    case GroupOp::kWake:
      change = group.Wake();
      break;
  }
  KVD_RETURN_IF_ERROR(change.status());
  const double ms = t.ms();
  const std::vector<GroupRank> ranks = group.ranks();
  if (f.json) {
    Print(Json::Object()
              .Set("group", Json::Str(group.name()))
              .Set("operation", Json::Str(GroupOpName(op)))
              .Set("ranks", Json::ArrayOf(change->ranks, [ms](const PoolChange& c) { return ChangeJson(c, ms); }))
              .Set("prepared_bytes", Json::Num(change->prepared_bytes))
              .Set("prepare_us", Json::Num(change->prepare_us))
              .Set("commit_us", Json::Num(change->commit_us))
              .Set("round_trip_ms", Json::Double(ms))
              .Render() +
          "\n");
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
  app.add_flag("--json", f.json, "Machine-readable JSON output (see docs/integrating.md)");
  app.fallthrough();

  CLI::App* status = app.add_subcommand("status", "The device, its memory and the daemon's totals");
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

  CLI::App* grow = app.add_subcommand("grow", "Grow a pool to --blocks or --bytes (rounded up to whole blocks)");
  CLI::App* shrink = app.add_subcommand("shrink", "Shrink a pool to --blocks or --bytes (rounded down)");
  for (CLI::App* sub : {grow, shrink}) {
    sub->add_option("pool", f.pool, "Pool name")->required();
    CLI::Option* b = sub->add_option("--blocks", f.blocks, "Target committed blocks");
    CLI::Option* s = sub->add_option("--bytes", f.bytes, "Target committed size (e.g. 100GiB)");
    b->excludes(s);
  }
  shrink->add_flag("--wait", f.wait, "Return once every attached client unmapped the released chunks");

  CLI::App* sleep = app.add_subcommand("sleep", "Release a pool's (or every pool's) memory, keeping its VA");
  CLI::App* wake = app.add_subcommand("wake", "Recommit a sleeping pool (or every sleeping pool)");
  for (CLI::App* sub : {sleep, wake}) {
    sub->add_option("pool", f.pool, "Pool name");
    sub->add_flag("--all", f.all, "Every pool");
  }
  sleep->add_flag("--wait", f.wait, "Return once every attached client unmapped the released chunks");

  CLI::App* del = app.add_subcommand("delete", "Delete a pool");
  del->add_option("pool", f.pool, "Pool name")->required();
  del->add_flag("--force", f.force, "Delete even with clients attached");

  CLI::App* grant = app.add_subcommand("grant", "Let clients on another device of the node attach a pool");
  CLI::App* revoke = app.add_subcommand("revoke", "Take a peer-access grant back (attached clients keep theirs)");
  for (CLI::App* sub : {grant, revoke}) {
    sub->add_option("pool", f.pool, "Pool name")->required();
    sub->add_option("device", f.device_uuid, "Device UUID as `kvctl status` of that device's kvd shows it, or '*'")
        ->required();
  }

  CLI::App* group = app.add_subcommand("group", "One engine's pools on several daemons (its tensor-parallel ranks)");
  group->require_subcommand(1);
  CLI::App* group_status = group->add_subcommand("status", "Every rank of a group and whether they agree");
  CLI::App* group_grow = group->add_subcommand("grow", "Grow every rank to --blocks or --bytes, or none of them");
  CLI::App* group_shrink = group->add_subcommand("shrink", "Shrink every rank to --blocks or --bytes, or none");
  CLI::App* group_sleep = group->add_subcommand("sleep", "Put every rank to sleep, or none");
  CLI::App* group_wake = group->add_subcommand("wake", "Wake every rank, or none");
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
  if ((grow->parsed() || shrink->parsed() || group_grow->parsed() || group_shrink->parsed()) &&
      f.bytes.empty() == (f.blocks == 0)) {
    return Fail("give exactly one of --blocks and --bytes", 2);
  }
  if ((sleep->parsed() || wake->parsed()) && f.pool.empty() == !f.all) {
    return Fail("give exactly one of POOL and --all", 2);
  }

  if (group->parsed()) {
    absl::StatusOr<std::unique_ptr<Group>> g = OpenGroup(f);
    if (!g.ok()) return Fail(g.status().ToString(), 1);
    absl::Status s;
    if (group_status->parsed()) {
      s = GroupStatus(**g, f);
    } else if (group_grow->parsed()) {
      s = GroupChangeVerb(**g, f, GroupOp::kGrow);
    } else if (group_shrink->parsed()) {
      s = GroupChangeVerb(**g, f, GroupOp::kShrink);
    } else if (group_sleep->parsed()) {
      s = GroupChangeVerb(**g, f, GroupOp::kSleep);
    } else {
      s = GroupChangeVerb(**g, f, GroupOp::kWake);
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
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect({.socket = socket, .device = device_index, .client_name = "kvctl"});
  if (!client.ok()) return Fail(client.status().ToString(), 1);
  Client& c = **client;
  absl::Status s;
  if (status->parsed()) {
    s = Status(c, f);
  } else if (pools->parsed()) {
    s = Pools(c, f);
  } else if (describe->parsed()) {
    s = Describe(c, f);
  } else if (create->parsed()) {
    s = Create(c, f);
  } else if (grow->parsed() || shrink->parsed()) {
    s = Resize(c, f, grow->parsed());
  } else if (sleep->parsed() || wake->parsed()) {
    s = SleepWake(c, f, sleep->parsed());
  } else if (del->parsed()) {
    s = Delete(c, f);
  } else if (resolve->parsed()) {
    s = Resolve(c, f);
  } else if (grant->parsed() || revoke->parsed()) {
    s = Grant(c, f, revoke->parsed());
  }
  if (!s.ok()) return Fail(s.ToString(), 1);
  std::fflush(stdout);
  return 0;
}

}  // namespace
}  // namespace kvd

int main(int argc, char** argv) { return kvd::Main(argc, argv); }
