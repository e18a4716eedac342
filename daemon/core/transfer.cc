#include "daemon/core/transfer.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvd::daemon {
namespace {

// A run of consecutive block ids [first, first + n).
struct BlockRun {
  uint64_t first = 0;
  uint64_t n = 0;
};

// Runs of equal length whose starts are `gap` blocks apart: `count` of them, the first at `first`.
struct RunGroup {
  uint64_t first = 0;
  uint64_t n = 0;
  uint64_t gap = 0;
  uint64_t count = 1;
};

absl::Status ValidateIds(uint64_t committed_blocks, absl::Span<const uint64_t> ids) {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] >= committed_blocks) {
      return absl::InvalidArgumentError(absl::StrCat(
          "block_ids[", i, "]: ", ids[i], " is not a committed block (committed_blocks: ", committed_blocks, ")"));
    }
  }
  std::vector<std::pair<uint64_t, size_t>> sorted;
  sorted.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) sorted.emplace_back(ids[i], i);
  std::sort(sorted.begin(), sorted.end());
  // Report the repeat that comes first in the request.
  size_t worst = ids.size();
  size_t earlier = 0;
  for (size_t i = 1; i < sorted.size(); ++i) {
    if (sorted[i].first == sorted[i - 1].first && sorted[i].second < worst) {
      worst = sorted[i].second;
      earlier = sorted[i - 1].second;
    }
  }
  if (worst != ids.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_ids[", worst, "]: ", ids[worst], " repeats block_ids[", earlier, "]"));
  }
  return absl::OkStatus();
}

std::vector<BlockRun> Runs(std::vector<uint64_t> ids) {
  std::sort(ids.begin(), ids.end());
  std::vector<BlockRun> runs;
  for (uint64_t id : ids) {
    if (!runs.empty() && runs.back().first + runs.back().n == id) {
      ++runs.back().n;
    } else {
      runs.push_back({id, 1});
    }
  }
  return runs;
}

// Greedy, lowest block first: a group takes the next run while it has the group's length and spacing.
std::vector<RunGroup> Fold(const std::vector<BlockRun>& runs) {
  std::vector<RunGroup> groups;
  size_t i = 0;
  while (i < runs.size()) {
    RunGroup g{runs[i].first, runs[i].n, 0, 1};
    size_t j = i + 1;
    if (j < runs.size() && runs[j].n == g.n) {
      g.gap = runs[j].first - runs[i].first;
      while (j < runs.size() && runs[j].n == g.n && runs[j].first == runs[j - 1].first + g.gap) {
        ++g.count;
        ++j;
      }
    }
    groups.push_back(g);
    i = j;
  }
  return groups;
}

}  // namespace

absl::StatusOr<std::vector<TransferDescriptor>> DescribeTransfer(const Geometry& geometry, uint64_t committed_blocks,
                                                                 absl::Span<const uint64_t> block_ids) {
  if (committed_blocks > geometry.dims().capacity_blocks) {
    return absl::InvalidArgumentError(absl::StrCat("committed_blocks: ", committed_blocks, " exceeds the capacity of ",
                                                   geometry.dims().capacity_blocks));
  }
  std::vector<BlockRun> runs;
  if (block_ids.empty()) {
    if (committed_blocks > 0) runs.push_back({0, committed_blocks});
  } else {
    if (absl::Status s = ValidateIds(committed_blocks, block_ids); !s.ok()) return s;
    runs = Runs(std::vector<uint64_t>(block_ids.begin(), block_ids.end()));
  }

  const uint64_t bs = geometry.block_stride();
  const uint64_t ss = geometry.segment_stride();
  const uint64_t segments = geometry.segments();
  std::vector<TransferDescriptor> out;
  const std::vector<RunGroup> groups = Fold(runs);

  if (segments == 1 || segments * groups.size() < runs.size()) {
    // Segment-major: each group of runs once per segment.
    for (uint64_t s = 0; s < segments; ++s) {
      for (const RunGroup& g : groups) {
        const uint64_t bytes = g.n * bs;
        out.push_back({s, geometry.SegmentOffset(s) + g.first * bs, bytes, g.count == 1 ? bytes : g.gap * bs, g.count});
      }
    }
    return out;
  }
  // Run-major: each run once, across every segment.
  for (const BlockRun& r : runs) {
    const uint64_t bytes = r.n * bs;
    if (r.first == 0 && bytes == ss) {
      // Whole, unpadded segments back to back: one run.
      out.push_back({0, geometry.offset(), segments * ss, segments * ss, 1});
    } else {
      out.push_back({0, geometry.offset() + r.first * bs, bytes, ss, segments});
    }
  }
  return out;
}

std::vector<ByteRange> MergeChunkRanges(std::vector<ChunkInfo> chunks) {
  std::sort(chunks.begin(), chunks.end(), [](const ChunkInfo& a, const ChunkInfo& b) {
    return a.segment != b.segment ? a.segment < b.segment : a.offset < b.offset;
  });
  std::vector<ByteRange> out;
  for (const ChunkInfo& c : chunks) {
    if (!out.empty() && out.back().segment == c.segment && out.back().offset + out.back().bytes == c.offset) {
      out.back().bytes += c.bytes;
    } else {
      out.push_back({c.segment, c.offset, c.bytes});
    }
  }
  return out;
}

}  // namespace kvd::daemon
