// libFuzzer target: the layout chain, request validation and geometry planning (daemon/core/layout_chain,
// pool_spec, geometry). From fuzzed bytes: a daemon policy, a pool spec (name, dims, layout request,
// group, peers, uids) and device limits go through PlanPool, as CreatePool's do. A refusal must be
// INVALID_ARGUMENT or FAILED_PRECONDITION with a message; a plan must keep the geometry's promises
// (docs/layouts.md): every element inside the reservation, segments granularity-aligned, prefixes that
// back what they say, and chunk plans that tile the grow exactly within the chunk limit.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "daemon/core/geometry.h"
#include "daemon/core/layout.h"
#include "daemon/core/layout_chain.h"
#include "daemon/core/pool_spec.h"

namespace kvd::daemon {
namespace {

// A broken promise: report it and let libFuzzer record the input.
#define KVD_FUZZ_CHECK(cond)                                                  \
  do {                                                                        \
    if (!(cond)) {                                                            \
      std::fprintf(stderr, "%s:%d: broken: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                           \
    }                                                                         \
  } while (0)

// Small values most of the time (where the interesting boundaries are), any uint64_t sometimes.
uint64_t Size(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange<int>(0, 3)) {
    case 0:
      return in.ConsumeIntegralInRange<uint64_t>(0, 16);
    case 1:
      return in.ConsumeIntegralInRange<uint64_t>(0, 4096);
    case 2:
      return uint64_t{1} << in.ConsumeIntegralInRange<int>(0, 63);
    default:
      return in.ConsumeIntegral<uint64_t>();
  }
}

// A layout-ish string: a real layout or class name most of the time, fuzzed text otherwise.
std::string LayoutText(FuzzedDataProvider& in) {
  static const char* const kNames[] = {"LBNHC", "LBHNC",           "BLNHC",           "BLHNC", "LHBNC",
                                       "BHLNC", "block-outermost", "layer-outermost", "any",   "",
                                       "lbnhc", "L B N H C",       "LBNHCX",          "*",     "BLNHC,LBNHC"};
  if (in.ConsumeBool()) return kNames[in.ConsumeIntegralInRange<size_t>(0, std::size(kNames) - 1)];
  return in.ConsumeRandomLengthString(24);
}

void CheckRefusal(const absl::Status& status) {
  KVD_FUZZ_CHECK(status.code() == absl::StatusCode::kInvalidArgument ||
                 status.code() == absl::StatusCode::kFailedPrecondition);
  KVD_FUZZ_CHECK(!status.message().empty());
}

void CheckGeometry(const Geometry& g, const DeviceLimits& limits, FuzzedDataProvider& in) {
  const PoolDims& d = g.dims();
  KVD_FUZZ_CHECK(g.granularity() == limits.granularity);
  KVD_FUZZ_CHECK(g.segments() >= 1);
  KVD_FUZZ_CHECK(g.segment_stride() % g.granularity() == 0);
  KVD_FUZZ_CHECK(g.segment_bytes() <= g.segment_stride());
  KVD_FUZZ_CHECK(g.reserved_bytes() / g.segments() == g.segment_stride());
  KVD_FUZZ_CHECK(g.reserved_bytes() <= limits.max_reserved_bytes);
  // Elements: inside the reservation, and the last byte of each too.
  for (int i = 0; i < 8 && in.remaining_bytes() > 0; ++i) {
    const uint64_t l = in.ConsumeIntegralInRange<uint64_t>(0, d.layers - 1);
    const uint64_t b = in.ConsumeIntegralInRange<uint64_t>(0, d.capacity_blocks - 1);
    const uint64_t h = in.ConsumeIntegralInRange<uint64_t>(0, d.heads - 1);
    const uint64_t n = in.ConsumeIntegralInRange<uint64_t>(0, d.block_tokens - 1);
    const uint64_t c = in.ConsumeIntegralInRange<uint64_t>(0, d.channels - 1);
    const uint64_t at = g.ByteOffset(l, b, h, n, c);
    KVD_FUZZ_CHECK(at <= g.reserved_bytes() - d.element_bytes);
  }
  KVD_FUZZ_CHECK(g.ByteOffset(d.layers - 1, d.capacity_blocks - 1, d.heads - 1, d.block_tokens - 1, d.channels - 1) <=
                 g.reserved_bytes() - d.element_bytes);
  // Prefixes: granularity-rounded, inside a segment, and backing at least what was asked.
  const uint64_t blocks = in.ConsumeIntegralInRange<uint64_t>(0, d.capacity_blocks);
  const uint64_t prefix = g.PrefixBytes(blocks);
  KVD_FUZZ_CHECK(prefix % g.granularity() == 0);
  KVD_FUZZ_CHECK(prefix <= g.segment_stride());
  KVD_FUZZ_CHECK(g.BlocksInPrefix(prefix) >= blocks);
  KVD_FUZZ_CHECK(g.BlocksInPrefix(prefix) <= d.capacity_blocks);
  KVD_FUZZ_CHECK(g.PrefixBytes(d.capacity_blocks) <= g.segment_stride());
  // A grow's chunk plan tiles [prefix, PrefixBytes(target)) of every segment, no chunk over the limit.
  // Plans whose size would be enormous are skipped here: their cost is the request limits' business.
  const uint64_t target = in.ConsumeIntegralInRange<uint64_t>(0, d.capacity_blocks);
  const uint64_t max_chunk = g.granularity() << in.ConsumeIntegralInRange<int>(0, 12);
  if (max_chunk == 0) return;
  const uint64_t end = g.PrefixBytes(target);
  const uint64_t per_segment = end > prefix ? (end - prefix + max_chunk - 1) / max_chunk : 0;
  if (per_segment > 4096 || g.segments() > 4096 || per_segment * g.segments() > 65536) return;
  absl::StatusOr<std::vector<PlannedChunk>> plan = g.PlanGrow(prefix, target, max_chunk);
  if (!plan.ok()) {
    CheckRefusal(plan.status());
    return;
  }
  uint64_t total = 0;
  for (const PlannedChunk& c : *plan) {
    KVD_FUZZ_CHECK(c.bytes > 0 && c.bytes <= max_chunk);
    KVD_FUZZ_CHECK(c.bytes % g.granularity() == 0);
    KVD_FUZZ_CHECK(c.segment < g.segments());
    KVD_FUZZ_CHECK(c.offset >= g.SegmentOffset(c.segment) + prefix);
    KVD_FUZZ_CHECK(c.offset + c.bytes <= g.SegmentOffset(c.segment) + end);
    total += c.bytes;
  }
  KVD_FUZZ_CHECK(total == (end > prefix ? (end - prefix) * g.segments() : 0));
}

}  // namespace
}  // namespace kvd::daemon

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvd::daemon;
  FuzzedDataProvider in(data, size);

  LayoutPolicy policy;
  if (in.ConsumeBool()) {
    if (absl::StatusOr<Layout> l = Layout::Parse(LayoutText(in)); l.ok()) policy.operator_override = *l;
  }
  if (in.ConsumeBool()) {
    if (absl::StatusOr<Layout> l = Layout::Parse(LayoutText(in)); l.ok()) policy.daemon_env = *l;
  }

  PoolSpec spec;
  spec.name = in.ConsumeBool() ? "pool" : in.ConsumeRandomLengthString(80);
  spec.dims = {.layers = Size(in),
               .capacity_blocks = Size(in),
               .heads = Size(in),
               .block_tokens = Size(in),
               .channels = Size(in),
               .element_bytes = Size(in)};
  spec.initial_blocks = Size(in);
  LayoutRequest& request = spec.layout_request;
  if (in.ConsumeBool()) request.override_layout = LayoutText(in);
  for (int i = in.ConsumeIntegralInRange<int>(0, 3); i > 0; --i) {
    BackendRequirement r{.backend = in.ConsumeRandomLengthString(16)};
    for (int j = in.ConsumeIntegralInRange<int>(0, 3); j > 0; --j) r.layouts.push_back(LayoutText(in));
    request.backend_requirements.push_back(std::move(r));
  }
  if (in.ConsumeBool()) request.env_layout = LayoutText(in);
  for (int i = in.ConsumeIntegralInRange<int>(0, 3); i > 0; --i) {
    request.connector_preferences.push_back({.connector = in.ConsumeRandomLengthString(16), .layout = LayoutText(in)});
  }
  for (int i = in.ConsumeIntegralInRange<int>(0, 2); i > 0; --i)
    spec.allowed_uids.push_back(in.ConsumeIntegral<uint32_t>());
  if (in.ConsumeBool()) {
    spec.group = {.name = in.ConsumeRandomLengthString(70),
                  .rank = in.ConsumeIntegral<uint32_t>(),
                  .size = in.ConsumeIntegralInRange<uint32_t>(0, 2048)};
  }
  for (int i = in.ConsumeIntegralInRange<int>(0, 2); i > 0; --i) {
    spec.peer_devices.push_back(in.ConsumeBool() ? "*" : in.ConsumeRandomLengthString(140));
  }
  const DeviceLimits limits{.granularity = uint64_t{4096} << in.ConsumeIntegralInRange<int>(0, 19),
                            .max_reserved_bytes = uint64_t{1} << in.ConsumeIntegralInRange<int>(20, 47)};

  // The chain alone, as ResolveLayout serves it.
  absl::StatusOr<LayoutResolution> resolution = ResolveLayout(request, policy);
  if (!resolution.ok()) {
    CheckRefusal(resolution.status());
  } else {
    KVD_FUZZ_CHECK(resolution->allowed.contains(resolution->layout) ||
                   resolution->rule == LayoutRule::kRequestOverride ||
                   resolution->rule == LayoutRule::kOperatorOverride);
  }

  absl::StatusOr<PoolPlan> plan = PlanPool(spec, policy, limits);
  if (!plan.ok()) {
    CheckRefusal(plan.status());
    return 0;
  }
  KVD_FUZZ_CHECK(resolution.ok() && plan->layout.layout == resolution->layout);
  CheckGeometry(plan->geometry, limits, in);
  return 0;
}
