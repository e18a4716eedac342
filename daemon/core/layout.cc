#include "daemon/core/layout.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kvd::daemon {
namespace {

using D = Dim;
constexpr std::array<std::array<Dim, kNumDims>, Layout::kCount> kOrders = {{
    {D::kL, D::kB, D::kH, D::kN, D::kC},
    {D::kL, D::kB, D::kN, D::kH, D::kC},
    {D::kL, D::kH, D::kB, D::kN, D::kC},
    {D::kB, D::kL, D::kH, D::kN, D::kC},
    {D::kB, D::kL, D::kN, D::kH, D::kC},
    {D::kB, D::kH, D::kL, D::kN, D::kC},
}};
constexpr std::array<absl::string_view, Layout::kCount> kNames = {"LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"};
constexpr absl::string_view kAccepted = "LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC";

}  // namespace

char DimName(Dim dim) { return "LBHNC"[static_cast<int>(dim)]; }

absl::StatusOr<Layout> Layout::Parse(absl::string_view text, absl::string_view field) {
  const std::string upper = absl::AsciiStrToUpper(text);
  for (int i = 0; i < kCount; ++i) {
    if (upper == kNames[i]) return Layout(static_cast<Id>(i));
  }
  return absl::InvalidArgumentError(absl::StrCat(field, ": unknown layout \"", text, "\" (accepted: ", kAccepted, ")"));
}

const std::array<Layout, Layout::kCount>& Layout::All() {
  static constexpr std::array<Layout, kCount> kAll = {Layout(Id::kLBHNC), Layout(Id::kLBNHC), Layout(Id::kLHBNC),
                                                      Layout(Id::kBLHNC), Layout(Id::kBLNHC), Layout(Id::kBHLNC)};
  return kAll;
}

absl::string_view Layout::name() const { return kNames[static_cast<int>(id_)]; }

const std::array<Dim, kNumDims>& Layout::order() const { return kOrders[static_cast<int>(id_)]; }

int Layout::block_position() const {
  const auto& o = order();
  for (int i = 0; i < kNumDims; ++i) {
    if (o[i] == Dim::kB) return i;
  }
  return -1;  // unreachable: every order holds B
}

absl::StatusOr<LayoutSet> LayoutSet::Parse(absl::string_view text, absl::string_view field) {
  const std::string lower = absl::AsciiStrToLower(text);
  if (lower == "any") return Any();
  if (lower == "block-outermost" || lower == "layer-outermost") {
    const bool want_block = lower == "block-outermost";
    LayoutSet set = None();
    for (Layout l : Layout::All()) {
      if (l.block_outermost() == want_block) set = set.Union(Of(l));
    }
    return set;
  }
  absl::StatusOr<Layout> layout = Layout::Parse(text, field);
  if (!layout.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": unknown layout or class \"", text, "\" (accepted: ",
                                                   kAccepted, ", block-outermost, layer-outermost, any)"));
  }
  return Of(*layout);
}

int LayoutSet::size() const { return __builtin_popcount(bits_); }

std::vector<Layout> LayoutSet::layouts() const {
  std::vector<Layout> out;
  for (Layout l : Layout::All()) {
    if (contains(l)) out.push_back(l);
  }
  return out;
}

std::string LayoutSet::ToString() const {
  std::vector<absl::string_view> names;
  for (Layout l : layouts()) names.push_back(l.name());
  return absl::StrCat("{", absl::StrJoin(names, ", "), "}");
}

}  // namespace kvd::daemon
