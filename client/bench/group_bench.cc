// kvd_group_bench: what the two-phase group protocol costs. On running kvds (one per GPU), it creates
// one pool per daemon as the ranks of one engine group and times, per round, the same change done two
// ways on the same pools:
//   baseline  the plain RPC (Grow, Shrink, Sleep, Wake) on every rank at once, one thread per rank,
//             with no coordination (what an engine does today, and what can leave ranks unequal);
//   group     kvd::Group: Prepare on every rank, then Commit on every rank (all or none).
// It prints the medians and group/baseline per operation; with --json one JSON document.
//
//   kvd_group_bench --sockets=/run/kvd/gpu0.sock,/run/kvd/gpu1.sock --bytes=16GiB --rounds=5
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kvd/client.h"
#include "kvd/group.h"
#include "kvd/status.h"
#include "kvd/units.h"

namespace kvd {
namespace {

struct Options {
  std::vector<std::string> sockets;
  std::string bytes = "4GiB";
  int rounds = 5;
  bool json = false;
};

// 32 layers x 8 KV heads x 16 tokens x 128 channels x bf16: 1 MiB a block, as a 70B-class model.
constexpr PoolDims kDims{
    .layers = 32, .capacity_blocks = 0, .heads = 8, .block_tokens = 16, .channels = 128, .element_bytes = 2};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : (v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2);
}

// Runs fn(rank) on every rank at once; the first error, if any.
absl::Status OnEveryRank(size_t n, const std::function<absl::Status(size_t)>& fn) {
  std::vector<absl::Status> results(n);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < n; ++i) threads.emplace_back([&, i] { results[i] = fn(i); });
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : results) KVD_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

// Milliseconds `fn` took, or its error.
absl::StatusOr<double> TimeMs(const std::function<absl::Status()>& fn) {
  const absl::Time start = absl::Now();
  KVD_RETURN_IF_ERROR(fn());
  return absl::ToDoubleMilliseconds(absl::Now() - start);
}

struct Row {
  const char* op;
  std::vector<double> baseline, group;
};

absl::Status Run(const Options& o) {
  KVD_ASSIGN_OR_RETURN(uint64_t bytes, ParseBytes(o.bytes, "--bytes"));
  const uint64_t block_bytes = kDims.layers * kDims.heads * kDims.block_tokens * kDims.channels * kDims.element_bytes;
  const uint64_t blocks = bytes / block_bytes;
  if (blocks < 2) return absl::InvalidArgumentError("--bytes: at least two blocks (2 MiB) a rank");
  const std::string group_name = absl::StrCat("bench-", getpid());
  const size_t n = o.sockets.size();

  std::vector<std::unique_ptr<Client>> ranks;
  std::vector<std::string> pools;
  for (size_t r = 0; r < n; ++r) {
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect({.socket = o.sockets[r], .client_name = "group-bench"});
    if (!c.ok()) return absl::Status(c.status().code(), absl::StrCat(o.sockets[r], ": ", c.status().message()));
    PoolOptions p{.name = absl::StrCat(group_name, "-r", r), .dims = kDims};
    p.dims.capacity_blocks = blocks;
    p.group = {.name = group_name, .rank = static_cast<uint32_t>(r), .size = static_cast<uint32_t>(n)};
    KVD_ASSIGN_OR_RETURN(PoolInfo created, (*c)->CreatePool(p));
    // The smallest commit is one granule per segment: the pool must be several of them.
    const uint64_t granule_blocks = created.geometry.granularity_bytes / created.geometry.block_stride;
    if (blocks < 4 * granule_blocks) {
      (*c)->DeletePool(p.name, true).IgnoreError();
      return absl::InvalidArgumentError(
          absl::StrCat("--bytes: at least ", FormatBytes(4 * granule_blocks * block_bytes),
                       " a rank (one granule per segment already holds ", granule_blocks, " blocks)"));
    }
    pools.push_back(p.name);
    ranks.push_back(*std::move(c));
  }
  auto cleanup = [&] {
    for (size_t r = 0; r < n; ++r) ranks[r]->DeletePool(pools[r], true).IgnoreError();
  };
  KVD_ASSIGN_OR_RETURN(std::unique_ptr<Group> group, Group::Open(group_name, o.sockets));
  if (!o.json) {
    std::printf("%zu ranks (%s), %s a rank (%lu blocks of %s), %d rounds\n", n, absl::StrJoin(o.sockets, ", ").c_str(),
                FormatBytes(blocks * block_bytes).c_str(), static_cast<unsigned long>(blocks),
                FormatBytes(block_bytes).c_str(), o.rounds);
  }

  Row grow{"grow"}, shrink{"shrink"}, sleep{"sleep"}, wake{"wake"};
  // One way of changing every rank: the plain RPCs at once, or the group.
  struct Way {
    std::function<absl::Status(uint64_t)> grow;
    std::function<absl::Status(uint64_t)> shrink;  // waits for the release
    std::function<absl::Status()> sleep;           // waits for the release
    std::function<absl::Status()> wake;
    std::vector<double> Row::*samples;
  };
  const Way plain{
      .grow =
          [&](uint64_t b) { return OnEveryRank(n, [&](size_t r) { return ranks[r]->Grow(pools[r], b).status(); }); },
      .shrink =
          [&](uint64_t b) {
            return OnEveryRank(n, [&](size_t r) { return ranks[r]->Shrink(pools[r], b, true).status(); });
          },
      .sleep = [&] { return OnEveryRank(n, [&](size_t r) { return ranks[r]->Sleep(pools[r], true).status(); }); },
      .wake = [&] { return OnEveryRank(n, [&](size_t r) { return ranks[r]->Wake(pools[r]).status(); }); },
      .samples = &Row::baseline};
  const Way grouped{.grow = [&](uint64_t b) { return group->Grow(b).status(); },
                    .shrink = [&](uint64_t b) { return group->Shrink(b, true).status(); },
                    .sleep = [&] { return group->Sleep(true).status(); },
                    .wake = [&] { return group->Wake().status(); },
                    .samples = &Row::group};
  // From an empty pool: grow from one granule (so every round creates the same chunks), sleep, wake;
  // then, since wake makes one chunk per segment and shrink releases whole chunks only, regrow from
  // one granule and shrink back to it. Ends empty.
  auto measure = [&](const Way& w) -> absl::Status {
    KVD_RETURN_IF_ERROR(w.grow(1));
    KVD_ASSIGN_OR_RETURN(double g, TimeMs([&] { return w.grow(blocks); }));
    KVD_ASSIGN_OR_RETURN(double sl, TimeMs(w.sleep));
    KVD_ASSIGN_OR_RETURN(double wk, TimeMs(w.wake));
    KVD_RETURN_IF_ERROR(w.shrink(0));
    KVD_RETURN_IF_ERROR(w.grow(1));
    KVD_RETURN_IF_ERROR(w.grow(blocks));
    KVD_ASSIGN_OR_RETURN(double sh, TimeMs([&] { return w.shrink(1); }));
    KVD_RETURN_IF_ERROR(w.shrink(0));
    (grow.*w.samples).push_back(g);
    (sleep.*w.samples).push_back(sl);
    (wake.*w.samples).push_back(wk);
    (shrink.*w.samples).push_back(sh);
    return absl::OkStatus();
  };
  absl::Status status = [&]() -> absl::Status {
    for (int round = 0; round < o.rounds; ++round) {
      // Alternate which goes first, so that neither always follows the other's releases.
      const bool plain_first = round % 2 == 0;
      KVD_RETURN_IF_ERROR(measure(plain_first ? plain : grouped));
      KVD_RETURN_IF_ERROR(measure(plain_first ? grouped : plain));
    }
    return absl::OkStatus();
  }();
  group.reset();
  cleanup();
  KVD_RETURN_IF_ERROR(status);

  if (o.json) {
    std::vector<std::string> rows;
    for (const Row* r : {&grow, &shrink, &sleep, &wake}) {
      rows.push_back(absl::StrFormat(R"({"op": "%s", "baseline_ms": %.3f, "group_ms": %.3f, "ratio": %.3f})", r->op,
                                     Median(r->baseline), Median(r->group),
                                     Median(r->group) / std::max(Median(r->baseline), 1e-9)));
    }
    std::printf(R"({"ranks": %zu, "bytes_per_rank": %lu, "rounds": %d, "results": [%s]})"
                "\n",
                n, static_cast<unsigned long>(blocks * block_bytes), o.rounds, absl::StrJoin(rows, ", ").c_str());
    return absl::OkStatus();
  }
  std::printf("%-8s %14s %12s %10s\n", "op", "baseline ms", "group ms", "group/base");
  for (const Row* r : {&grow, &shrink, &sleep, &wake}) {
    std::printf("%-8s %14.2f %12.2f %10.2f\n", r->op, Median(r->baseline), Median(r->group),
                Median(r->group) / std::max(Median(r->baseline), 1e-9));
  }
  std::printf("(medians; baseline: the plain RPC on every rank at once, uncoordinated)\n");
  return absl::OkStatus();
}

}  // namespace
}  // namespace kvd

int main(int argc, char** argv) {
  CLI::App app{
      "kvd_group_bench: the cost of all-or-nothing group resizes (prepare + commit on every rank) against the "
      "plain RPCs on every rank at once, on running kvds"};
  kvd::Options o;
  std::string sockets;
  app.add_option("--sockets", sockets, "The ranks' kvd sockets, comma-separated (one pool per socket)")->required();
  app.add_option("--bytes", o.bytes, "Memory a rank grows to (e.g. 16GiB)")->capture_default_str();
  app.add_option("--rounds", o.rounds, "Rounds; medians are reported")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_flag("--json", o.json, "One JSON document on stdout");
  CLI11_PARSE(app, argc, argv);
  o.sockets = absl::StrSplit(sockets, ',', absl::SkipEmpty());
  absl::Status s = kvd::Run(o);
  if (!s.ok()) {
    std::fprintf(stderr, "kvd_group_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
