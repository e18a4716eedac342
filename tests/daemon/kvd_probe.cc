// kvd_probe: drives a running kvd as an engine would, on any backend, to check a deployment end to end
// (it is how the daemon is exercised on the GPU machine until kvctl and libkvd exist).
//
//   kvd_probe --socket=S create POOL --bytes=100GiB      create a pool and grow it to that size, timed
//   kvd_probe --socket=S attach POOL --write=A [--expect=B] [--wait-for=C]
//       attach, fetch every chunk's FD, import and map it with this process's own device, write
//       pattern A at sampled offsets across the whole pool, check pattern B there if given, and wait
//       (bounded) until another process has written pattern C if given.
//
// Patterns are one byte value written to 4 KiB at the start of every chunk.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/handle_client.h"
#include "grpcpp/grpcpp.h"
#include "kvd/device.h"
#include "kvd/status.h"
#include "kvd/units.h"
#include "kvd/v1/kvd.grpc.pb.h"
#include "kvd/wire.h"

namespace kvd {
namespace {

constexpr uint64_t kPatternBytes = 4096;

double Ms(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - since).count();
}

absl::Status FromGrpc(const grpc::Status& s) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

struct Probe {
  std::unique_ptr<v1::Kvd::Stub> stub;
  HandleSession session;

  void Prepare(grpc::ClientContext& ctx) const { ctx.AddMetadata(wire::kSessionMetadataKey, session.token()); }
};

absl::StatusOr<Probe> Connect(const std::string& socket) {
  KVD_ASSIGN_OR_RETURN(HandleSession session, HandleSession::Open(wire::HandlesPathFor(socket), "kvd-probe"));
  auto channel = grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials());
  return Probe{v1::Kvd::NewStub(channel), std::move(session)};
}

absl::Status Create(const std::string& socket, const std::string& pool, const std::string& bytes_text) {
  KVD_ASSIGN_OR_RETURN(uint64_t bytes, ParseBytes(bytes_text, "--bytes"));
  KVD_ASSIGN_OR_RETURN(Probe p, Connect(socket));
  // Llama-70B-like: 80 layers, 16 K/V heads, 16 tokens, 128 channels, bf16: 5 MiB per block (64 KiB per layer).
  v1::CreatePoolRequest req;
  req.set_name(pool);
  v1::PoolDims* d = req.mutable_dims();
  d->set_layers(80);
  d->set_heads(16);
  d->set_block_tokens(16);
  d->set_channels(128);
  d->set_element_bytes(2);
  const uint64_t block_bytes = 80ull * 16 * 16 * 128 * 2;
  const uint64_t blocks = (bytes + block_bytes - 1) / block_bytes;
  d->set_capacity_blocks(blocks * 2);
  v1::Pool created;
  {
    grpc::ClientContext ctx;
    p.Prepare(ctx);
    auto start = std::chrono::steady_clock::now();
    KVD_RETURN_IF_ERROR(FromGrpc(p.stub->CreatePool(&ctx, req, &created)));
    std::printf("created %s: layout %s, %lu segments, capacity %lu blocks (%s VA), %lu blocks committed, %.1f ms\n",
                pool.c_str(), created.geometry().layout().c_str(), created.geometry().segments(),
                created.geometry().dims().capacity_blocks(), FormatBytes(created.reserved_bytes()).c_str(),
                created.committed_blocks(), Ms(start));
  }
  v1::GrowRequest grow;
  grow.set_pool(pool);
  grow.set_target_blocks(blocks);
  v1::PoolUpdate update;
  grpc::ClientContext ctx;
  p.Prepare(ctx);
  auto start = std::chrono::steady_clock::now();
  KVD_RETURN_IF_ERROR(FromGrpc(p.stub->Grow(&ctx, grow, &update)));
  std::printf("grew %s to %lu blocks: %s committed in %d new chunks; daemon %.1f ms, round trip %.1f ms\n",
              pool.c_str(), update.pool().committed_blocks(), FormatBytes(update.pool().committed_bytes()).c_str(),
              update.added_size(), update.elapsed_us() / 1000.0, Ms(start));
  return absl::OkStatus();
}

absl::Status Attach(const std::string& socket, const std::string& pool, int write, int expect, int wait_for) {
  KVD_ASSIGN_OR_RETURN(Probe p, Connect(socket));
  v1::DeviceInfo info;
  {
    grpc::ClientContext ctx;
    KVD_RETURN_IF_ERROR(FromGrpc(p.stub->GetDeviceInfo(&ctx, v1::GetDeviceInfoRequest(), &info)));
  }
  const char* backend = info.backend() == v1::BACKEND_CUDA  ? "cuda"
                        : info.backend() == v1::BACKEND_HIP ? "hip"
                                                            : "host";
  KVD_ASSIGN_OR_RETURN(std::unique_ptr<Device> device,
                       OpenDevice({.backend = backend, .index = static_cast<int>(info.device_index())}));
  v1::AttachRequest req;
  req.set_pool(pool);
  req.set_client_name(absl::StrCat("kvd-probe-", getpid()));
  v1::AttachResponse attached;
  auto start = std::chrono::steady_clock::now();
  {
    grpc::ClientContext ctx;
    p.Prepare(ctx);
    KVD_RETURN_IF_ERROR(FromGrpc(p.stub->Attach(&ctx, req, &attached)));
  }
  const v1::Pool& view = attached.pool();
  KVD_ASSIGN_OR_RETURN(uint64_t base, device->Reserve(view.reserved_bytes()));
  absl::Cleanup free_va = [&] { device->Free(base, view.reserved_bytes()).IgnoreError(); };
  KVD_ASSIGN_OR_RETURN(auto fds, p.session.Fetch(attached.lease().token()));
  const double fetched_ms = Ms(start);
  std::vector<Chunk> chunks;
  absl::Cleanup release = [&] {
    for (size_t i = 0; i < chunks.size(); ++i) {
      device->Unmap(base + view.chunks(i).offset(), view.chunks(i).bytes()).IgnoreError();
      device->Release(chunks[i]).IgnoreError();
    }
  };
  if (fds.size() != static_cast<size_t>(view.chunks_size())) {
    for (const auto& f : fds) close(f.second);
    return absl::InternalError(absl::StrCat("lease yielded ", fds.size(), " FDs for ", view.chunks_size(), " chunks"));
  }
  for (size_t i = 0; i < fds.size(); ++i) {
    const v1::Chunk& c = view.chunks(i);
    if (c.id() != fds[i].first) {
      for (size_t j = i; j < fds.size(); ++j) close(fds[j].second);
      return absl::InternalError(absl::StrCat("FD ", i, " is chunk ", fds[i].first, ", expected ", c.id()));
    }
    absl::StatusOr<Chunk> chunk = device->Import(fds[i].second, c.bytes());
    close(fds[i].second);  // the imported chunk keeps the memory
    KVD_RETURN_IF_ERROR(chunk.status());
    if (absl::Status s = device->Map(base + c.offset(), *chunk, Access::kReadWrite); !s.ok()) {
      device->Release(*chunk).IgnoreError();
      return s;
    }
    chunks.push_back(*chunk);
  }
  std::printf("pid %d attached %s: %s in %d chunks, fetched %zu FDs in %.1f ms, imported and mapped in %.1f ms\n",
              getpid(), pool.c_str(), FormatBytes(view.committed_bytes()).c_str(), view.chunks_size(), fds.size(),
              fetched_ms, Ms(start) - fetched_ms);

  std::vector<unsigned char> buf(kPatternBytes);
  auto check = [&](int value) -> absl::StatusOr<bool> {
    for (const v1::Chunk& c : view.chunks()) {
      KVD_RETURN_IF_ERROR(device->CopyToHost(buf.data(), base + c.offset(), kPatternBytes));
      for (unsigned char b : buf) {
        if (b != value) return false;
      }
    }
    return true;
  };
  if (expect >= 0) {
    KVD_ASSIGN_OR_RETURN(bool ok, check(expect));
    if (!ok) return absl::DataLossError(absl::StrCat("pattern ", expect, " not found at every chunk"));
    std::printf("pid %d read pattern %d written by another process at the start of all %d chunks\n", getpid(), expect,
                view.chunks_size());
  }
  if (write >= 0) {
    std::fill(buf.begin(), buf.end(), static_cast<unsigned char>(write));
    for (const v1::Chunk& c : view.chunks()) {
      KVD_RETURN_IF_ERROR(device->CopyFromHost(base + c.offset(), buf.data(), kPatternBytes));
    }
    std::printf("pid %d wrote pattern %d at the start of all %d chunks\n", getpid(), write, view.chunks_size());
  }
  std::fflush(stdout);
  if (wait_for >= 0) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (true) {
      KVD_ASSIGN_OR_RETURN(bool ok, check(wait_for));
      if (ok) break;
      if (std::chrono::steady_clock::now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat("pattern ", wait_for, " did not appear within 60 s"));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    std::printf("pid %d saw pattern %d written by the other process\n", getpid(), wait_for);
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace kvd

int main(int argc, char** argv) {
  CLI::App app{"kvd_probe: drive a running kvd as an engine would (create and grow a pool; attach, map, share bytes)"};
  app.require_subcommand(1);
  std::string socket = kvd::wire::DefaultSocket(0), pool, bytes = "1GiB";
  int write = -1, expect = -1, wait_for = -1;
  app.add_option("--socket", socket, "kvd's gRPC socket")->capture_default_str();
  CLI::App* create = app.add_subcommand("create", "create POOL and grow it to --bytes");
  create->add_option("pool", pool)->required();
  create->add_option("--bytes", bytes, "size to grow to (e.g. 100GiB)")->capture_default_str();
  CLI::App* attach = app.add_subcommand("attach", "attach POOL, map it, write/check patterns");
  attach->add_option("pool", pool)->required();
  attach->add_option("--write", write, "byte value to write at every chunk");
  attach->add_option("--expect", expect, "byte value that must already be there");
  attach->add_option("--wait-for", wait_for, "byte value to wait (up to 60 s) for another process to write");
  CLI11_PARSE(app, argc, argv);
  absl::Status s =
      create->parsed() ? kvd::Create(socket, pool, bytes) : kvd::Attach(socket, pool, write, expect, wait_for);
  if (!s.ok()) {
    std::fprintf(stderr, "kvd_probe: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
