// The KV-cache layout vocabulary (docs/layouts.md, "The vocabulary"): the logical dims [L, B, H, N, C] and the six
// physical orders kvd supports. A Layout is a small value type, cheap to copy, thread-compatible.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvd::daemon {

// Logical dims of one KV-cache tensor: layers, blocks, heads, tokens per block, channels.
enum class Dim : uint8_t { kL = 0, kB = 1, kH = 2, kN = 3, kC = 4 };
inline constexpr int kNumDims = 5;
char DimName(Dim dim);  // 'L', 'B', 'H', 'N', 'C'

class Layout {
 public:
  // In canonical order (the order docs/layouts.md's table lists them and "first allowed" refers to).
  enum class Id : uint8_t { kLBHNC = 0, kLBNHC, kLHBNC, kBLHNC, kBLNHC, kBHLNC };
  static constexpr int kCount = 6;

  // "LBNHC" etc., case-insensitive. INVALID_ARGUMENT naming `field` and the accepted values.
  // absl::string_view, not std::string_view: see Note [Abseil's own string_view] in docs/architecture.md.
  [[nodiscard]] static absl::StatusOr<Layout> Parse(absl::string_view text, absl::string_view field = "layout");
  static const std::array<Layout, kCount>& All();
  static Layout Default() { return Layout(Id::kLBNHC); }

  constexpr explicit Layout(Id id) : id_(id) {}
  Id id() const { return id_; }
  absl::string_view name() const;
  // The physical order, outermost first.
  const std::array<Dim, kNumDims>& order() const;
  // Position of B in order(): the dims before it split the pool into segments.
  int block_position() const;
  bool block_outermost() const { return block_position() == 0; }

  friend bool operator==(Layout a, Layout b) { return a.id_ == b.id_; }
  friend bool operator!=(Layout a, Layout b) { return a.id_ != b.id_; }

 private:
  Id id_;
};

// A set of layouts, iterated in canonical order.
class LayoutSet {
 public:
  static LayoutSet None() { return LayoutSet(0); }
  static LayoutSet Any() { return LayoutSet((1u << Layout::kCount) - 1); }
  static LayoutSet Of(Layout layout) { return LayoutSet(Bit(layout)); }
  // A layout name or a class: "block-outermost" {BLHNC, BLNHC, BHLNC}, "layer-outermost"
  // {LBHNC, LBNHC, LHBNC}, "any". INVALID_ARGUMENT naming `field` otherwise.
  [[nodiscard]] static absl::StatusOr<LayoutSet> Parse(absl::string_view text, absl::string_view field);

  bool contains(Layout layout) const { return (bits_ & Bit(layout)) != 0; }
  bool empty() const { return bits_ == 0; }
  int size() const;
  LayoutSet Union(LayoutSet other) const { return LayoutSet(bits_ | other.bits_); }
  LayoutSet Intersect(LayoutSet other) const { return LayoutSet(bits_ & other.bits_); }
  std::vector<Layout> layouts() const;
  std::string ToString() const;  // "{BLHNC, BLNHC}"

  friend bool operator==(LayoutSet a, LayoutSet b) { return a.bits_ == b.bits_; }

 private:
  explicit LayoutSet(uint32_t bits) : bits_(bits) {}
  static uint32_t Bit(Layout layout) { return 1u << static_cast<int>(layout.id()); }
  uint32_t bits_;
};

}  // namespace kvd::daemon
