// consumer SOCKET: connects to a running kvd with an installed libkvd, creates and attaches a pool,
// writes and reads its memory through the Mapping, grows it as a one-rank group, and deletes it. Exit 0 when everything
// worked.
#include <cstdio>
#include <cstring>
#include <memory>

#include "kvd/client.h"
#include "kvd/group.h"

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  absl::StatusOr<std::unique_ptr<kvd::Client>> client = kvd::Client::Connect({.socket = argv[1]});
  if (!client.ok()) {
    std::fprintf(stderr, "connect: %s\n", client.status().ToString().c_str());
    return 1;
  }
  kvd::PoolOptions options;
  options.name = "consumer";
  options.dims = {
      .layers = 2, .capacity_blocks = 1024, .heads = 2, .block_tokens = 16, .channels = 64, .element_bytes = 2};
  options.initial_blocks = 512;
  options.group = {.name = "consumer", .rank = 0, .size = 1};  // a one-rank engine group
  if (absl::Status s = (*client)->CreatePool(options).status(); !s.ok()) {
    std::fprintf(stderr, "create: %s\n", s.ToString().c_str());
    return 1;
  }
  {
    absl::StatusOr<std::unique_ptr<kvd::Mapping>> m = (*client)->Attach("consumer");
    if (!m.ok()) {
      std::fprintf(stderr, "attach: %s\n", m.status().ToString().c_str());
      return 1;
    }
    kvd::LayerView v = (*m)->layer(1);
    std::memset(v.data, 0x5a, v.stride_b);
    if (static_cast<unsigned char*>(v.data)[v.stride_b - 1] != 0x5a) return 1;
    std::printf("consumer: pool %s, layout %s, %lu blocks mapped at %p\n", (*m)->pool().c_str(),
                (*m)->geometry().layout.c_str(), static_cast<unsigned long>((*m)->committed_blocks()), (*m)->base());
  }
  absl::StatusOr<std::unique_ptr<kvd::Group>> group = kvd::Group::Open("consumer", {argv[1]});
  absl::StatusOr<kvd::GroupChange> grown = group.ok() ? (*group)->Grow(1024) : group.status();
  if (!grown.ok()) {
    std::fprintf(stderr, "group grow: %s\n", grown.status().ToString().c_str());
    return 1;
  }
  group->reset();
  absl::StatusOr<uint64_t> released = (*client)->DeletePool("consumer", false);
  if (!released.ok()) {
    std::fprintf(stderr, "delete: %s\n", released.status().ToString().c_str());
    return 1;
  }
  return 0;
}
