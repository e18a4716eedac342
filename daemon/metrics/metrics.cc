#include "daemon/metrics/metrics.h"

#include <array>
#include <exception>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/client_metric.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/labels.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"

namespace kvd::daemon {
namespace {

constexpr std::array<Operation, 6> kOperations = {Operation::kGrow, Operation::kShrink, Operation::kSleep,
                                                  Operation::kWake, Operation::kAttach, Operation::kCompact};

// From a cheap attach (~100 us) to a shrink that waits a minute for clients to release.
const prometheus::Histogram::BucketBoundaries& DurationBuckets() {
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
  return kBuckets;
}

prometheus::MetricFamily Gauge(std::string name, std::string help) {
  prometheus::MetricFamily family;
  family.name = std::move(name);
  family.help = std::move(help);
  family.type = prometheus::MetricType::Gauge;
  return family;
}

void Add(prometheus::MetricFamily& family, std::vector<prometheus::ClientMetric::Label> labels, double value) {
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  m.gauge.value = value;
  family.metric.push_back(std::move(m));
}

prometheus::MetricFamily Counter(std::string name, std::string help) {
  prometheus::MetricFamily family;
  family.name = std::move(name);
  family.help = std::move(help);
  family.type = prometheus::MetricType::Counter;
  return family;
}

void Count(prometheus::MetricFamily& family, std::vector<prometheus::ClientMetric::Label> labels, double value) {
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  m.counter.value = value;
  family.metric.push_back(std::move(m));
}

// Pool, client and device gauges and kvd_build_info, built from PoolManager snapshots at every scrape
// (Note: no stale series: a deleted pool simply is not in the next snapshot).
class SnapshotCollector final : public prometheus::Collectable {
 public:
  SnapshotCollector(const PoolManager* manager, BuildInfo build, bool client_series)
      : manager_(manager), build_(std::move(build)), client_series_(client_series) {}

  void SetLimits(std::vector<LimitValue> limits, std::function<ConnectionUsage()> channel) {
    absl::MutexLock lock(&mu_);
    limits_ = std::move(limits);
    channel_ = std::move(channel);
  }

  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> out;

    prometheus::MetricFamily build_info =
        Gauge("kvd_build_info", "kvd's version, memory backend and device; always 1 (join on it for labels).");
    Add(build_info,
        {{"version", build_.version}, {"backend", build_.backend}, {"device", build_.device}, {"uuid", build_.uuid}},
        1);
    out.push_back(std::move(build_info));

    absl::StatusOr<DeviceStatus> device = manager_->GetDeviceStatus();
    if (device.ok()) {
      const std::vector<prometheus::ClientMetric::Label> labels = {
          {"device", build_.device}, {"backend", BackendName(device->info.backend)}, {"uuid", device->info.uuid}};
      prometheus::MetricFamily total = Gauge("kvd_device_total_bytes", "Physical memory of the device.");
      prometheus::MetricFamily free =
          Gauge("kvd_device_free_bytes", "Free memory of the device as its driver reports it now.");
      prometheus::MetricFamily committed =
          Gauge("kvd_device_committed_bytes", "Memory committed to kvd's pools, including bytes pending release.");
      prometheus::MetricFamily budget =
          Gauge("kvd_device_budget_bytes", "Most memory kvd commits at once on the device (--budget).");
      Add(total, labels, static_cast<double>(device->info.total_bytes));
      Add(free, labels, static_cast<double>(device->info.free_bytes));
      Add(committed, labels, static_cast<double>(device->committed_bytes));
      Add(budget, labels, static_cast<double>(device->budget_bytes));
      prometheus::MetricFamily epoch = Gauge(
          "kvd_daemon_epoch", "1 for a daemon that started without saved state, +1 for each restart that restored it.");
      prometheus::MetricFamily started = Gauge("kvd_daemon_start_time_seconds", "When this daemon process started.");
      Add(epoch, labels, static_cast<double>(device->epoch));
      Add(started, labels, absl::ToDoubleSeconds(device->started_at - absl::UnixEpoch()));
      for (auto* f : {&total, &free, &committed, &budget, &epoch, &started}) out.push_back(std::move(*f));
      // Admission (docs/api.md, "Policy, waiting and reclaim").
      prometheus::MetricFamily headroom = Gauge(
          "kvd_device_headroom_bytes", "Device memory no grow may take, for other processes (--device-headroom).");
      prometheus::MetricFamily foreign = Gauge(
          "kvd_device_foreign_bytes",
          "Device memory kvd does not own: total - free - kvd's own (other processes' contexts, weights, graphs).");
      prometheus::MetricFamily available =
          Gauge("kvd_device_available_bytes",
                "What one grow could be admitted for now: the lower of the budget's free bytes and the device's free "
                "bytes less the headroom and what admitted grows are still making.");
      Add(headroom, labels, static_cast<double>(device->headroom_bytes));
      Add(foreign, labels, static_cast<double>(device->foreign_bytes));
      Add(available, labels, static_cast<double>(device->available_bytes));
      for (auto* f : {&headroom, &foreign, &available}) out.push_back(std::move(*f));
    }
    CollectArbitration(out);

    // The host tier (docs/metrics.md, "Host tier"): present only with --host-tier-bytes.
    if (const HostTierStats tier = manager_->HostTierUsage(); tier.bytes > 0) {
      const std::vector<prometheus::ClientMetric::Label> labels = {{"device", build_.device}};
      prometheus::MetricFamily size = Gauge("kvd_host_tier_bytes", "Host memory of the host tier (--host-tier-bytes).");
      prometheus::MetricFamily used =
          Gauge("kvd_host_tier_used_bytes", "Host tier bytes holding sleeping pools' kept contents.");
      prometheus::MetricFamily registered =
          Gauge("kvd_host_tier_registered",
                "1 once the host tier is allocated and registered with the driver; 0 before, or when registration "
                "failed (the log says why).");
      prometheus::MetricFamily node =
          Gauge("kvd_host_tier_numa_node", "The NUMA node the host tier is bound to; -1: not bound.");
      Add(size, labels, static_cast<double>(tier.bytes));
      Add(used, labels, static_cast<double>(tier.used_bytes));
      Add(registered, labels, tier.ready && tier.registered ? 1 : 0);
      Add(node, labels, tier.numa_node);
      for (auto* f : {&size, &used, &registered, &node}) out.push_back(std::move(*f));
      prometheus::MetricFamily copied;
      copied.name = "kvd_host_tier_copied_bytes_total";
      copied.help =
          "Bytes copied between pools and the host tier (direction=to_host: keeping sleeps; to_device: wakes).";
      copied.type = prometheus::MetricType::Counter;
      prometheus::MetricFamily seconds;
      seconds.name = "kvd_host_tier_copy_seconds_total";
      seconds.help = "Time spent in those copies; the copy rate is the ratio of the two counters' rates.";
      seconds.type = prometheus::MetricType::Counter;
      for (const auto& [direction, bytes, secs] :
           {std::tuple{"to_host", tier.copied_to_host_bytes, tier.copy_to_host_seconds},
            std::tuple{"to_device", tier.copied_to_device_bytes, tier.copy_to_device_seconds}}) {
        prometheus::ClientMetric b;
        b.label = {{"device", build_.device}, {"direction", direction}};
        b.counter.value = static_cast<double>(bytes);
        copied.metric.push_back(b);
        prometheus::ClientMetric s;
        s.label = b.label;
        s.counter.value = secs;
        seconds.metric.push_back(std::move(s));
      }
      out.push_back(std::move(copied));
      out.push_back(std::move(seconds));
    }

    // The saved state (docs/operations.md, "When saving the state fails"): present even when the device
    // cannot be read.
    const StateHealth saved_state = manager_->state_health();
    prometheus::MetricFamily degraded =
        Gauge("kvd_state_degraded",
              "1 while some pool's saved record could not be written (a restart now would restore it as last "
              "written); 0 once every such pool was saved again.");
    Add(degraded, {{"device", build_.device}}, saved_state.degraded() ? 1 : 0);
    out.push_back(std::move(degraded));
    prometheus::MetricFamily save_failures;
    save_failures.name = "kvd_state_save_failures_total";
    save_failures.help = "Pool records under --state-dir that could not be written or removed.";
    save_failures.type = prometheus::MetricType::Counter;
    {
      prometheus::ClientMetric m;
      m.label = {{"device", build_.device}};
      m.counter.value = static_cast<double>(saved_state.save_failures);
      save_failures.metric.push_back(std::move(m));
    }
    out.push_back(std::move(save_failures));

    // Root sees every pool.
    const std::vector<PoolView> pools =
        manager_->ListPools(Caller{.uid = 0, .pid = 0, .session = "", .name = "metrics"});
    prometheus::MetricFamily committed_bytes =
        Gauge("kvd_pool_committed_bytes", "Physical memory committed to the pool, including bytes pending release.");
    prometheus::MetricFamily reserved_bytes =
        Gauge("kvd_pool_reserved_bytes", "Virtual address space reserved for the pool.");
    prometheus::MetricFamily committed_blocks = Gauge("kvd_pool_committed_blocks", "Blocks backed by memory now.");
    prometheus::MetricFamily capacity_blocks =
        Gauge("kvd_pool_capacity_blocks", "Blocks the pool can hold at most (its geometry's capacity).");
    prometheus::MetricFamily state =
        Gauge("kvd_pool_state", "1 for the pool's current state (state=awake|sleeping|recovering), 0 for the others.");
    prometheus::MetricFamily missing = Gauge(
        "kvd_pool_missing_chunks", "Chunks of a recovering pool that no client has given back since the restart.");
    prometheus::MetricFamily clients = Gauge("kvd_pool_attached_clients", "Clients attached to the pool.");
    prometheus::MetricFamily pending = Gauge(
        "kvd_pool_pending_release_bytes", "Released bytes not yet acknowledged by every client; still in the budget.");
    prometheus::MetricFamily held = Gauge(
        "kvd_pool_held", "1 while a prepared group transaction holds the pool (other resizes of it are refused).");
    prometheus::MetricFamily group =
        Gauge("kvd_pool_group_info", "1 for a pool that is one rank of an engine group (labels group, rank, size).");
    prometheus::MetricFamily mapped =
        Gauge("kvd_client_mapped_bytes", "Bytes handed to the client and not yet acknowledged as released.");
    prometheus::MetricFamily priority = Gauge("kvd_pool_priority", "The pool's policy.priority (0..1000).");
    prometheus::MetricFamily min_bytes =
        Gauge("kvd_pool_min_bytes", "The pool's guaranteed bytes (policy.min_bytes): never reclaimed below.");
    prometheus::MetricFamily max_bytes = Gauge("kvd_pool_max_bytes", "The pool's cap (policy.max_bytes); 0: none.");
    prometheus::MetricFamily reclaim_asked =
        Gauge("kvd_pool_reclaim_asked_bytes", "Bytes the reclaim under way asks of the pool; 0: none under way.");
    prometheus::MetricFamily pool_waiting =
        Gauge("kvd_pool_waiting_requests", "Grows and wakes of the pool waiting for memory.");
    for (const PoolView& p : pools) {
      const std::vector<prometheus::ClientMetric::Label> pool = {{"device", build_.device}, {"pool", p.name}};
      Add(priority, pool, static_cast<double>(p.claim.policy.priority));
      Add(min_bytes, pool, static_cast<double>(p.claim.policy.min_bytes));
      Add(max_bytes, pool, static_cast<double>(p.claim.policy.max_bytes));
      Add(reclaim_asked, pool, static_cast<double>(p.claim.reclaim.id != 0 ? p.claim.reclaim.asked_bytes : 0));
      Add(pool_waiting, pool, static_cast<double>(p.claim.waiting.size()));
      Add(committed_bytes, pool, static_cast<double>(p.committed_bytes));
      Add(reserved_bytes, pool, static_cast<double>(p.reserved_bytes));
      Add(committed_blocks, pool, static_cast<double>(p.committed_blocks));
      Add(capacity_blocks, pool, static_cast<double>(p.geometry.dims().capacity_blocks));
      Add(state, {{"device", build_.device}, {"pool", p.name}, {"state", "awake"}},
          p.state == PoolState::kAwake ? 1 : 0);
      Add(state, {{"device", build_.device}, {"pool", p.name}, {"state", "sleeping"}},
          p.state == PoolState::kSleeping ? 1 : 0);
      Add(state, {{"device", build_.device}, {"pool", p.name}, {"state", "recovering"}},
          p.state == PoolState::kRecovering ? 1 : 0);
      Add(missing, pool, static_cast<double>(p.missing_chunk_ids.size()));
      Add(clients, pool, static_cast<double>(p.clients.size()));
      Add(pending, pool, static_cast<double>(p.pending_release_bytes));
      Add(held, pool, p.transaction.empty() ? 0 : 1);
      if (!p.group.name.empty()) {
        Add(group,
            {{"device", build_.device},
             {"pool", p.name},
             {"group", p.group.name},
             {"rank", absl::StrCat(p.group.rank)},
             {"size", absl::StrCat(p.group.size)}},
            1);
      }
      for (const ClientView& c : p.clients) {
        if (!client_series_) break;
        Add(mapped,
            {{"device", build_.device},
             {"pool", p.name},
             {"client", c.id},
             {"pid", absl::StrCat(c.pid)},
             {"uid", absl::StrCat(c.uid)},
             {"name", c.name}},
            static_cast<double>(c.mapped_bytes));
      }
    }
    for (auto* f :
         {&committed_bytes, &reserved_bytes, &committed_blocks, &capacity_blocks, &state, &missing, &clients, &pending,
          &held, &group, &mapped, &priority, &min_bytes, &max_bytes, &reclaim_asked, &pool_waiting}) {
      out.push_back(std::move(*f));
    }
    CollectLimits(out);
    return out;
  }

 private:
  // The arbiter's gauges and counters (docs/metrics.md, "Arbitration").
  void CollectArbitration(std::vector<prometheus::MetricFamily>& out) const {
    const ArbiterStats a = manager_->ArbitrationStats();
    const std::vector<prometheus::ClientMetric::Label> device = {{"device", build_.device}};
    prometheus::MetricFamily waiting = Gauge("kvd_waiting_requests", "Grows and wakes waiting for memory now.");
    prometheus::MetricFamily waiting_bytes = Gauge("kvd_waiting_bytes", "The bytes the waiting requests ask for.");
    prometheus::MetricFamily longest =
        Gauge("kvd_waiting_longest_seconds", "How long the longest-waiting request has waited; 0: none waits.");
    prometheus::MetricFamily pressure =
        Counter("kvd_memory_pressure_seconds_total",
                "Time during which at least one grow or wake was waiting for memory (cf. Linux PSI).");
    prometheus::MetricFamily under_way = Gauge("kvd_reclaims_under_way", "Reclaims asked and not yet ended.");
    prometheus::MetricFamily reclaims =
        Counter("kvd_reclaims_total",
                "Ended reclaims by outcome: gave, declined, timed_out, no_answer (nobody attached), gone (the pool was "
                "deleted), called_off (the waiting grow ended first).");
    prometheus::MetricFamily actions = Counter(
        "kvd_reclaim_actions_total",
        "Deadline actions of the pools' policies (on_reclaim_timeout) by what they did: shrink, sleep, shrink_failed, "
        "sleep_failed, shrink_unreported (the engine reported no usage to shrink to).");
    prometheus::MetricFamily asked = Counter("kvd_reclaim_asked_bytes_total", "Bytes reclaims asked pools for.");
    prometheus::MetricFamily given =
        Counter("kvd_reclaim_given_bytes_total", "Bytes pools gave back to reclaims (by their engine or the policy).");
    prometheus::MetricFamily refused = Counter("kvd_admission_refusals_total",
                                               "Creates, grows and wakes that did not ask to wait refused for want of "
                                               "memory (failed waits: kvd_wait_seconds).");
    prometheus::MetricFamily device_refused =
        Counter("kvd_admission_device_refusals_total",
                "Admission refusals because the device could not back the memory (its free bytes less the headroom).");
    prometheus::MetricFamily oom = Counter(
        "kvd_driver_out_of_memory_total",
        "Memory the driver refused after admission let it through (another process took it between the look and the "
        "creation); the request failed RESOURCE_EXHAUSTED.");
    Add(waiting, device, static_cast<double>(a.waiting));
    Add(waiting_bytes, device, static_cast<double>(a.waiting_bytes));
    Add(longest, device, absl::ToDoubleSeconds(a.longest_wait));
    Count(pressure, device, absl::ToDoubleSeconds(a.pressure));
    Add(under_way, device, static_cast<double>(a.reclaims_under_way));
    for (const char* outcome : {"gave", "declined", "timed_out", "no_answer", "gone", "called_off"}) {
      auto it = a.reclaims.find(outcome);
      Count(reclaims, {{"device", build_.device}, {"outcome", outcome}},
            static_cast<double>(it == a.reclaims.end() ? 0 : it->second));
    }
    for (const char* action : {"shrink", "sleep", "shrink_failed", "sleep_failed", "shrink_unreported"}) {
      auto it = a.actions.find(action);
      Count(actions, {{"device", build_.device}, {"action", action}},
            static_cast<double>(it == a.actions.end() ? 0 : it->second));
    }
    Count(asked, device, static_cast<double>(a.asked_bytes));
    Count(given, device, static_cast<double>(a.given_bytes));
    Count(refused, device, static_cast<double>(a.refused_for_memory));
    Count(device_refused, device, static_cast<double>(a.device_refusals));
    Count(oom, device, static_cast<double>(a.driver_out_of_memory));
    for (auto* f : {&waiting, &waiting_bytes, &longest, &pressure, &under_way, &reclaims, &actions, &asked, &given,
                    &refused, &device_refused, &oom}) {
      out.push_back(std::move(*f));
    }
  }

  // kvd_limit, kvd_tenant_* and kvd_limit_refusals_total (docs/metrics.md, "Limits").
  void CollectLimits(std::vector<prometheus::MetricFamily>& out) const {
    std::vector<LimitValue> limits;
    std::function<ConnectionUsage()> channel;
    {
      absl::MutexLock lock(&mu_);
      limits = limits_;
      channel = channel_;
    }
    const ConnectionUsage connections = channel ? channel() : ConnectionUsage{};
    const SocketUsage& handles = connections.handle_channel;
    const SocketUsage& controls = connections.control_socket;
    prometheus::MetricFamily limit =
        Gauge("kvd_limit", "The value of each limit flag (label limit: the flag without --); docs/operations.md.");
    for (const LimitValue& l : limits) {
      Add(limit, {{"device", build_.device}, {"limit", l.limit}}, static_cast<double>(l.value));
    }
    out.push_back(std::move(limit));

    const TenantUsage usage = manager_->Usage();
    const auto by_uid = [&](std::string name, std::string help, const std::map<uint32_t, uint64_t>& values) {
      prometheus::MetricFamily family = Gauge(std::move(name), std::move(help));
      for (const auto& [uid, value] : values) {
        Add(family, {{"device", build_.device}, {"uid", absl::StrCat(uid)}}, static_cast<double>(value));
      }
      out.push_back(std::move(family));
    };
    by_uid("kvd_tenant_pools", "Pools owned by the uid (--max-pools-per-uid, --max-pools).", usage.pools);
    by_uid("kvd_tenant_reserved_bytes",
           "Address space reserved by the uid's pools (--max-reserved-per-uid, --max-reserved).", usage.reserved_bytes);
    by_uid("kvd_tenant_sessions", "Open sessions of the uid (--max-sessions-per-uid, --max-sessions).", usage.sessions);
    if (channel) {
      by_uid("kvd_tenant_handle_connections",
             "Open handle-channel connections of the uid (--max-handle-connections-per-uid, "
             "--max-handle-connections).",
             handles.connections_by_uid);
      by_uid("kvd_tenant_control_connections",
             "Open gRPC control-socket connections of the uid (--max-control-connections-per-uid, "
             "--max-control-connections).",
             controls.connections_by_uid);
    }

    prometheus::MetricFamily refusals;
    refusals.name = "kvd_limit_refusals_total";
    refusals.help = "Requests refused with RESOURCE_EXHAUSTED by each limit (label limit: the flag without --).";
    refusals.type = prometheus::MetricType::Counter;
    const auto count = [&](absl::string_view flag, uint64_t value) {
      prometheus::ClientMetric m;
      m.label = {{"device", build_.device}, {"limit", std::string(absl::StripPrefix(flag, "--"))}};
      m.counter.value = static_cast<double>(value);
      refusals.metric.push_back(std::move(m));
    };
    for (const auto& [flag, value] : manager_->LimitRefusals()) count(flag, value);
    count("--max-handle-connections", handles.refused_total);
    count("--max-handle-connections-per-uid", handles.refused_per_uid);
    count("--max-control-connections", controls.refused_total);
    count("--max-control-connections-per-uid", controls.refused_per_uid);
    out.push_back(std::move(refusals));
  }

  const PoolManager* const manager_;
  const BuildInfo build_;
  const bool client_series_;
  mutable absl::Mutex mu_;
  std::vector<LimitValue> limits_ ABSL_GUARDED_BY(mu_);
  std::function<ConnectionUsage()> channel_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

const char* OperationName(Operation op) {
  switch (op) {
    case Operation::kGrow:
      return "grow";
    case Operation::kShrink:
      return "shrink";
    case Operation::kSleep:
      return "sleep";
    case Operation::kWake:
      return "wake";
    case Operation::kAttach:
      return "attach";
    case Operation::kCompact:
      return "compact";
  }
  return "unknown";
}

struct Metrics::Impl {
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  std::shared_ptr<SnapshotCollector> snapshots;
  prometheus::Family<prometheus::Counter>* operations = nullptr;
  prometheus::Family<prometheus::Histogram>* durations = nullptr;
  prometheus::Family<prometheus::Counter>* rpcs = nullptr;
  // Pre-created so every op has series (at 0) from the start; indexed by Operation.
  std::array<prometheus::Counter*, kOperations.size()> ok{};
  std::array<prometheus::Counter*, kOperations.size()> failed{};
  std::array<prometheus::Histogram*, kOperations.size()> duration{};
  prometheus::Histogram* pause = nullptr;
  prometheus::Counter* copied_bytes = nullptr;
  prometheus::Counter* chunks_replaced = nullptr;
  prometheus::Family<prometheus::Histogram>* reclaim_seconds = nullptr;
  prometheus::Family<prometheus::Histogram>* wait_seconds = nullptr;
  // Declared last: destroyed first, so no scrape runs while the rest goes away.
  std::unique_ptr<prometheus::Exposer> exposer;
};

Metrics::Metrics(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Metrics::~Metrics() = default;

absl::StatusOr<std::unique_ptr<Metrics>> Metrics::Serve(const std::string& address, const PoolManager* manager,
                                                        BuildInfo build, bool client_series) {
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || colon == 0 || !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics-address: \"", address, "\" is not HOST:PORT (e.g. 127.0.0.1:9400)"));
  }

  auto impl = std::make_unique<Impl>();
  // Every series carries the device, like the snapshot gauges.
  const prometheus::Labels device = {{"device", build.device}};
  impl->snapshots = std::make_shared<SnapshotCollector>(manager, std::move(build), client_series);
  impl->operations = &prometheus::BuildCounter()
                          .Name("kvd_operations_total")
                          .Help("Pool operations (grow, shrink, sleep, wake, attach, compact) by result (ok, error).")
                          .Labels(device)
                          .Register(*impl->registry);
  impl->durations = &prometheus::BuildHistogram()
                         .Name("kvd_operation_duration_seconds")
                         .Help("Time one pool operation took in the core, successful or not.")
                         .Labels(device)
                         .Register(*impl->registry);
  impl->rpcs = &prometheus::BuildCounter()
                    .Name("kvd_rpc_requests_total")
                    .Help("Finished gRPC requests by method and status code.")
                    .Labels(device)
                    .Register(*impl->registry);
  for (size_t i = 0; i < kOperations.size(); ++i) {
    const std::string op = OperationName(kOperations[i]);
    impl->ok[i] = &impl->operations->Add({{"op", op}, {"result", "ok"}});
    impl->failed[i] = &impl->operations->Add({{"op", op}, {"result", "error"}});
    impl->duration[i] = &impl->durations->Add({{"op", op}}, DurationBuckets());
  }
  impl->pause = &prometheus::BuildHistogram()
                     .Name("kvd_pause_seconds")
                     .Help("How long the attached clients were paused for a shrink or compact that moved bytes.")
                     .Labels(device)
                     .Register(*impl->registry)
                     .Add({}, DurationBuckets());
  impl->copied_bytes = &prometheus::BuildCounter()
                            .Name("kvd_reshape_copied_bytes_total")
                            .Help("Bytes copied on the device into new chunks by shrinks and compactions.")
                            .Labels(device)
                            .Register(*impl->registry)
                            .Add({});
  impl->chunks_replaced = &prometheus::BuildCounter()
                               .Name("kvd_reshape_chunks_replaced_total")
                               .Help("Chunks whose bytes shrinks and compactions moved into new chunks.")
                               .Labels(device)
                               .Register(*impl->registry)
                               .Add({});

  impl->reclaim_seconds = &prometheus::BuildHistogram()
                               .Name("kvd_reclaim_seconds")
                               .Help("From a reclaim's RECLAIM event to its end, by outcome (as kvd_reclaims_total).")
                               .Labels(device)
                               .Register(*impl->registry);
  impl->wait_seconds = &prometheus::BuildHistogram()
                            .Name("kvd_wait_seconds")
                            .Help("How long grows and wakes waited for memory, by result: ok (served), failed.")
                            .Labels(device)
                            .Register(*impl->registry);
  for (const char* result : {"ok", "failed"}) impl->wait_seconds->Add({{"result", result}}, DurationBuckets());

  // prometheus-cpp reports a failed bind (civetweb) by throwing; this is the one place it is caught.
  try {
    impl->exposer = std::make_unique<prometheus::Exposer>(address, 2);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("--metrics-address=", address, ": cannot listen: ", e.what()));
  }
  impl->exposer->RegisterCollectable(impl->registry);
  impl->exposer->RegisterCollectable(impl->snapshots);
  return std::unique_ptr<Metrics>(new Metrics(std::move(impl)));
}

int Metrics::port() const {
  const std::vector<int> ports = impl_->exposer->GetListeningPorts();
  return ports.empty() ? 0 : ports.front();
}

void Metrics::SetLimits(std::vector<LimitValue> limits, std::function<ConnectionUsage()> channel) {
  impl_->snapshots->SetLimits(std::move(limits), std::move(channel));
}

void Metrics::CountRpc(absl::string_view method, absl::StatusCode code) {
  impl_->rpcs->Add({{"method", std::string(method)}, {"code", absl::StatusCodeToString(code)}}).Increment();
}

void Metrics::ObserveReshape(absl::Duration pause, bool paused, uint64_t copied_bytes, uint64_t chunks_replaced) {
  if (paused) impl_->pause->Observe(absl::ToDoubleSeconds(pause));
  impl_->copied_bytes->Increment(static_cast<double>(copied_bytes));
  impl_->chunks_replaced->Increment(static_cast<double>(chunks_replaced));
}

void Metrics::ObserveArbitration(const ArbiterEvent& event) {
  const double seconds = absl::ToDoubleSeconds(event.elapsed);
  if (event.kind == ArbiterEvent::Kind::kReclaimEnded) {
    impl_->reclaim_seconds->Add({{"outcome", event.outcome}}, DurationBuckets()).Observe(seconds);
  } else {
    impl_->wait_seconds->Add({{"result", event.outcome}}, DurationBuckets()).Observe(seconds);
  }
}

void Metrics::ObserveOperation(Operation op, absl::Duration elapsed, bool ok) {
  const size_t i = static_cast<size_t>(op);
  if (i >= kOperations.size()) return;
  (ok ? impl_->ok[i] : impl_->failed[i])->Increment();
  impl_->duration[i]->Observe(absl::ToDoubleSeconds(elapsed));
}

}  // namespace kvd::daemon
