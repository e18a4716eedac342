// kvd: the per-device KV-cache memory daemon (docs/architecture.md, docs/api.md, docs/operations.md). Flags ->
// configuration -> device -> PoolManager -> gRPC server and handle channel -> wait for SIGTERM/SIGINT -> orderly stop.
//
// Start-up refuses, with a one-line reason and a non-zero exit, anything it cannot serve correctly:
// bad flags, an invalid KVD_KV_CACHE_LAYOUT, no device, a live daemon on the socket, a socket path that
// is not a socket. A stale socket file (nobody accepts on it) is removed and replaced.
//
// Signals are blocked in every thread from the first line of main() and taken synchronously with
// sigwaitinfo() on the main thread, so no code runs in an asynchronous signal handler.
#include <errno.h>
#include <grpc/support/log.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <malloc.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/cleanup/cleanup.h"
#include "absl/debugging/failure_signal_handler.h"
#include "absl/debugging/symbolize.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/core/layout.h"
#include "daemon/core/layout_chain.h"
#include "daemon/core/limits.h"
#include "daemon/core/memory_state_store.h"
#include "daemon/core/pool_manager.h"
#include "daemon/metrics/metrics.h"
#include "daemon/rpc/async_stream.h"
#include "daemon/rpc/control_socket.h"
#include "daemon/rpc/handle_channel.h"
#include "daemon/rpc/health_service.h"
#include "daemon/rpc/manager_backend.h"
#include "daemon/rpc/service.h"
#include "daemon/state/state_store.h"
#include "google/protobuf/stubs/logging.h"
#include "kvd/device.h"
#include "kvd/status.h"
#include "kvd/units.h"
#include "kvd/v1/kvd.grpc.pb.h"
#include "kvd/wire.h"
#include "spdlog/pattern_formatter.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

#ifndef KVD_VERSION
#define KVD_VERSION "unknown"
#endif

namespace kvd::daemon {
namespace {

using wire::kLayoutEnv;

// The thread that answers the quick RPCs and runs the streams (Note [No callback API] in
// docs/architecture.md), whatever the machine's CPUs.
constexpr int kCompletionThreads = 1;

// The health service's name for the saved state (docs/operations.md, "When saving the state fails").
constexpr char kStateHealthService[] = "kvd.state";

struct Flags {
  std::string backend = "auto";
  std::string device = "0";  // an index or a UUID (prefix): ResolveDeviceSelector
  std::string socket;        // default <socket_dir>/gpu<N>.sock, or <socket_dir>/<UUID>.sock with socket_name "uuid"
  std::string socket_dir;    // default $NVIDIA_DRA_LOCAL_IPC_DIR, else /run/kvd
  std::string socket_name = "index";
  std::string metrics_address;
  bool metrics_clients = false;
  std::string budget = "90%";
  std::string host_capacity;  // default: physical memory
  std::string host_used_by_others = "0";
  std::string host_granularity = "2MiB";
  std::string max_chunk = "4GiB";
  std::string host_tier = "0";
  uint32_t host_tier_copy_threads = 4;
  std::string lease_ttl = "30s";
  std::string layout_override;
  std::string log_format = "text";
  std::string log_level = "info";
  std::string state_dir = "auto";  // auto: beside the socket, <socket without .sock>.state
  std::string fdstore = "auto";
  uint64_t fdstore_max = 16384;
  std::string recovery_grace = "60s";
  std::string pause_timeout = "5s";
  uint64_t compact_above_chunks = 0;
  uint32_t compact_chunks_per_pause = 512;
  bool drain_on_stop = false;
  std::string max_metadata = "1MiB";
  // Limits (docs/operations.md, "Limits"; daemon/core/limits.h).
  uint64_t max_pools = 1024;
  uint64_t max_pools_per_uid = 256;
  uint64_t max_sessions = 768;
  uint64_t max_sessions_per_uid = 128;
  std::string max_reserved = "96TiB";
  std::string max_reserved_per_uid = "64TiB";
  uint64_t max_clients_per_pool = 256;
  uint64_t max_handle_connections = 1024;
  uint64_t max_handle_connections_per_uid = 256;
  uint64_t max_control_connections = 1024;
  uint64_t max_control_connections_per_uid = 256;
  uint64_t max_block_ids = 65536;
  std::string max_request_bytes = "4MiB";
  std::string operator_reserve = "5%";
  // Arbitration (docs/operations.md, "Several engines on one GPU"; daemon/core/arbiter.h).
  std::string device_headroom = "1%";
  std::string reclaim_timeout = "5s";
  uint32_t max_priority_per_uid = 0;
  std::string max_guaranteed_per_uid = "0";
  std::vector<std::string> uid_claims;  // UID:priority=P,guaranteed=SIZE
  bool list_devices = false;
  bool json = false;
};

std::string_view Sv(absl::string_view s) { return {s.data(), s.size()}; }

// ---------------------------------------------------------------------------------------------
// Logging

// The message as the inside of a JSON string (quotes, backslashes and control characters escaped).
class JsonMessageFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&, spdlog::memory_buf_t& dest) override {
    static constexpr char kHex[] = "0123456789abcdef";
    for (char c : std::string_view(msg.payload.data(), msg.payload.size())) {
      switch (c) {
        case '"':
          dest.append(std::string_view("\\\""));
          break;
        case '\\':
          dest.append(std::string_view("\\\\"));
          break;
        case '\n':
          dest.append(std::string_view("\\n"));
          break;
        case '\r':
          dest.append(std::string_view("\\r"));
          break;
        case '\t':
          dest.append(std::string_view("\\t"));
          break;
        default:
          if (static_cast<unsigned char>(c) < 0x20) {
            const char esc[] = {'\\', 'u', '0', '0', kHex[(c >> 4) & 0xf], kHex[c & 0xf]};
            dest.append(std::string_view(esc, sizeof(esc)));
          } else {
            dest.push_back(c);
          }
      }
    }
  }
  std::unique_ptr<custom_flag_formatter> clone() const override { return std::make_unique<JsonMessageFlag>(); }
};

// gRPC's own log lines join kvd's, in kvd's format. Their messages may quote what a peer sent (garbage
// on the control socket is echoed by the HTTP/2 parser), so they are C-escaped: one line, no raw bytes.
void GrpcLog(gpr_log_func_args* args) {
  const spdlog::level::level_enum level = args->severity == GPR_LOG_SEVERITY_ERROR  ? spdlog::level::err
                                          : args->severity == GPR_LOG_SEVERITY_INFO ? spdlog::level::info
                                                                                    : spdlog::level::debug;
  const std::string message = absl::CEscape(args->message == nullptr ? "" : args->message);
  spdlog::log(level, "grpc: {} ({}:{})", message, args->file, args->line);
}

// Protobuf's own log lines (a request with a string field that is not UTF-8, say) join kvd's, escaped.
void ProtobufLog(google::protobuf::LogLevel level, const char* filename, int line, const std::string& message) {
  const spdlog::level::level_enum to = level >= google::protobuf::LOGLEVEL_ERROR     ? spdlog::level::err
                                       : level == google::protobuf::LOGLEVEL_WARNING ? spdlog::level::warn
                                                                                     : spdlog::level::info;
  spdlog::log(to, "protobuf: {} ({}:{})", absl::CEscape(message), filename, line);
}

absl::Status SetUpLogging(const Flags& f) {
  auto logger = spdlog::stderr_color_mt("kvd");
  if (f.log_format == "json") {
    auto formatter = std::make_unique<spdlog::pattern_formatter>();
    formatter->add_flag<JsonMessageFlag>('*').set_pattern(
        R"({"time":"%Y-%m-%dT%H:%M:%S.%f%z","level":"%l","pid":%P,"thread":%t,"msg":"%*"})");
    logger->set_formatter(std::move(formatter));
  } else {
    logger->set_pattern("%Y-%m-%d %H:%M:%S.%e %^%l%$ %v");
  }
  const spdlog::level::level_enum level = spdlog::level::from_str(f.log_level);
  logger->set_level(level);
  spdlog::set_default_logger(std::move(logger));
  gpr_set_log_function(GrpcLog);
  google::protobuf::SetLogHandler(ProtobufLog);
  gpr_set_log_verbosity(level <= spdlog::level::debug ? GPR_LOG_SEVERITY_DEBUG : GPR_LOG_SEVERITY_ERROR);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Configuration

absl::StatusOr<uint64_t> ParseSize(const std::string& text, absl::string_view flag) { return ParseBytes(text, flag); }

// "100GiB" or "90%" of `total`; a percentage is rounded down to the granularity.
absl::StatusOr<uint64_t> ParseBudget(const std::string& text, uint64_t total, uint64_t granularity) {
  absl::string_view t = absl::StripAsciiWhitespace(text);
  uint64_t budget = 0;
  if (absl::ConsumeSuffix(&t, "%")) {
    double pct = 0;
    if (!absl::SimpleAtod(t, &pct) || !(pct > 0 && pct <= 100)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--budget: \"", text, "\" is not a percentage in (0, 100] (e.g. 90%) or a size (e.g. 100GiB)"));
    }
    budget = static_cast<uint64_t>(static_cast<long double>(total) * pct / 100.0L);
    if (granularity > 0) budget -= budget % granularity;
  } else {
    KVD_ASSIGN_OR_RETURN(budget, ParseBytes(t, "--budget"));
  }
  if (budget == 0)
    return absl::InvalidArgumentError(absl::StrCat("--budget: \"", text, "\" leaves no memory to commit"));
  if (budget > total) {
    return absl::InvalidArgumentError(
        absl::StrCat("--budget: ", FormatBytes(budget), " exceeds the device's ", FormatBytes(total), " of memory"));
  }
  return budget;
}

// "256MiB" or "2%" of `total` (rounded down to the granularity): device memory no grow may take.
absl::StatusOr<uint64_t> ParseHeadroom(const std::string& text, uint64_t total, uint64_t granularity) {
  absl::string_view t = absl::StripAsciiWhitespace(text);
  if (absl::ConsumeSuffix(&t, "%")) {
    double pct = 0;
    if (!absl::SimpleAtod(t, &pct) || !(pct >= 0 && pct < 100)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--device-headroom: \"", text, "\" is not a percentage in [0, 100) (e.g. 2%) or a size (256MiB)"));
    }
    const uint64_t bytes = static_cast<uint64_t>(static_cast<long double>(total) * pct / 100.0L);
    return granularity > 0 ? bytes - bytes % granularity : bytes;
  }
  KVD_ASSIGN_OR_RETURN(uint64_t bytes, ParseBytes(t, "--device-headroom"));
  if (bytes >= total) {
    return absl::InvalidArgumentError(absl::StrCat("--device-headroom: ", FormatBytes(bytes),
                                                   " leaves nothing of the device's ", FormatBytes(total)));
  }
  return bytes;
}

// One --uid-claim: "UID:priority=P,guaranteed=SIZE" (either part may be left out: 0).
absl::Status ParseUidClaim(const std::string& text, Limits* limits) {
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("--uid-claim: \"", text, "\": ", why, " (expected UID:priority=P,guaranteed=SIZE)"));
  };
  const size_t colon = text.find(':');
  uint32_t uid = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(text.substr(0, colon), &uid)) return bad("no UID");
  if (limits->claim_of.contains(uid)) return bad(absl::StrCat("uid ", uid, " has a --uid-claim already"));
  ClaimGrant grant;
  for (absl::string_view part : absl::StrSplit(text.substr(colon + 1), ',', absl::SkipEmpty())) {
    if (absl::ConsumePrefix(&part, "priority=")) {
      if (!absl::SimpleAtoi(part, &grant.max_priority) || grant.max_priority > kMaxPriority) {
        return bad(absl::StrCat("priority is not 0..", kMaxPriority));
      }
    } else if (absl::ConsumePrefix(&part, "guaranteed=")) {
      absl::StatusOr<uint64_t> bytes = ParseBytes(part, "guaranteed");
      if (!bytes.ok()) return bad(bytes.status().message());
      grant.guaranteed_bytes = *bytes;
    } else {
      return bad(absl::StrCat("unknown part \"", part, "\""));
    }
  }
  limits->claim_of[uid] = grant;
  return absl::OkStatus();
}

// The limits the flags set, checked: every one > 0, and each total leaving ordinary uids a share.
absl::StatusOr<Limits> MakeLimits(const Flags& f, uint32_t daemon_uid) {
  Limits limits{.max_pools = f.max_pools,
                .max_pools_per_uid = f.max_pools_per_uid,
                .max_sessions = f.max_sessions,
                .max_sessions_per_uid = f.max_sessions_per_uid,
                .max_clients_per_pool = f.max_clients_per_pool,
                .max_block_ids = f.max_block_ids,
                .daemon_uid = daemon_uid};
  KVD_ASSIGN_OR_RETURN(limits.max_reserved_bytes, ParseBytes(f.max_reserved, "--max-reserved"));
  KVD_ASSIGN_OR_RETURN(limits.max_reserved_bytes_per_uid, ParseBytes(f.max_reserved_per_uid, "--max-reserved-per-uid"));
  absl::string_view pct = absl::StripAsciiWhitespace(f.operator_reserve);
  absl::ConsumeSuffix(&pct, "%");
  if (!absl::SimpleAtoi(pct, &limits.operator_reserve_percent) || limits.operator_reserve_percent > 50) {
    return absl::InvalidArgumentError(
        absl::StrCat("--operator-reserve: \"", f.operator_reserve, "\" is not a percentage from 0% to 50%"));
  }
  const std::pair<const char*, uint64_t> totals[] = {{"--max-pools", limits.max_pools},
                                                     {"--max-sessions", limits.max_sessions},
                                                     {"--max-reserved", limits.max_reserved_bytes},
                                                     {"--max-clients-per-pool", limits.max_clients_per_pool},
                                                     {"--max-handle-connections", f.max_handle_connections},
                                                     {"--max-control-connections", f.max_control_connections}};
  for (const auto& [flag, total] : totals) {
    if (total == 0) return absl::InvalidArgumentError(absl::StrCat(flag, ": must be > 0"));
    if (total == OperatorShare(total, limits.operator_reserve_percent)) {
      return absl::InvalidArgumentError(absl::StrCat(
          flag, "=", total,
          " leaves nothing for ordinary uids after --operator-reserve=", limits.operator_reserve_percent, "%"));
    }
  }
  const std::pair<const char*, uint64_t> others[] = {
      {"--max-pools-per-uid", limits.max_pools_per_uid},
      {"--max-sessions-per-uid", limits.max_sessions_per_uid},
      {"--max-reserved-per-uid", limits.max_reserved_bytes_per_uid},
      {"--max-handle-connections-per-uid", f.max_handle_connections_per_uid},
      {"--max-control-connections-per-uid", f.max_control_connections_per_uid},
      {"--max-block-ids", limits.max_block_ids}};
  for (const auto& [flag, value] : others) {
    if (value == 0) return absl::InvalidArgumentError(absl::StrCat(flag, ": must be > 0"));
  }
  if (f.max_priority_per_uid > kMaxPriority) {
    return absl::InvalidArgumentError(absl::StrCat("--max-priority-per-uid: ", f.max_priority_per_uid,
                                                   " is past the highest priority, ", kMaxPriority));
  }
  limits.claim_per_uid.max_priority = f.max_priority_per_uid;
  KVD_ASSIGN_OR_RETURN(limits.claim_per_uid.guaranteed_bytes,
                       ParseBytes(f.max_guaranteed_per_uid, "--max-guaranteed-per-uid"));
  for (const std::string& claim : f.uid_claims) KVD_RETURN_IF_ERROR(ParseUidClaim(claim, &limits));
  return limits;
}

// Every limit flag and its value, for kvd_limit (docs/metrics.md).
std::vector<LimitValue> LimitValues(const Flags& f, const Limits& limits, uint64_t max_request_bytes) {
  return {{"max-pools", limits.max_pools},
          {"max-pools-per-uid", limits.max_pools_per_uid},
          {"max-sessions", limits.max_sessions},
          {"max-sessions-per-uid", limits.max_sessions_per_uid},
          {"max-reserved", limits.max_reserved_bytes},
          {"max-reserved-per-uid", limits.max_reserved_bytes_per_uid},
          {"max-clients-per-pool", limits.max_clients_per_pool},
          {"max-handle-connections", f.max_handle_connections},
          {"max-handle-connections-per-uid", f.max_handle_connections_per_uid},
          {"max-control-connections", f.max_control_connections},
          {"max-control-connections-per-uid", f.max_control_connections_per_uid},
          {"max-block-ids", limits.max_block_ids},
          {"max-request-bytes", max_request_bytes},
          {"max-priority-per-uid", limits.claim_per_uid.max_priority},
          {"max-guaranteed-per-uid", limits.claim_per_uid.guaranteed_bytes},
          {"operator-reserve", limits.operator_reserve_percent}};
}

absl::StatusOr<LayoutPolicy> MakeLayoutPolicy(const Flags& f) {
  LayoutPolicy policy;
  if (!f.layout_override.empty()) {
    KVD_ASSIGN_OR_RETURN(policy.operator_override, Layout::Parse(f.layout_override, "--layout-override"));
  }
  const char* env = std::getenv(kLayoutEnv);
  if (env != nullptr && *env != '\0') {
    KVD_ASSIGN_OR_RETURN(policy.daemon_env, Layout::Parse(env, kLayoutEnv));
  }
  return policy;
}

// The backend --backend asks for; with auto, CUDA when a driver and a device answer, else host. `why`
// says which and why.
absl::StatusOr<std::unique_ptr<Device>> OpenBackend(const Flags& f, DeviceOptions options, std::string* why) {
  if (f.backend != "auto") {
    options.backend = f.backend;
    *why = absl::StrCat("--backend=", f.backend);
    return OpenDevice(options);
  }
  options.backend = "cuda";
  absl::StatusOr<std::unique_ptr<Device>> cuda = OpenDevice(options);
  if (cuda.ok()) {
    *why = "auto: a CUDA driver and device are present";
    return cuda;
  }
  if (!absl::IsUnavailable(cuda.status()) && !absl::IsUnimplemented(cuda.status())) return cuda.status();
  *why = absl::StrCat("auto: no CUDA (", cuda.status().message(), "), using host memory");
  options.backend = "host";
  return OpenDevice(options);
}

// The index --device names for --backend, and how it named it ("index", "UUID", "UUID prefix").
// Errors name the flag: "--device 3: this node has 1 CUDA device (0 GPU-…)".
absl::StatusOr<int> ResolveDevice(const Flags& f, const DeviceOptions& options, std::string* how) {
  DeviceOptions resolve = options;
  resolve.backend = f.backend;
  absl::StatusOr<int> index = ResolveDeviceSelector(resolve, f.device);
  // ResolveDeviceSelector's own messages start "device <selector>: "; the backend's errors (no driver,
  // a bad --host-granularity) say what they are about and pass unchanged.
  if (!index.ok() && absl::StartsWith(index.status().message(), "device ")) {
    return absl::Status(index.status().code(), absl::StrCat("--", index.status().message()));
  }
  *how = std::all_of(f.device.begin(), f.device.end(), absl::ascii_isdigit) ? "index" : "UUID";
  return index;
}

// Flag values that only matter for the host backend, into `options`.
absl::Status ParseHostOptions(const Flags& f, DeviceOptions* options) {
  if (!f.host_capacity.empty()) {
    KVD_ASSIGN_OR_RETURN(options->host_capacity, ParseSize(f.host_capacity, "--host-capacity"));
  }
  KVD_ASSIGN_OR_RETURN(options->host_granularity, ParseSize(f.host_granularity, "--host-granularity"));
  KVD_ASSIGN_OR_RETURN(options->host_used_by_others, ParseSize(f.host_used_by_others, "--host-used-by-others"));
  return absl::OkStatus();
}

// `text` as a JSON string literal.
std::string JsonString(absl::string_view text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(c);
    } else if (static_cast<unsigned char>(c) < 0x20) {
      absl::StrAppend(&out, absl::StrFormat("\\u%04x", c));
    } else {
      out.push_back(c);
    }
  }
  return out + "\"";
}

// --list-devices: every device of --backend this process sees, as a table (or JSON with --json).
absl::Status PrintDevices(const Flags& f) {
  DeviceOptions options{.backend = f.backend};
  KVD_RETURN_IF_ERROR(ParseHostOptions(f, &options));
  KVD_ASSIGN_OR_RETURN(std::vector<DeviceInfo> devices, ListDevices(options));
  if (f.json) {
    const char* backend = devices.empty() ? f.backend.c_str() : BackendName(devices.front().backend);
    std::string out = absl::StrCat("{\"backend\":", JsonString(backend), ",\"devices\":[");
    for (size_t i = 0; i < devices.size(); ++i) {
      const DeviceInfo& d = devices[i];
      absl::StrAppend(&out, i == 0 ? "" : ",", "{\"index\":", d.index, ",\"uuid\":", JsonString(d.uuid),
                      ",\"name\":", JsonString(d.name), ",\"total_bytes\":", d.total_bytes, "}");
    }
    std::cout << out << "]}\n";
    return absl::OkStatus();
  }
  int uuid_width = 4;
  for (const DeviceInfo& d : devices) uuid_width = std::max(uuid_width, static_cast<int>(d.uuid.size()));
  const auto row = [&](absl::string_view index, absl::string_view uuid, absl::string_view memory,
                       absl::string_view name, absl::string_view kind) {
    std::cout << absl::StrFormat("%-5s  %-7s  %-*s  %10s  %s\n", index, kind, uuid_width, uuid, memory, name);
  };
  row("INDEX", "UUID", "MEMORY", "NAME", "BACKEND");
  for (const DeviceInfo& d : devices) {
    row(absl::StrCat(d.index), d.uuid, FormatBytes(d.total_bytes), d.name, BackendName(d.backend));
  }
  if (!devices.empty() && devices.front().backend == BackendKind::kHost) {
    const std::string& uuid = devices.front().uuid;  // host-<boot id>-0
    std::cout << "(the host backend opens any --device index N, as device " << uuid.substr(0, uuid.rfind('-'))
              << "-N: a stand-in for one GPU)\n";
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Sockets

// Creates the socket directory (and its parents) 0750 if missing; warns when it is looser.
absl::Status PrepareSocketDirectory(const std::string& socket) {
  const size_t slash = socket.find_last_of('/');
  if (slash == std::string::npos || slash == 0) return absl::OkStatus();
  const std::string dir = socket.substr(0, slash);
  struct stat st {};
  if (stat(dir.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode)) return absl::FailedPreconditionError(absl::StrCat(dir, ": not a directory"));
    if ((st.st_mode & 0027) != 0) {
      spdlog::warn(
          "socket directory {} is mode {:04o}, looser than 0750; who may connect is decided by it and the "
          "sockets' 0660",
          dir, st.st_mode & 07777);
    }
    return absl::OkStatus();
  }
  for (size_t pos = 1; pos != std::string::npos;) {
    pos = dir.find('/', pos + 1);
    const std::string prefix = dir.substr(0, pos);
    if (mkdir(prefix.c_str(), 0750) != 0 && errno != EEXIST) {
      return ErrnoStatus(errno, absl::StrCat("creating socket directory ", prefix));
    }
  }
  if (chmod(dir.c_str(), 0750) != 0) return ErrnoStatus(errno, absl::StrCat("chmod 0750 ", dir));
  spdlog::info("created socket directory {} (0750)", dir);
  return absl::OkStatus();
}

// Makes `path` free for a new listener: nothing there, or a stale socket (removed). ALREADY_EXISTS
// when a live daemon accepts connections on it; FAILED_PRECONDITION when it is not a socket.
absl::Status ClaimSocketPath(const std::string& path, int type) {
  struct stat st {};
  if (lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return ErrnoStatus(errno, path);
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(path, " exists and is not a socket; refusing to replace it"));
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": longer than ", sizeof(addr.sun_path) - 1, " bytes"));
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus(errno, "socket");
  const int rc = connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  const int err = errno;
  close(fd);
  if (rc == 0) return absl::AlreadyExistsError(absl::StrCat("another kvd is serving ", path));
  if (err != ECONNREFUSED) return ErrnoStatus(err, absl::StrCat("probing ", path));
  if (unlink(path.c_str()) != 0 && errno != ENOENT) return ErrnoStatus(errno, absl::StrCat("removing stale ", path));
  spdlog::info("removed stale socket {} (nobody accepted on it)", path);
  return absl::OkStatus();
}

struct SocketId {
  dev_t dev = 0;
  ino_t ino = 0;
};

std::optional<SocketId> IdOf(const std::string& path) {
  struct stat st {};
  if (lstat(path.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode)) return std::nullopt;
  return SocketId{st.st_dev, st.st_ino};
}

// The gRPC socket when --socket is not given: in --socket-dir, else the DRA claim's IPC directory
// ($NVIDIA_DRA_LOCAL_IPC_DIR), else /run/kvd; named gpu<index>.sock, or <device UUID>.sock with --socket-name=uuid
// (docs/operations.md, "Pods without hostIPC").
std::string DefaultSocketPath(const Flags& f, int index, absl::string_view uuid) {
  const std::string dir = f.socket_dir.empty() ? wire::DefaultSocketDirFromEnvironment() : f.socket_dir;
  if (f.socket_name == "uuid") return absl::StrCat(dir, "/", uuid, wire::kSocketSuffix);
  return wire::DefaultSocket(index, dir);
}

// Removes `path` if it is still the socket this daemon bound.
void RemoveSocket(const std::string& path, const std::optional<SocketId>& ours) {
  const std::optional<SocketId> now = IdOf(path);
  if (!now.has_value() || !ours.has_value() || now->dev != ours->dev || now->ino != ours->ino) return;
  if (unlink(path.c_str()) != 0 && errno != ENOENT) spdlog::warn("removing {}: {}", path, std::strerror(errno));
}

// ---------------------------------------------------------------------------------------------
// Run

absl::Status Run(const Flags& f) {
  // Every start-up step that can fail does so before anything listens.
  KVD_ASSIGN_OR_RETURN(LayoutPolicy layout_policy, MakeLayoutPolicy(f));
  DeviceOptions device_options;
  KVD_RETURN_IF_ERROR(ParseHostOptions(f, &device_options));
  std::string selected_by;
  KVD_ASSIGN_OR_RETURN(device_options.index, ResolveDevice(f, device_options, &selected_by));
  if (!f.socket.empty() && (!f.socket_dir.empty() || f.socket_name != "index")) {
    return absl::InvalidArgumentError(
        "--socket names the socket's path: --socket-dir and --socket-name apply without it");
  }
  // Named by UUID, the sockets are known once the device is open (below).
  std::string socket_path = !f.socket.empty()         ? f.socket
                            : f.socket_name == "uuid" ? ""
                                                      : DefaultSocketPath(f, device_options.index, "");
  if (!socket_path.empty()) {
    spdlog::info("--device={} selects device #{} (by {}); sockets {} and {}", f.device, device_options.index,
                 selected_by, socket_path, wire::HandlesPathFor(socket_path));
  }
  KVD_ASSIGN_OR_RETURN(uint64_t max_chunk, ParseSize(f.max_chunk, "--max-chunk"));
  KVD_ASSIGN_OR_RETURN(uint64_t host_tier_bytes, ParseSize(f.host_tier, "--host-tier-bytes"));
  absl::Duration lease_ttl;
  if (!absl::ParseDuration(f.lease_ttl, &lease_ttl) || lease_ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("--lease-ttl: \"", f.lease_ttl, "\" is not a positive duration"));
  }

  KVD_ASSIGN_OR_RETURN(const Limits limits, MakeLimits(f, static_cast<uint32_t>(getuid())));
  KVD_ASSIGN_OR_RETURN(const uint64_t max_request_bytes, ParseBytes(f.max_request_bytes, "--max-request-bytes"));
  if (max_request_bytes < 4096 || max_request_bytes > uint64_t{INT32_MAX}) {
    return absl::InvalidArgumentError(absl::StrCat("--max-request-bytes: ", FormatBytes(max_request_bytes),
                                                   " must be at least 4KiB and less than 2GiB"));
  }

  std::string why;
  KVD_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, OpenBackend(f, device_options, &why));
  KVD_ASSIGN_OR_RETURN(DeviceInfo info, device->Info());
  if (socket_path.empty()) {
    socket_path = DefaultSocketPath(f, device_options.index, info.uuid);
    spdlog::info("--device={} selects device #{} (by {}); sockets {} and {}", f.device, device_options.index,
                 selected_by, socket_path, wire::HandlesPathFor(socket_path));
  }
  const std::string handles_path = wire::HandlesPathFor(socket_path);
  KVD_RETURN_IF_ERROR(PrepareSocketDirectory(socket_path));
  KVD_RETURN_IF_ERROR(ClaimSocketPath(socket_path, SOCK_STREAM));
  KVD_RETURN_IF_ERROR(ClaimSocketPath(handles_path, SOCK_SEQPACKET));
  spdlog::info("backend {} ({}): {} #{} {}, {} total, granularity {}", BackendName(device->kind()), why, info.name,
               info.index, info.uuid, FormatBytes(info.total_bytes), FormatBytes(device->granularity()));
  if (device->kind() != BackendKind::kHost && !f.host_capacity.empty()) {
    spdlog::warn("--host-capacity is ignored by the {} backend", BackendName(device->kind()));
  }

  const uint64_t granularity = device->granularity();
  KVD_ASSIGN_OR_RETURN(uint64_t budget, ParseBudget(f.budget, info.total_bytes, granularity));
  if (max_chunk < granularity || max_chunk % granularity != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--max-chunk: ", FormatBytes(max_chunk),
                                                   " is not a positive multiple of the granularity ",
                                                   FormatBytes(granularity)));
  }

  // What a predecessor left (Note [Durable pools] in docs/architecture.md), read before anything serves.
  const absl::Time started_at = absl::Now();
  KVD_ASSIGN_OR_RETURN(uint64_t max_metadata, ParseSize(f.max_metadata, "--max-metadata-bytes"));
  absl::Duration recovery_grace;
  if (!absl::ParseDuration(f.recovery_grace, &recovery_grace) || recovery_grace < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--recovery-grace: \"", f.recovery_grace, "\" is not a duration (e.g. 60s)"));
  }
  KVD_ASSIGN_OR_RETURN(const uint64_t headroom,
                       ParseHeadroom(f.device_headroom, info.total_bytes, device->granularity()));
  absl::Duration reclaim_timeout;
  if (!absl::ParseDuration(f.reclaim_timeout, &reclaim_timeout) || reclaim_timeout <= absl::ZeroDuration() ||
      reclaim_timeout > kMaxReclaimTimeout) {
    return absl::InvalidArgumentError(
        absl::StrCat("--reclaim-timeout: \"", f.reclaim_timeout, "\" is not a duration between 1ms and 10m (e.g. 5s)"));
  }
  absl::Duration pause_timeout;
  if (!absl::ParseDuration(f.pause_timeout, &pause_timeout) || pause_timeout <= absl::ZeroDuration() ||
      pause_timeout > absl::Minutes(10)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--pause-timeout: \"", f.pause_timeout, "\" is not a duration between 1ms and 10m (e.g. 5s)"));
  }
  // The manager always has a store: the state directory's, or (--state-dir=none) one in memory that
  // nothing outlives.
  std::unique_ptr<StateStore> store;
  SavedState saved;
  const bool saved_state = f.state_dir != "none";
  if (!saved_state) {
    store = std::make_unique<MemoryStateStore>();
  } else {
    FileStateStore::Options options{.dir = f.state_dir, .fd_store_max = f.fdstore_max};
    if (options.dir == "auto") {
      absl::string_view stem = socket_path;
      absl::ConsumeSuffix(&stem, ".sock");
      options.dir = absl::StrCat(stem, ".state");
    }
    const char* notify = std::getenv("NOTIFY_SOCKET");
    const char* fdstore_env = std::getenv("FDSTORE");  // systemd >= 254: FileDescriptorStoreMax=
    uint64_t unit_max = 0;
    const bool unit_has_store = fdstore_env == nullptr || (absl::SimpleAtoi(fdstore_env, &unit_max) && unit_max > 0);
    options.fd_store = f.fdstore == "yes" || (f.fdstore == "auto" && notify != nullptr && unit_has_store);
    if (options.fd_store && notify == nullptr) {
      return absl::FailedPreconditionError("--fdstore=yes: $NOTIFY_SOCKET is not set (no service manager)");
    }
    if (fdstore_env != nullptr && unit_max > 0) options.fd_store_max = std::min(options.fd_store_max, unit_max);
    KVD_ASSIGN_OR_RETURN(std::unique_ptr<FileStateStore> file, FileStateStore::Open(options, info, &saved));
    store = std::move(file);
    for (const std::string& line : saved.problems) spdlog::warn("saved state: {}", line);
    spdlog::info("saved state in {}: epoch {}, {} pools, {} chunk FDs from the service manager; chunk FDs go to {}",
                 options.dir, saved.epoch, saved.pools.size(), saved.fds.size(),
                 options.fd_store ? absl::StrCat("its FD store (at most ", options.fd_store_max, ")")
                                  : std::string("no FD store (clients give them back after a restart)"));
  }

  // Note [The host tier]: made before the manager, prepared (allocated, bound, registered) in the background.
  std::unique_ptr<HostTier> host_tier;
  if (host_tier_bytes > 0) {
    if (f.host_tier_copy_threads == 0) return absl::InvalidArgumentError("--host-tier-copy-threads: must be > 0");
    KVD_ASSIGN_OR_RETURN(
        host_tier, HostTier::Create(device.get(),
                                    HostTierOptions{.bytes = host_tier_bytes,
                                                    .copy_threads = f.host_tier_copy_threads,
                                                    .info = [](const std::string& line) { spdlog::info("{}", line); }},
                                    granularity, std::move(saved.host_tier_fd)));
    // Note [The host tier]: in the FD store, the contents sleeping pools keep outlive this process too.
    if (store != nullptr && !host_tier->adopted()) {
      if (absl::Status kept = store->KeepHostTierFd(host_tier->fd()); !kept.ok()) {
        spdlog::warn("host tier: {}; what pools keep there is lost if kvd restarts", std::string(kept.message()));
      }
    }
  } else if (store != nullptr && saved.host_tier_fd.valid()) {
    spdlog::warn(
        "host tier: the previous daemon's tier is released (--host-tier-bytes is 0); the pools that kept "
        "their contents there wake with fresh memory");
    store->DropHostTierFd();
    saved.host_tier_fd.reset();
  }
  PoolManager manager(device.get(), ManagerOptions{.budget_bytes = budget,
                                                   .max_chunk_bytes = max_chunk,
                                                   .lease_ttl = lease_ttl,
                                                   .layout_policy = layout_policy,
                                                   .daemon_uid = static_cast<uint32_t>(getuid()),
                                                   .max_metadata_bytes = max_metadata,
                                                   .store = store.get(),
                                                   .epoch = saved.epoch + 1,
                                                   .started_at = started_at,
                                                   .recovery_grace = recovery_grace,
                                                   .pause_timeout = pause_timeout,
                                                   .compact_above_chunks = f.compact_above_chunks,
                                                   .compact_chunks_per_pause = f.compact_chunks_per_pause,
                                                   .host_tier = host_tier.get(),
                                                   .info = [](const std::string& line) { spdlog::info("{}", line); },
                                                   .warn = [](const std::string& line) { spdlog::warn("{}", line); },
                                                   .limits = limits,
                                                   .device_headroom_bytes = headroom,
                                                   .reclaim_timeout = reclaim_timeout});
  if (saved_state) {
    const absl::Time restore_start = absl::Now();
    const size_t saved_pools = saved.pools.size();
    const RestoreReport report = manager.Restore(std::move(saved));
    spdlog::info(
        "restored {} of {} pools ({} chunks, {}) in {}; {} recovering ({} chunks missing); {} stray FDs "
        "released; epoch {}",
        report.pools_restored + report.pools_recovering, saved_pools, report.chunks_adopted,
        FormatBytes(report.bytes_adopted), absl::FormatDuration(absl::Now() - restore_start), report.pools_recovering,
        report.chunks_missing, report.fds_released, manager.options().epoch);
  }
  ManagerBackend backend(&manager);
  // /metrics is bound before any socket listens: a taken --metrics-address stops kvd here.
  std::unique_ptr<Metrics> metrics;
  if (!f.metrics_address.empty()) {
    KVD_ASSIGN_OR_RETURN(metrics, Metrics::Serve(f.metrics_address, &manager,
                                                 BuildInfo{.version = KVD_VERSION,
                                                           .backend = BackendName(device->kind()),
                                                           .device = absl::StrCat(info.index),
                                                           .uuid = info.uuid},
                                                 f.metrics_clients));
    spdlog::info("metrics on http://{}/metrics", f.metrics_address);
  }
  // kvd accepts the control socket's connections itself, so that every RPC's connection has a peer
  // (SO_PEERCRED) a session token is checked against: ControlSocket.
  KVD_ASSIGN_OR_RETURN(
      std::unique_ptr<ControlSocket> control,
      ControlSocket::Listen(socket_path, 0660,
                            ControlSocket::Options{.max_connections = f.max_control_connections,
                                                   .reserved_connections = OperatorShare(
                                                       f.max_control_connections, limits.operator_reserve_percent),
                                                   .operator_uid = limits.daemon_uid,
                                                   .max_connections_per_uid = f.max_control_connections_per_uid}));
  const std::optional<SocketId> socket_id = IdOf(socket_path);
  absl::Cleanup remove_socket = [&] { RemoveSocket(socket_path, socket_id); };
  // Before the service, which pushes leases on its sessions' connections (KvdService::Options::handles): it
  // outlives the server.
  KVD_ASSIGN_OR_RETURN(
      std::unique_ptr<HandleChannel> channel,
      HandleChannel::Start(handles_path, &backend,
                           HandleChannel::Options{.max_connections = f.max_handle_connections,
                                                  .reserved_connections = OperatorShare(
                                                      f.max_handle_connections, limits.operator_reserve_percent),
                                                  .operator_uid = limits.daemon_uid,
                                                  .max_connections_per_uid = f.max_handle_connections_per_uid}));
  KvdService service(
      &manager,
      KvdService::Options{
          .granularity = granularity, .metrics = metrics.get(), .peers = control.get(), .handles = channel.get()});

  // No method of gRPC's callback API, whose threads would take part in every call (Note [No callback API] in
  // docs/architecture.md): the health service is kvd's, and the quick RPCs and the streams run on kvd's completion
  // threads.
  HealthService health;
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // Larger requests are refused by gRPC itself, before any handler runs (RESOURCE_EXHAUSTED).
  builder.SetMaxReceiveMessageSize(static_cast<int>(max_request_bytes));
  builder.RegisterService(&service);
  builder.RegisterService(&health);
  CompletionThreads threads(&builder, kCompletionThreads);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(MakeParseErrorInterceptorFactory());
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) return absl::UnavailableError(absl::StrCat("cannot serve gRPC on unix:", socket_path));
  service.ListenForCalls(threads.cq());
  health.ListenForWatches(threads.cq());
  threads.Start();
  absl::Cleanup stop_server = [&] {
    control->Stop();
    health.Shutdown();
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    service.WaitForAttaches();
    threads.Stop();
  };
  KVD_RETURN_IF_ERROR(control->Serve(server.get()));
  health.SetServingStatus("", true);  // the server as a whole
  health.SetServingStatus(v1::Kvd::service_full_name(), true);

  // What the manager reports on its own: metrics, and whether the saved state is current, as the health
  // service's "kvd.state" (NOT_SERVING while degraded; "" and kvd.v1.Kvd stay SERVING: the daemon serves
  // as before, and a probe that restarted it would make the stale records count). docs/operations.md.
  PoolManager::Observers observers{
      .state_degraded = [&health](bool degraded) { health.SetServingStatus(kStateHealthService, !degraded); }};
  if (Metrics* m = metrics.get(); m != nullptr) {
    observers.reshape_step = [m](const ReshapeReport& r) {
      m->ObserveReshape(r.pause, r.paused_clients > 0, r.copied_bytes, r.chunks_replaced);
    };
    observers.background_compaction = [m](absl::Duration elapsed, bool ok) {
      m->ObserveOperation(Operation::kCompact, elapsed, ok);
    };
    observers.arbitration = [m](const ArbiterEvent& event) { m->ObserveArbitration(event); };
  }
  manager.Observe(std::move(observers));
  // The manager's threads stop reporting before the server and metrics go.
  absl::Cleanup forget_observers = [&] { manager.Observe({}); };

  if (metrics != nullptr) {
    const HandleChannel* served = channel.get();
    const ControlSocket* controlled = control.get();
    metrics->SetLimits(LimitValues(f, limits, max_request_bytes), [served, controlled] {
      const HandleChannel::Refusals handles = served->refusals();
      const PeerAcceptor::Refusals controls = controlled->refusals();
      return ConnectionUsage{.handle_channel = {.connections_by_uid = served->ConnectionsByUid(),
                                                .refused_total = handles.total,
                                                .refused_per_uid = handles.per_uid},
                             .control_socket = {.connections_by_uid = controlled->ConnectionsByUid(),
                                                .refused_total = controls.total,
                                                .refused_per_uid = controls.per_uid}};
    });
  }
  // Scrapes stop reading the channel before it goes (metrics outlives it).
  absl::Cleanup forget_channel = [&] {
    if (metrics != nullptr) metrics->SetLimits(LimitValues(f, limits, max_request_bytes), nullptr);
  };
  if (chmod(handles_path.c_str(), 0660) != 0) return ErrnoStatus(errno, absl::StrCat("chmod 0660 ", handles_path));

  spdlog::info(
      "kvd {} ready: backend {}, device \"{}\" #{} {}, grpc unix:{}, handles {}, budget {} of {}, max chunk {}, "
      "granularity {}, device headroom {}, pid {}",
      KVD_VERSION, BackendName(device->kind()), info.name, info.index, info.uuid, socket_path, handles_path,
      FormatBytes(budget), FormatBytes(info.total_bytes), FormatBytes(max_chunk), FormatBytes(granularity),
      FormatBytes(headroom), getpid());
  spdlog::info(
      "limits: pools {} ({} per uid), sessions {} ({} per uid), reserved {} ({} per uid), {} clients per pool, "
      "handle-channel connections {} ({} per uid), control-socket connections {} ({} per uid), {} block ids and {} "
      "per request; {}% kept for root and uid {}",
      limits.max_pools, limits.max_pools_per_uid, limits.max_sessions, limits.max_sessions_per_uid,
      FormatBytes(limits.max_reserved_bytes), FormatBytes(limits.max_reserved_bytes_per_uid),
      limits.max_clients_per_pool, f.max_handle_connections, f.max_handle_connections_per_uid,
      f.max_control_connections, f.max_control_connections_per_uid, limits.max_block_ids,
      FormatBytes(max_request_bytes), limits.operator_reserve_percent, limits.daemon_uid);
  // systemd Type=notify (deploy/systemd/kvd@.service): both sockets exist now. No-op without NOTIFY_SOCKET.
  sd_notifyf(0, "READY=1\nSTATUS=serving unix:%s, budget %s\nMAINPID=%d", socket_path.c_str(),
             FormatBytes(budget).c_str(), static_cast<int>(getpid()));

  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  siginfo_t signal_info{};
  while (sigwaitinfo(&stop_signals, &signal_info) < 0) {
    if (errno != EINTR) return ErrnoStatus(errno, "sigwaitinfo");
  }
  spdlog::info("{} from pid {}: stopping", sigabbrev_np(signal_info.si_signo), signal_info.si_pid);
  const bool keep_pools = saved_state && !f.drain_on_stop;
  sd_notify(0, keep_pools ? "STOPPING=1\nSTATUS=stopping: keeping every pool for the next start"
                          : "STOPPING=1\nSTATUS=stopping: releasing all memory");

  // Tell watchers the daemon is stopping (which also ends their streams and wakes waiting shrinks and grows;
  // a resize that comes meanwhile is UNAVAILABLE "kvd is shutting down"), release or keep the memory, then
  // stop the server: the RPCs in flight and the streams' last messages get a second from then. Begun together,
  // a busy machine could spend the second in the manager's shutdown and cut the streams before their
  // DAEMON_RESTARTING and OK status were sent.
  std::move(stop_server).Cancel();
  control->Stop();
  health.Shutdown();
  manager.Shutdown(keep_pools);
  // gRPC waits for clients to close even idle connections: the deadline bounds that too.
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  service.WaitForAttaches();
  threads.Stop();
  if (!keep_pools) store->DropHostTierFd();  // nothing kept in it is any pool's now
  channel->Stop();
  RemoveSocket(socket_path, socket_id);
  RemoveSocket(handles_path, IdOf(handles_path));
  spdlog::info("kvd stopped ({})", keep_pools ? "pools kept for the next start" : "all memory released");
  return absl::OkStatus();
}

// Note [The daemon's own memory] in docs/architecture.md: glibc's heap shaped for a daemon whose replies and
// records grow with the chunk count. One arena: each thread's arena would keep the high water of the biggest
// reply it built (a thread arena never gives its top back). Buffers of 32 KiB and more (a large pool's chunk
// lists, replies and records) are mmapped, so that freeing one gives it back, and the heap's top is given back
// past 32 KiB, keeping no pad. An operator's MALLOC_*_ variable for a setting wins over it.
// A sanitizer's allocator replaces glibc's: mallopt does not apply there (it fails), so those builds skip it.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define KVD_SANITIZER_HEAP 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
#define KVD_SANITIZER_HEAP 1
#endif
#endif

void ShapeTheHeap() {
#ifndef KVD_SANITIZER_HEAP
  const struct {
    const char* env;
    int param;
    int value;
  } settings[] = {{"MALLOC_ARENA_MAX", M_ARENA_MAX, 1},
                  {"MALLOC_MMAP_THRESHOLD_", M_MMAP_THRESHOLD, 32 << 10},
                  {"MALLOC_TRIM_THRESHOLD_", M_TRIM_THRESHOLD, 32 << 10},
                  {"MALLOC_TOP_PAD_", M_TOP_PAD, 0}};
  for (const auto& s : settings) {
    if (std::getenv(s.env) == nullptr && mallopt(s.param, s.value) != 1) {
      std::fprintf(stderr, "kvd: mallopt(%s) failed; the heap keeps glibc's default\n", s.env);
    }
  }
#endif
}

int Main(int argc, char** argv) {
  ShapeTheHeap();
#ifdef KVD_FAILURE_SIGNAL_HANDLER
  // A crash (SIGSEGV, SIGABRT, SIGBUS, SIGILL, SIGFPE) writes its signal and stack to stderr, the journal, before
  // the signal's default action ends the process (docs/operations.md, "When kvd crashes"). SIGTERM never reaches
  // the handler: it is blocked below, for sigwaitinfo.
  absl::InitializeSymbolizer(argv[0]);
  absl::InstallFailureSignalHandler(absl::FailureSignalHandlerOptions{});
#endif
#ifndef KVD_MUTEX_DEADLOCK_DETECTION
  // Note [Mutex deadlock detection in checking builds only]: before any lock of kvd's is taken.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#endif
  // Before any thread exists, so that every thread inherits the mask and only sigwaitinfo sees them.
  sigset_t blocked;
  sigemptyset(&blocked);
  sigaddset(&blocked, SIGTERM);
  sigaddset(&blocked, SIGINT);
  pthread_sigmask(SIG_BLOCK, &blocked, nullptr);
  signal(SIGPIPE, SIG_IGN);

  CLI::App app{
      "kvd: the per-device KV-cache memory daemon. Serves the kvd.v1.Kvd gRPC API on a Unix socket and "
      "chunk FDs on the handle channel beside it."};
  app.set_version_flag("--version", absl::StrCat("kvd ", KVD_VERSION));
  Flags f;
  app.add_option("--backend", f.backend, "Memory backend: auto (CUDA if a driver and device are present, else host)")
      ->check(CLI::IsMember({"auto", "host", "cuda", "hip"}))
      ->capture_default_str();
  app.add_option("--device", f.device,
                 "The device to serve: an index (0, 1, ...) or a device UUID or unique prefix of one (GPU-5f3a; "
                 "the GPU- may be left out). UUIDs do not change when devices are re-enumerated; see --list-devices")
      ->capture_default_str();
  app.add_flag("--list-devices", f.list_devices,
               "Print index, UUID, memory and name of every device of --backend this process sees, and exit");
  app.add_flag("--json", f.json, "With --list-devices: print JSON instead of a table");
  app.add_option("--socket", f.socket,
                 "gRPC Unix socket (default <--socket-dir>/gpu<N>.sock, N the selected device's index); the handle "
                 "channel is the same path with .sock replaced by .handles");
  app.add_option("--socket-dir", f.socket_dir,
                 "Directory of the sockets when --socket is not given (default $NVIDIA_DRA_LOCAL_IPC_DIR, the DRA "
                 "claim's IPC directory, else /run/kvd)");
  app.add_option("--socket-name", f.socket_name,
                 "Name of the sockets when --socket is not given: index (gpu<N>.sock) or uuid (<device UUID>.sock, "
                 "found by clients by UUID: kvd::FindSocket, kvd.connect(device=UUID))")
      ->check(CLI::IsMember({"index", "uuid"}))
      ->capture_default_str();
  app.add_option("--metrics-address", f.metrics_address,
                 "HOST:PORT to serve Prometheus /metrics on (default: not served)");
  app.add_flag("--metrics-clients", f.metrics_clients,
               "Also serve kvd_client_mapped_bytes, one series per attached client with its pid, uid and name "
               "(off: /metrics has no authentication; turn on only where only trusted users can reach it)");
  app.add_option("--budget", f.budget, "Most memory committed at once: SIZE (100GiB) or PCT% of the device")
      ->capture_default_str();
  app.add_option("--host-capacity", f.host_capacity, "Host backend: memory it may commit (default: physical memory)");
  app.add_option("--host-granularity", f.host_granularity, "Host backend: allocation granularity")
      ->capture_default_str();
  app.add_option("--host-used-by-others", f.host_used_by_others,
                 "Host backend: bytes of --host-capacity that stand for other processes' use of a GPU (contexts, "
                 "weights): never free to kvd, as on a shared GPU (for tests of admission and reclaim)")
      ->capture_default_str();
  app.add_option("--max-chunk", f.max_chunk, "Largest single chunk a grow creates")->capture_default_str();
  app.add_option("--host-tier-bytes", f.host_tier,
                 "Host memory (a memfd, NUMA-local to the GPU, registered with the driver at start) where a sleep "
                 "that keeps its contents puts them; a multiple of the granularity; 0: none")
      ->capture_default_str();
  app.add_option("--host-tier-copy-threads", f.host_tier_copy_threads,
                 "Copies in flight at once between a pool and the host tier")
      ->capture_default_str();
  app.add_option("--lease-ttl", f.lease_ttl, "How long a handle lease stays redeemable (e.g. 30s, 500ms)")
      ->capture_default_str();
  app.add_option("--layout-override", f.layout_override,
                 "Operator layout override for pools whose request names none (LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, "
                 "BHLNC)");
  app.add_option("--state-dir", f.state_dir,
                 "Where pool records are saved so that a restart keeps every pool (auto: beside --socket, "
                 "/run/kvd/gpu<N>.state; none: a restart loses every pool). docs/operations.md")
      ->capture_default_str();
  app.add_option("--fdstore", f.fdstore,
                 "Hand chunk FDs to systemd's file-descriptor store (auto: when $NOTIFY_SOCKET is set)")
      ->check(CLI::IsMember({"auto", "yes", "no"}))
      ->capture_default_str();
  app.add_option("--fdstore-max", f.fdstore_max,
                 "Most FDs in the FD store (one per chunk, one for the host tier), as FileDescriptorStoreMax= of the "
                 "unit; a grow past it is refused")
      ->capture_default_str();
  app.add_option("--recovery-grace", f.recovery_grace,
                 "After a restart, how long a pool waits for clients to give back chunks the FD store did not have")
      ->capture_default_str();
  app.add_option("--pause-timeout", f.pause_timeout,
                 "How long a shrink or compact that moves bytes waits for every attached client to pause (and then "
                 "to resume) unless the request says otherwise")
      ->capture_default_str();
  app.add_option("--compact-above-chunks", f.compact_above_chunks,
                 "Compact a pool on the daemon's own when a grow leaves it with more chunks than this and every "
                 "attached client is pausable (0: never; kvctl compact does it on request)")
      ->capture_default_str();
  app.add_option("--compact-chunks-per-pause", f.compact_chunks_per_pause,
                 "A compaction with clients attached replaces at most this many chunks under one pause, in as many "
                 "steps as it takes (each paused client unmaps every replaced chunk: about 17 us each on an H200); "
                 "CompactRequest.max_chunks_per_pause overrides it")
      ->check(CLI::Range(1u, 1u << 20))
      ->capture_default_str();
  app.add_flag("--drain-on-stop", f.drain_on_stop,
               "On SIGTERM delete every pool and release all memory (engines are told to unmap) instead of keeping "
               "the pools for the next start");
  app.add_option("--max-metadata-bytes", f.max_metadata, "Largest pool metadata blob (SetPoolMetadata)")
      ->capture_default_str();
  app.add_option("--log-format", f.log_format, "text or json (one JSON object per line)")
      ->check(CLI::IsMember({"text", "json"}))
      ->capture_default_str();
  app.add_option("--log-level", f.log_level, "trace, debug, info, warn, error, critical or off")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "critical", "off"}))
      ->capture_default_str();
  // Limits (docs/operations.md, "Limits").
  app.add_option("--max-pools", f.max_pools, "Pools of all uids together")->capture_default_str();
  app.add_option("--max-pools-per-uid", f.max_pools_per_uid, "Pools one uid may own")->capture_default_str();
  app.add_option("--max-sessions", f.max_sessions, "Handle-channel sessions of all uids together")
      ->capture_default_str();
  app.add_option("--max-sessions-per-uid", f.max_sessions_per_uid, "Sessions one uid may have open")
      ->capture_default_str();
  app.add_option("--max-reserved", f.max_reserved, "Address space reserved by all pools together")
      ->capture_default_str();
  app.add_option("--max-reserved-per-uid", f.max_reserved_per_uid, "Address space reserved by one uid's pools")
      ->capture_default_str();
  app.add_option("--max-clients-per-pool", f.max_clients_per_pool, "Clients attached to one pool")
      ->capture_default_str();
  app.add_option("--max-handle-connections", f.max_handle_connections,
                 "Handle-channel connections of every kind open at once")
      ->capture_default_str();
  app.add_option("--max-handle-connections-per-uid", f.max_handle_connections_per_uid,
                 "Handle-channel connections one uid may have open")
      ->capture_default_str();
  app.add_option("--max-control-connections", f.max_control_connections,
                 "gRPC control-socket connections of all uids open at once")
      ->capture_default_str();
  app.add_option("--max-control-connections-per-uid", f.max_control_connections_per_uid,
                 "gRPC control-socket connections one uid may have open")
      ->capture_default_str();
  app.add_option("--max-block-ids", f.max_block_ids,
                 "Block ids (or copies) one ZeroBlocks, CopyBlocks or DescribeTransfer may name")
      ->capture_default_str();
  app.add_option("--max-request-bytes", f.max_request_bytes, "Largest gRPC request accepted")->capture_default_str();
  app.add_option("--operator-reserve", f.operator_reserve,
                 "Share of every total limit (pools, sessions, reserved, clients per pool, handle-channel "
                 "and control-socket connections) only root and kvd's own uid may use")
      ->capture_default_str();
  // Arbitration (docs/operations.md, "Several engines on one GPU").
  app.add_option("--device-headroom", f.device_headroom,
                 "Device memory no grow may take, for other processes (SIZE or PCT% of the device): a grow is "
                 "admitted only when the device's free memory less this backs it")
      ->capture_default_str();
  app.add_option("--reclaim-timeout", f.reclaim_timeout,
                 "How long an engine has to answer a reclaim when its pool's policy does not say "
                 "(PoolPolicy.reclaim_timeout_ms)")
      ->capture_default_str();
  app.add_option("--max-priority-per-uid", f.max_priority_per_uid,
                 "The highest priority a uid other than root and kvd's may give its pools (0..1000)")
      ->capture_default_str();
  app.add_option("--max-guaranteed-per-uid", f.max_guaranteed_per_uid,
                 "The bytes a uid other than root and kvd's may have guaranteed (PoolPolicy.min_bytes), over all its "
                 "pools")
      ->capture_default_str();
  app.add_option("--uid-claim", f.uid_claims,
                 "UID:priority=P,guaranteed=SIZE: what one uid is granted instead of --max-priority-per-uid and "
                 "--max-guaranteed-per-uid (repeat for more uids)");
  app.footer(absl::StrCat("Environment: ", kLayoutEnv,
                          " sets the daemon's layout preference (rule 3 of the chain); an invalid value stops kvd."));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::cerr << "kvd: " << e.what() << "\n";
    return 2;
  }

  if (f.list_devices) {
    if (absl::Status listed = PrintDevices(f); !listed.ok()) {
      std::cerr << "kvd: --list-devices: " << listed.message() << "\n";
      return 1;
    }
    return 0;
  }
  if (f.json) {
    std::cerr << "kvd: --json only goes with --list-devices (use --log-format=json for JSON logs)\n";
    return 2;
  }

  absl::Status logging = SetUpLogging(f);
  if (!logging.ok()) {
    std::cerr << "kvd: " << logging.message() << "\n";
    return 1;
  }
  absl::Status status;
  try {
    status = Run(f);
  } catch (const std::system_error& e) {
    // std::thread reports a thread it cannot start only by throwing; at start-up (the manager's reaper,
    // the channel's threads are checked where they start) it stops kvd with one line, not an abort.
    status = absl::ResourceExhaustedError(absl::StrCat("cannot start a thread (out of threads or memory): ", e.what()));
  }
  if (!status.ok()) {
    spdlog::error("kvd: {}", Sv(status.message()));
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace kvd::daemon

int main(int argc, char** argv) { return kvd::daemon::Main(argc, argv); }
