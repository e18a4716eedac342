// kvd-geometry: resolves a pool's layout through the precedence chain and prints where its bytes
// live under each of the six layouts. The core's demo, and a quick way to check a configuration
// before creating a pool: the daemon makes exactly the same decisions.
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "daemon/core/geometry.h"
#include "daemon/core/layout_chain.h"
#include "daemon/rpc/convert.h"
#include "google/protobuf/util/json_util.h"
#include "kvd/status.h"
#include "kvd/units.h"
#include "kvd/wire.h"

namespace kvd::daemon {
namespace {

struct Flags {
  PoolDims dims{
      .layers = 32, .capacity_blocks = 1000, .heads = 8, .block_tokens = 16, .channels = 128, .element_bytes = 2};
  std::string granularity = "2MiB";
  std::string override_layout;
  std::string operator_override;
  std::string env_layout;
  std::vector<std::string> requirements;  // BACKEND=LAYOUT[,LAYOUT...]
  std::vector<std::string> connectors;    // CONNECTOR=LAYOUT
  bool json = false;
};

absl::StatusOr<LayoutRequest> BuildRequest(const Flags& f) {
  LayoutRequest r{.override_layout = f.override_layout, .env_layout = f.env_layout};
  for (const std::string& req : f.requirements) {
    std::pair<std::string, std::string> kv = absl::StrSplit(req, absl::MaxSplits('=', 1));
    if (kv.second.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("--require: \"", req, "\" is not BACKEND=LAYOUT[,LAYOUT...]"));
    }
    r.backend_requirements.push_back({kv.first, absl::StrSplit(kv.second, ',')});
  }
  for (const std::string& c : f.connectors) {
    std::pair<std::string, std::string> kv = absl::StrSplit(c, absl::MaxSplits('=', 1));
    if (kv.second.empty())
      return absl::InvalidArgumentError(absl::StrCat("--connector: \"", c, "\" is not NAME=LAYOUT"));
    r.connector_preferences.push_back({kv.first, kv.second});
  }
  return r;
}

std::string Json(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, options);
  return out;
}

absl::Status Run(const Flags& f) {
  KVD_ASSIGN_OR_RETURN(uint64_t granularity, ParseBytes(f.granularity, "--granularity"));
  KVD_ASSIGN_OR_RETURN(LayoutRequest request, BuildRequest(f));
  LayoutPolicy policy;
  if (!f.operator_override.empty()) {
    KVD_ASSIGN_OR_RETURN(policy.operator_override, Layout::Parse(f.operator_override, "--operator-override"));
  }
  KVD_ASSIGN_OR_RETURN(LayoutResolution resolution, ResolveLayout(request, policy));
  std::vector<Geometry> geometries;
  for (Layout layout : Layout::All()) {
    KVD_ASSIGN_OR_RETURN(Geometry g, Geometry::Compute(layout, f.dims, granularity));
    geometries.push_back(std::move(g));
  }

  if (f.json) {
    std::vector<std::string> gs;
    for (const Geometry& g : geometries) gs.push_back(Json(ToProto(g)));
    std::cout << "{\"resolution\":" << Json(ToProto(resolution)) << ",\"geometries\":[" << absl::StrJoin(gs, ",")
              << "]}\n";
    return absl::OkStatus();
  }
  const PoolDims& d = f.dims;
  std::cout << absl::StrFormat("pool     L=%d B=%d H=%d N=%d C=%d, %d-byte elements, granularity %s\n", d.layers,
                               d.capacity_blocks, d.heads, d.block_tokens, d.channels, d.element_bytes,
                               FormatBytes(granularity));
  std::cout << absl::StrFormat("layout   %s, by %s (%s)\n", resolution.layout.name(), LayoutRuleName(resolution.rule),
                               resolution.rule_detail);
  std::cout << absl::StrFormat("allowed  %s\n", resolution.allowed.ToString());
  for (const std::string& w : resolution.warnings) std::cout << "warning  " << w << "\n";
  std::cout << absl::StrFormat("\n  %-6s %14s %12s %12s %10s %9s %9s %14s %12s\n", "layout", "stride_L", "stride_B",
                               "stride_H", "stride_N", "stride_C", "segments", "segment_stride", "reserved");
  for (const Geometry& g : geometries) {
    std::cout << absl::StrFormat("%s %-6s %14d %12d %12d %10d %9d %9d %14s %12s\n",
                                 g.layout() == resolution.layout ? "*" : " ", g.layout().name(), g.stride(Dim::kL),
                                 g.stride(Dim::kB), g.stride(Dim::kH), g.stride(Dim::kN), g.stride(Dim::kC),
                                 g.segments(), FormatBytes(g.segment_stride()), FormatBytes(g.reserved_bytes()));
  }
  std::cout << "\nStrides in bytes; * marks the resolved layout. Byte (l,b,h,n,c) is at\n"
               "l*stride_L + b*stride_B + h*stride_H + n*stride_N + c*stride_C from the pool's base.\n";
  return absl::OkStatus();
}

}  // namespace
}  // namespace kvd::daemon

int main(int argc, char** argv) {
  kvd::daemon::Flags f;
  if (const char* env = std::getenv(kvd::wire::kLayoutEnv)) f.env_layout = env;
  CLI::App app{
      "kvd-geometry: resolve a KV-cache pool's layout through kvd's precedence chain\n"
      "(override > backend requirement > KVD_KV_CACHE_LAYOUT > connector preference > default)\n"
      "and print the byte strides and segments of the pool under each of the six layouts."};
  app.add_option("--layers,-L", f.dims.layers, "L: layers")->capture_default_str();
  app.add_option("--capacity-blocks,-B", f.dims.capacity_blocks, "B: most blocks the pool holds")
      ->capture_default_str();
  app.add_option("--heads,-H", f.dims.heads, "H: KV heads (1 for MLA)")->capture_default_str();
  app.add_option("--block-tokens,-N", f.dims.block_tokens, "N: tokens per block")->capture_default_str();
  app.add_option("--channels,-C", f.dims.channels, "C: channels per token per head")->capture_default_str();
  app.add_option("--element-bytes,-e", f.dims.element_bytes, "e: bytes per element")->capture_default_str();
  app.add_option("--granularity", f.granularity, "device granularity (e.g. 2MiB)")->capture_default_str();
  app.add_option("--override", f.override_layout, "rule 1: an explicit layout");
  app.add_option("--operator-override", f.operator_override, "rule 1: the daemon's --layout-override");
  app.add_option("--require", f.requirements,
                 "rule 2: BACKEND=LAYOUT[,LAYOUT...]; layouts or classes block-outermost, layer-outermost, any");
  app.add_option("--env", f.env_layout, "rule 3: KVD_KV_CACHE_LAYOUT (default: this process's environment)");
  app.add_option("--connector", f.connectors, "rule 4: CONNECTOR=LAYOUT, in preference order");
  app.add_flag("--json", f.json, "print JSON (the v1 API's LayoutResolution and Geometry messages)");
  CLI11_PARSE(app, argc, argv);
  absl::Status s = kvd::daemon::Run(f);
  if (!s.ok()) {
    std::fprintf(stderr, "kvd-geometry: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}
