// Metrics: kvd's Prometheus endpoint (docs/metrics.md) behind a narrow interface.
// prometheus-cpp stays inside metrics.cc; callers see only this header.
//
// What is exported. Pool, client and device gauges are built at scrape time from PoolManager
// snapshots (GetDeviceStatus and ListPools as root), so a deleted pool or a detached client leaves no
// stale series. Counters and histograms (operations, RPCs) and kvd_build_info live in a registry fed
// by the rpc layer through CountRpc and ObserveOperation.
//
// Ownership. Serve binds HOST:PORT and serves GET /metrics on prometheus-cpp's (civetweb's) own
// threads until the Metrics object is destroyed. `manager` is not owned and must outlive it.
//
// Threads. Every method is thread-safe; a scrape takes the manager's locks only through its public,
// thread-safe snapshot calls.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "daemon/core/pool_manager.h"

namespace kvd::daemon {

// What every scrape is labelled with, so that one Prometheus scraping every kvd of a node tells the
// devices apart without relying on ports.
struct BuildInfo {
  std::string version;
  std::string backend;  // "host", "cuda", "hip"
  std::string device;   // the device index ("0"): label `device` of every kvd_ series
  std::string uuid;     // the device UUID: label `uuid` of kvd_build_info and the device gauges
};

// One limit flag and its value: kvd_limit{limit="max-pools"} (the flag without "--").
struct LimitValue {
  std::string limit;
  uint64_t value = 0;
};

// One socket's connections against its limits, read at scrape time.
struct SocketUsage {
  std::map<uint32_t, uint64_t> connections_by_uid;
  uint64_t refused_total = 0;    // by --max-handle-connections / --max-control-connections
  uint64_t refused_per_uid = 0;  // by their -per-uid
};

// The sockets' side of the limits.
struct ConnectionUsage {
  SocketUsage handle_channel;
  SocketUsage control_socket;
};

// The timed operations: label op of kvd_operations_total and kvd_operation_duration_seconds.
enum class Operation { kGrow, kShrink, kSleep, kWake, kAttach, kCompact };

class Metrics {
 public:
  // Serves /metrics on `address` ("HOST:PORT"; "127.0.0.1:9400", "[::1]:9400", "0.0.0.0:0").
  // INVALID_ARGUMENT for an address that is not HOST:PORT; UNAVAILABLE when it cannot be bound; both
  // messages name --metrics-address. `client_series` (--metrics-clients) adds kvd_client_mapped_bytes,
  // one series per attached client labelled with its pid, uid and name: off by default, because
  // /metrics has no authentication and those labels tell anyone who can reach it who uses which pool.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<Metrics>> Serve(const std::string& address,
                                                                      const PoolManager* manager, BuildInfo build,
                                                                      bool client_series = false);
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // The TCP port actually bound (useful with port 0).
  int port() const;

  // One finished RPC: kvd_rpc_requests_total{method, code} (code as absl::StatusCodeToString: "OK",
  // "NOT_FOUND", ...).
  void CountRpc(absl::string_view method, absl::StatusCode code);
  // One core operation that took `elapsed`: kvd_operations_total{op, result="ok"|"error"} and, for
  // every call, kvd_operation_duration_seconds{op}.
  void ObserveOperation(Operation op, absl::Duration elapsed, bool ok);
  // One shrink or compact that moved bytes: kvd_pause_seconds (when clients paused),
  // kvd_reshape_copied_bytes_total and kvd_reshape_chunks_replaced_total.
  void ObserveReshape(absl::Duration pause, bool paused, uint64_t copied_bytes, uint64_t chunks_replaced);
  // An ended reclaim (kvd_reclaim_seconds{outcome}) or wait for memory (kvd_wait_seconds{result}).
  void ObserveArbitration(const ArbiterEvent& event);
  // The limits to export (kvd_limit) and the sockets' usage (kvd_tenant_handle_connections,
  // kvd_tenant_control_connections and their kvd_limit_refusals_total); until called, only the core's
  // limits' usage and refusals are exported. `connections` is called at every scrape, from the
  // exposer's threads.
  void SetLimits(std::vector<LimitValue> limits, std::function<ConnectionUsage()> connections);

 private:
  struct Impl;
  explicit Metrics(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

const char* OperationName(Operation op);

}  // namespace kvd::daemon
