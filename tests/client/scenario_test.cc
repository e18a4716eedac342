// The client scenarios (tests/client/scenarios/*.json, schema scenario.proto) run with libkvd: one ctest
// test per file. tests/client/python/scenario_test.py runs the same files with the Python package, so
// both clients are held to one behaviour.
//
// Each scenario starts its own daemons (real kvd processes on the host backend, sockets in one fresh
// directory) and runs its steps in order. A step's outcome (a status, and what the step observed: a
// pool, a mapping, a change) is compared with the step's `expect`. Waits ("eventually") are bounded
// polls of a condition; nothing asserts on wall-clock time.
#include <signal.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "kvd/client.h"
#include "kvd/group.h"
#include "kvd/status.h"
#include "scenario.pb.h"
#include "tests/testing/kvd_process.h"

#ifndef KVD_BINARY
#define KVD_BINARY "kvd"
#endif
#ifndef KVD_SCENARIO_DIR
#define KVD_SCENARIO_DIR "tests/client/scenarios"
#endif

namespace kvd {
namespace {

constexpr absl::Duration kEventually = absl::Seconds(20);

std::vector<std::string> ScenarioNames() {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(KVD_SCENARIO_DIR)) {
    if (e.path().extension() == ".json") names.push_back(e.path().stem().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

absl::StatusOr<scenario::Scenario> LoadScenario(const std::string& name) {
  const std::string path = absl::StrCat(KVD_SCENARIO_DIR, "/", name, ".json");
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream text;
  text << in.rdbuf();
  scenario::Scenario s;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  const auto parsed = google::protobuf::util::JsonStringToMessage(text.str(), &s, options);
  if (!parsed.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", parsed.ToString()));
  return s;
}

// The pattern byte of (seed, layer, block): never zero, so fresh (zeroed) memory never passes for it.
uint8_t PatternByte(uint32_t seed, uint64_t layer, uint64_t block) {
  return static_cast<uint8_t>((seed * 131 + layer * 31 + block * 7) % 251 + 1);
}

// The first byte of element (b, h, n, c) of a layer view.
uint8_t* At(const LayerView& v, uint64_t b, uint64_t h, uint64_t n, uint64_t c) {
  return static_cast<uint8_t*>(v.data) + b * v.stride_b + h * v.stride_h + n * v.stride_n + c * v.stride_c;
}

const char* MappingStateName(Mapping::State s) {
  switch (s) {
    case Mapping::State::kAwake:
      return "awake";
    case Mapping::State::kSleeping:
      return "sleeping";
    case Mapping::State::kLost:
      return "lost";
  }
  return "unknown";
}

// What a Mapping's callbacks reported.
struct Recorder {
  absl::Mutex mu;
  uint32_t grows ABSL_GUARDED_BY(mu) = 0;
  uint32_t releases ABSL_GUARDED_BY(mu) = 0;
  uint32_t lost ABSL_GUARDED_BY(mu) = 0;
  uint32_t restarts ABSL_GUARDED_BY(mu) = 0;
  uint32_t pauses ABSL_GUARDED_BY(mu) = 0;
  uint32_t resumes ABSL_GUARDED_BY(mu) = 0;
  bool resume_applied ABSL_GUARDED_BY(mu) = false;
  DaemonRestart restart ABSL_GUARDED_BY(mu);
  bool called ABSL_GUARDED_BY(mu) = false;
  uint64_t blocks ABSL_GUARDED_BY(mu) = 0;
  absl::Status why ABSL_GUARDED_BY(mu);
};

void ObservePool(const PoolInfo& p, scenario::Expect* o) {
  o->set_committed_blocks(p.committed_blocks);
  o->set_state(PoolStateName(p.state));
  o->set_pending_release_bytes(p.pending_release_bytes);
  o->set_clients(p.client_count);
  o->set_held(!p.transaction.empty());
  o->set_layout(p.layout.layout);
  o->set_rule(p.layout.rule);
  for (const std::string& w : p.layout.warnings) o->add_warnings_contain(w);
}

void ObserveReshape(const PoolChange& c, scenario::Expect* o) {
  if (!c.reshape.has_value()) return;
  o->set_target_reached(c.reshape->target_reached);
  o->set_chunks_before(c.reshape->chunks_before);
  o->set_chunks_after(c.reshape->chunks_after);
  o->set_paused_clients(c.reshape->paused_clients);
}

PauseOptions ToPause(const scenario::Step& step) {
  return PauseOptions{.timeout = absl::Milliseconds(step.pause_timeout_ms()),
                      .detach_unresponsive = step.detach_unresponsive()};
}

// Ranks or updates that agree on their pool's blocks and state report them once.
void ObservePools(const std::vector<PoolChange>& changes, scenario::Expect* o) {
  if (changes.empty()) return;
  const PoolInfo& first = changes.front().pool;
  bool same = true;
  for (const PoolChange& c : changes)
    same &= c.pool.committed_blocks == first.committed_blocks && c.pool.state == first.state;
  if (!same) return;
  o->set_committed_blocks(first.committed_blocks);
  o->set_state(PoolStateName(first.state));
}

// Compares the observation with the expectation: every field set in `want` must be set in `got` and
// equal; the *_contain(s) fields must each be a substring of one observed entry.
std::vector<std::string> Mismatches(const scenario::Expect& want, const scenario::Expect& got) {
  using google::protobuf::FieldDescriptor;
  std::vector<std::string> out;
  const google::protobuf::Descriptor* d = scenario::Expect::descriptor();
  const google::protobuf::Reflection* r = scenario::Expect::GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    if (f->name() == "code" || f->name() == "message_contains") continue;
    if (f->is_repeated()) {
      for (int j = 0; j < r->FieldSize(want, f); ++j) {
        const std::string needle = r->GetRepeatedString(want, f, j);
        bool found = false;
        for (int k = 0; k < r->FieldSize(got, f); ++k)
          found |= absl::StrContains(r->GetRepeatedString(got, f, k), needle);
        if (!found) out.push_back(absl::StrCat(f->name(), ": no entry contains \"", needle, "\""));
      }
      continue;
    }
    if (!r->HasField(want, f)) continue;
    if (!r->HasField(got, f)) {
      out.push_back(absl::StrCat(f->name(), ": not observed by this step"));
      continue;
    }
    std::string w, g;
    switch (f->cpp_type()) {
      case FieldDescriptor::CPPTYPE_UINT64:
        w = absl::StrCat(r->GetUInt64(want, f));
        g = absl::StrCat(r->GetUInt64(got, f));
        break;
      case FieldDescriptor::CPPTYPE_UINT32:
        w = absl::StrCat(r->GetUInt32(want, f));
        g = absl::StrCat(r->GetUInt32(got, f));
        break;
      case FieldDescriptor::CPPTYPE_BOOL:
        w = r->GetBool(want, f) ? "true" : "false";
        g = r->GetBool(got, f) ? "true" : "false";
        break;
      default:
        w = r->GetString(want, f);
        g = r->GetString(got, f);
        break;
    }
    if (w != g) out.push_back(absl::StrCat(f->name(), ": expected ", w, ", got ", g));
  }
  return out;
}

// One run of one scenario.
class ScenarioRun {
 public:
  explicit ScenarioRun(scenario::Scenario s) : scenario_(std::move(s)) {}
  ~ScenarioRun() {
    // Mappings and groups before their clients' daemons go.
    groups_.clear();
    mappings_.clear();
    clients_.clear();
  }

  absl::Status StartDaemons() {
    for (int i = 0; i < scenario_.daemons_size(); ++i) {
      auto d = std::make_unique<::kvd::testing::KvdProcess>();
      std::vector<std::string> args(scenario_.daemons(i).args().begin(), scenario_.daemons(i).args().end());
      KVD_RETURN_IF_ERROR(d->Start(KVD_BINARY, i, args, daemons_.empty() ? "" : daemons_.front()->dir()));
      daemons_.push_back(std::move(d));
    }
    for (const auto& d : daemons_) {
      KVD_ASSIGN_OR_RETURN(std::unique_ptr<Client> c, Client::Connect({.socket = d->socket()}));
      KVD_ASSIGN_OR_RETURN(DeviceStatus info, c->DeviceInfo());
      uuids_.push_back(info.uuid);
    }
    return absl::OkStatus();
  }

  // Runs every step; returns one line per failed expectation.
  std::vector<std::string> Steps() {
    std::vector<std::string> failures;
    for (int i = 0; i < scenario_.steps_size(); ++i) {
      const scenario::Step& step = scenario_.steps(i);
      const std::string where =
          absl::StrCat("step ", i, " (", step.op(), step.note().empty() ? "" : ": ", step.note(), ")");
      std::vector<std::string> bad = RunStep(step);
      for (const std::string& b : bad) failures.push_back(absl::StrCat(where, ": ", b));
      if (!bad.empty()) break;  // later steps build on this one
    }
    return failures;
  }

  std::string Logs() const {
    std::string out;
    for (const auto& d : daemons_) absl::StrAppend(&out, d->log());
    return out;
  }

 private:
  struct Attached {
    std::shared_ptr<Recorder> recorder;
    std::unique_ptr<Mapping> mapping;
  };

  std::string Expand(const std::string& s) const {
    std::string out = s;
    for (size_t i = 0; i < uuids_.size(); ++i) {
      out = absl::StrReplaceAll(out, {{absl::StrCat("${uuid:", i, "}"), uuids_[i]}});
    }
    if (!uuids_.empty()) {
      std::string family = uuids_.front();
      while (!family.empty() && absl::ascii_isdigit(family.back())) family.pop_back();
      out = absl::StrReplaceAll(out, {{"${uuid_family}", family}});
    }
    return out;
  }

  std::string Dir() const { return daemons_.front()->dir(); }

  // A transaction prepared earlier in the scenario; an unknown name is one no daemon issued.
  std::string Txn(const scenario::Step& step) const {
    auto it = txns_.find(step.txn());
    return it == txns_.end() ? "t-unknown" : it->second;
  }

  Client* ClientOf(const scenario::Step& step) {
    auto it = clients_.find(step.client());
    return it == clients_.end() ? nullptr : it->second.get();
  }

  static LayoutRequest ToLayout(const scenario::Layout& l) {
    LayoutRequest r;
    r.override_layout = l.override_layout();
    for (const auto& req : l.backend_requirements()) {
      r.backend_requirements.push_back({req.backend(), {req.layouts().begin(), req.layouts().end()}});
    }
    for (const auto& p : l.connector_preferences()) r.connector_preferences.push_back({p.connector(), p.layout()});
    if (l.has_env_layout()) {
      r.env_layout_set = true;
      r.env_layout = l.env_layout();
    }
    return r;
  }

  static PoolDims ToDims(const scenario::Dims& d) {
    return PoolDims{.layers = d.layers(),
                    .capacity_blocks = d.capacity_blocks(),
                    .heads = d.heads(),
                    .block_tokens = d.block_tokens(),
                    .channels = d.channels(),
                    .element_bytes = d.element_bytes()};
  }

  static void ObserveMapping(const Attached& a, scenario::Expect* o) {
    const Mapping& m = *a.mapping;
    o->set_committed_blocks(m.committed_blocks());
    o->set_state(MappingStateName(m.state()));
    o->set_mapped_chunks(static_cast<uint32_t>(m.chunks().size()));
    o->set_epoch(m.epoch());
    o->set_layout(m.layout().layout);
    o->set_rule(m.layout().rule);
    for (const std::string& w : m.layout().warnings) o->add_warnings_contain(w);
    absl::MutexLock lock(&a.recorder->mu);
    o->set_on_grow(a.recorder->grows);
    o->set_on_release(a.recorder->releases);
    o->set_on_lost(a.recorder->lost);
    o->set_on_restart(a.recorder->restarts);
    o->set_on_pause(a.recorder->pauses);
    o->set_on_resume(a.recorder->resumes);
    if (a.recorder->resumes > 0) o->set_resume_applied(a.recorder->resume_applied);
    if (a.recorder->restarts > 0) {
      o->set_restart_epoch(a.recorder->restart.epoch);
      o->set_lost_chunks(static_cast<uint32_t>(a.recorder->restart.lost_chunk_ids.size()));
      o->set_returned_chunks(static_cast<uint32_t>(a.recorder->restart.returned_chunk_ids.size()));
    }
    if (a.recorder->called) o->set_callback_blocks(a.recorder->blocks);
    if (a.recorder->lost > 0) {
      o->set_lost_code(absl::StatusCodeToString(a.recorder->why.code()));
      o->add_lost_message_contains(std::string(a.recorder->why.message()));
    }
  }

  // Runs the step once: its status, and what it observed.
  absl::Status Execute(const scenario::Step& step, scenario::Expect* o) {
    const std::string& op = step.op();
    if (op == "connect") {
      if (step.socket().empty() && step.daemon() >= daemons_.size()) return absl::InternalError("no such daemon");
      const std::string socket =
          step.socket().empty() ? daemons_[step.daemon()]->socket() : absl::StrCat(Dir(), "/", step.socket());
      KVD_ASSIGN_OR_RETURN(std::unique_ptr<Client> c,
                           Client::Connect({.socket = socket, .client_name = step.client_name()}));
      clients_[step.client()] = std::move(c);
      return absl::OkStatus();
    }
    if (op == "stop_daemon") {
      ::kvd::testing::KvdProcess& d = *daemons_.at(step.daemon());
      if (step.kill()) {
        d.Kill();
      } else {
        d.Terminate();
      }
      return absl::OkStatus();
    }
    if (op == "restart_daemon") return daemons_.at(step.daemon())->Restart();
    if (op == "find_socket") {
      KVD_ASSIGN_OR_RETURN(std::string socket, FindSocket(Expand(step.device()), Dir()));
      for (size_t i = 0; i < daemons_.size(); ++i) {
        if (daemons_[i]->socket() == socket) o->set_daemon(static_cast<uint32_t>(i));
      }
      return absl::OkStatus();
    }
    if (op == "write_pattern" || op == "check_pattern") return Pattern(step);
    if (op == "mapping") {
      auto it = mappings_.find(step.mapping());
      if (it == mappings_.end()) return absl::InternalError(absl::StrCat("no mapping ", step.mapping()));
      ObserveMapping(it->second, o);
      return absl::OkStatus();
    }
    if (op == "detach") {
      if (mappings_.erase(step.mapping()) == 0) return absl::InternalError(absl::StrCat("no mapping ", step.mapping()));
      return absl::OkStatus();
    }
    if (op.rfind("group_", 0) == 0) return GroupStep(step, o);

    Client* c = ClientOf(step);
    if (c == nullptr) return absl::InternalError(absl::StrCat("no client \"", step.client(), "\""));
    if (op == "disconnect") {
      // The client and every mapping made through it.
      for (const std::string& name : owned_[step.client()]) mappings_.erase(name);
      owned_.erase(step.client());
      clients_.erase(step.client());
      return absl::OkStatus();
    }
    if (op == "device_info") {
      KVD_ASSIGN_OR_RETURN(DeviceStatus d, c->DeviceInfo());
      o->set_pools(d.pool_count);
      o->set_epoch(d.epoch);
      return absl::OkStatus();
    }
    if (op == "list_pools") {
      KVD_ASSIGN_OR_RETURN(std::vector<PoolInfo> pools, c->ListPools());
      o->set_pools(static_cast<uint32_t>(pools.size()));
      return absl::OkStatus();
    }
    if (op == "create_pool") {
      PoolOptions p{.name = step.pool(), .dims = ToDims(step.dims()), .initial_blocks = step.initial_blocks()};
      p.layout = ToLayout(step.layout());
      if (step.has_membership()) {
        p.group = {
            .name = step.membership().name(), .rank = step.membership().rank(), .size = step.membership().size()};
      }
      for (const std::string& d : step.peer_devices()) p.peer_devices.push_back(Expand(d));
      KVD_ASSIGN_OR_RETURN(PoolInfo pool, c->CreatePool(p));
      ObservePool(pool, o);
      return absl::OkStatus();
    }
    if (op == "get_pool") {
      KVD_ASSIGN_OR_RETURN(PoolInfo pool, c->GetPool(step.pool()));
      ObservePool(pool, o);
      o->set_pausable_clients(static_cast<uint32_t>(
          std::count_if(pool.clients.begin(), pool.clients.end(), [](const ClientInfo& ci) { return ci.pausable; })));
      o->set_chunks(static_cast<uint32_t>(pool.chunks.size()));
      return absl::OkStatus();
    }
    if (op == "delete_pool") {
      KVD_ASSIGN_OR_RETURN(uint64_t released, c->DeletePool(step.pool(), step.force()));
      o->set_released_bytes(released);
      return absl::OkStatus();
    }
    if (op == "resolve_layout") {
      PoolDims dims = ToDims(step.dims());
      KVD_ASSIGN_OR_RETURN(ResolvedLayout r,
                           c->ResolveLayout(ToLayout(step.layout()), step.has_dims() ? &dims : nullptr));
      o->set_layout(r.resolution.layout);
      o->set_rule(r.resolution.rule);
      for (const std::string& w : r.resolution.warnings) o->add_warnings_contain(w);
      o->set_has_geometry(r.has_geometry);
      return absl::OkStatus();
    }
    if (op == "attach") {
      Attached a{.recorder = std::make_shared<Recorder>()};
      AttachOptions options;
      options.client_name = step.client_name();
      options.device = Expand(step.device());
      options.on_grow = [r = a.recorder](uint64_t blocks) {
        absl::MutexLock lock(&r->mu);
        ++r->grows;
        r->called = true;
        r->blocks = blocks;
      };
      options.on_release = [r = a.recorder](uint64_t blocks) {
        absl::MutexLock lock(&r->mu);
        ++r->releases;
        r->called = true;
        r->blocks = blocks;
      };
      options.on_lost = [r = a.recorder](const absl::Status& why) {
        absl::MutexLock lock(&r->mu);
        ++r->lost;
        r->why = why;
      };
      options.on_restart = [r = a.recorder](const DaemonRestart& restart) {
        absl::MutexLock lock(&r->mu);
        ++r->restarts;
        r->restart = restart;
      };
      if (step.pausable()) {
        options.on_pause = [r = a.recorder](const std::vector<ByteRange>&) {
          absl::MutexLock lock(&r->mu);
          ++r->pauses;
        };
        options.on_resume = [r = a.recorder](bool applied) {
          absl::MutexLock lock(&r->mu);
          ++r->resumes;
          r->resume_applied = applied;
        };
      }
      KVD_ASSIGN_OR_RETURN(a.mapping, c->Attach(step.pool(), std::move(options)));
      ObserveMapping(a, o);
      mappings_[step.mapping()] = std::move(a);
      owned_[step.client()].push_back(step.mapping());
      return absl::OkStatus();
    }
    if (op == "grow") {
      KVD_ASSIGN_OR_RETURN(PoolChange change, c->Grow(step.pool(), step.blocks()));
      ObservePool(change.pool, o);
      return absl::OkStatus();
    }
    if (op == "shrink") {
      KVD_ASSIGN_OR_RETURN(PoolChange change, c->Shrink(step.pool(), step.blocks(),
                                                        ShrinkOptions{.wait = step.wait(),
                                                                      .whole_chunks_only = step.whole_chunks_only(),
                                                                      .pause = ToPause(step)}));
      ObservePool(change.pool, o);
      ObserveReshape(change, o);
      return absl::OkStatus();
    }
    if (op == "compact") {
      KVD_ASSIGN_OR_RETURN(PoolChange change, c->Compact(step.pool(), {.pause = ToPause(step)}));
      ObservePool(change.pool, o);
      ObserveReshape(change, o);
      return absl::OkStatus();
    }
    if (op == "sleep" || op == "wake") {
      KVD_ASSIGN_OR_RETURN(std::vector<PoolChange> changes,
                           op == "sleep" ? c->Sleep(step.pool(), step.wait()) : c->Wake(step.pool()));
      o->set_pools(static_cast<uint32_t>(changes.size()));
      ObservePools(changes, o);
      return absl::OkStatus();
    }
    if (op == "grant") {
      KVD_ASSIGN_OR_RETURN(PoolInfo pool, c->GrantPeerAccess(step.pool(), Expand(step.device()), step.revoke()));
      ObservePool(pool, o);
      return absl::OkStatus();
    }
    if (op == "prepare") {
      static const std::map<std::string, GroupOp> kOps = {
          {"grow", GroupOp::kGrow}, {"shrink", GroupOp::kShrink}, {"sleep", GroupOp::kSleep}, {"wake", GroupOp::kWake}};
      auto what = kOps.find(step.operation());
      if (what == kOps.end()) return absl::InternalError(absl::StrCat("no operation \"", step.operation(), "\""));
      KVD_ASSIGN_OR_RETURN(PreparedChange p, c->Prepare(step.pool(), what->second, step.blocks(), absl::Seconds(30)));
      txns_[step.txn()] = p.transaction;
      o->set_prepared_bytes(p.prepared_bytes);
      ObservePool(p.pool, o);
      return absl::OkStatus();
    }
    if (op == "commit") {
      KVD_ASSIGN_OR_RETURN(PoolChange change, c->Commit(Txn(step), step.wait()));
      ObservePool(change.pool, o);
      return absl::OkStatus();
    }
    if (op == "abort") {
      KVD_ASSIGN_OR_RETURN(uint64_t released, c->Abort(Txn(step)));
      o->set_released_bytes(released);
      return absl::OkStatus();
    }
    return absl::InternalError(absl::StrCat("unknown op \"", op, "\""));
  }

  absl::Status GroupStep(const scenario::Step& step, scenario::Expect* o) {
    const std::string& op = step.op();
    if (op == "group_open") {
      std::vector<std::string> sockets;
      for (uint32_t d : step.daemons()) sockets.push_back(daemons_.at(d)->socket());
      GroupOptions options;
      options.connect.timeout = absl::Seconds(5);
      options.before_commit = [this] {
        if (kill_before_commit_.has_value()) daemons_.at(*kill_before_commit_)->Kill();
        return absl::OkStatus();
      };
      KVD_ASSIGN_OR_RETURN(std::unique_ptr<Group> g, Group::Open(step.group_name(), sockets, options));
      o->set_ranks(static_cast<uint32_t>(g->ranks().size()));
      groups_[step.group()] = std::move(g);
      return absl::OkStatus();
    }
    auto it = groups_.find(step.group());
    if (it == groups_.end()) return absl::InternalError(absl::StrCat("no group ", step.group()));
    Group& g = *it->second;
    kill_before_commit_.reset();
    if (step.has_kill_before_commit()) kill_before_commit_ = step.kill_before_commit();
    absl::StatusOr<GroupChange> change = absl::InternalError(absl::StrCat("unknown op \"", op, "\""));
    if (op == "group_grow") change = g.Grow(step.blocks());
    if (op == "group_shrink") change = g.Shrink(step.blocks(), step.wait());
    if (op == "group_sleep") change = g.Sleep(step.wait());
    if (op == "group_wake") change = g.Wake();
    kill_before_commit_.reset();
    KVD_RETURN_IF_ERROR(change.status());
    o->set_ranks(static_cast<uint32_t>(change->ranks.size()));
    o->set_prepared_bytes(change->prepared_bytes);
    ObservePools(change->ranks, o);
    return absl::OkStatus();
  }

  // write_pattern / check_pattern: the first byte of elements (b, 0, 0, 0) and (b, H-1, N-1, C-1) of
  // every layer of every listed block, through the mapping's layer views.
  absl::Status Pattern(const scenario::Step& step) {
    auto it = mappings_.find(step.mapping());
    if (it == mappings_.end()) return absl::InternalError(absl::StrCat("no mapping ", step.mapping()));
    const Mapping& m = *it->second.mapping;
    const PoolDims& d = m.geometry().dims;
    for (uint64_t l = 0; l < d.layers; ++l) {
      const LayerView v = m.layer(l);
      for (uint64_t b : step.block_ids()) {
        uint8_t* first = At(v, b, 0, 0, 0);
        uint8_t* last = At(v, b, d.heads - 1, d.block_tokens - 1, d.channels - 1);
        const uint8_t want = step.zero() ? 0 : PatternByte(step.seed(), l, b);
        if (step.op() == "write_pattern") {
          *first = *last = want;
        } else if (*first != want || *last != want) {
          return absl::DataLossError(
              absl::StrCat("layer ", l, " block ", b, ": read ", *first, " and ", *last, ", expected ", want));
        }
      }
    }
    return absl::OkStatus();
  }

  std::vector<std::string> Check(const scenario::Step& step, const absl::Status& s, const scenario::Expect& o) {
    const scenario::Expect& want = step.expect();
    const std::string want_code = want.code().empty() ? "OK" : want.code();
    const std::string got_code = absl::StatusCodeToString(s.code());
    if (want_code != got_code) {
      return {absl::StrCat("expected ", want_code, ", got ", s.ToString())};
    }
    std::vector<std::string> bad;
    for (const std::string& m : want.message_contains()) {
      if (!absl::StrContains(s.message(), Expand(m)))
        bad.push_back(absl::StrCat("message \"", s.message(), "\" lacks \"", Expand(m), "\""));
    }
    if (!s.ok()) return bad;
    for (std::string& m : Mismatches(want, o)) bad.push_back(std::move(m));
    return bad;
  }

  std::vector<std::string> RunStep(const scenario::Step& step) {
    const absl::Time deadline = absl::Now() + kEventually;
    while (true) {
      scenario::Expect observed;
      const absl::Status s = Execute(step, &observed);
      std::vector<std::string> bad = Check(step, s, observed);
      if (bad.empty() || !step.eventually() || absl::Now() > deadline) return bad;
      absl::SleepFor(absl::Milliseconds(10));
    }
  }

  const scenario::Scenario scenario_;
  std::vector<std::unique_ptr<::kvd::testing::KvdProcess>> daemons_;
  std::vector<std::string> uuids_;
  std::map<std::string, std::unique_ptr<Client>> clients_;
  std::map<std::string, Attached> mappings_;
  std::map<std::string, std::vector<std::string>> owned_;  // client -> the mappings made through it
  std::map<std::string, std::unique_ptr<Group>> groups_;
  std::map<std::string, std::string> txns_;
  std::optional<uint32_t> kill_before_commit_;
};

class ScenarioTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ScenarioTest, BehavesAsWritten) {
  absl::StatusOr<scenario::Scenario> s = LoadScenario(GetParam());
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_GT(s->steps_size(), 0);
  ScenarioRun run(*std::move(s));
  const absl::Status started = run.StartDaemons();
  ASSERT_TRUE(started.ok()) << started;
  const std::vector<std::string> failures = run.Steps();
  EXPECT_TRUE(failures.empty()) << absl::StrJoin(failures, "\n") << "\n---- kvd logs ----\n" << run.Logs();
}

INSTANTIATE_TEST_SUITE_P(Scenarios, ScenarioTest, ::testing::ValuesIn(ScenarioNames()),
                         [](const ::testing::TestParamInfo<std::string>& param) { return param.param; });

}  // namespace
}  // namespace kvd
