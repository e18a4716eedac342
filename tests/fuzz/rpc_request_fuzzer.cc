// libFuzzer target: every RPC of kvd.v1.Kvd, request bytes as the wire brings them. The real KvdService
// on a real PoolManager (host backend) behind an in-process gRPC server; the fuzzed bytes go unparsed
// through a generic stub, so gRPC's deserialization, the service's validation and conversion
// (daemon/rpc/convert.*) and the core's checks all see them, with or without a valid session.
//
// Input: byte 0 picks the method (in the proto's order, every method of the service, Watch included),
// byte 1 bit 0 says whether the call carries the session's token; the rest is the request message.
// Before every input the daemon holds pool "p" (40 blocks, LBNHC) of the session's uid, so requests
// naming it reach the core's deeper paths; pools the input created are deleted after it.
//
// A reply must be a canonical status; UNKNOWN (an exception escaped a handler) aborts, as any crash or
// sanitizer report does.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "daemon/core/pool_manager.h"
#include "daemon/rpc/async_stream.h"
#include "daemon/rpc/service.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/stubs/logging.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "kvd/device.h"
#include "kvd/wire.h"
#include "spdlog/spdlog.h"

namespace kvd::daemon {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint32_t kUid = 1000;

struct Daemon {
  std::unique_ptr<Device> device;
  std::unique_ptr<PoolManager> manager;
  std::unique_ptr<KvdService> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<CompletionThreads> threads;  // never stopped: the daemon lives as long as the fuzzer
  std::unique_ptr<grpc::GenericStub> stub;
  std::string token;  // a session of kUid
  Caller admin;       // root: sees every pool, for the clean-up between inputs
  struct Method {
    std::string path;  // "/kvd.v1.Kvd/CreatePool"
    bool server_streaming;
  };
  std::vector<Method> methods;
};

Daemon& TheDaemon() {
  static Daemon* d = [] {
    auto* d = new Daemon;
    // The service logs every refusal, protobuf every string that is not UTF-8: millions of lines.
    spdlog::set_level(spdlog::level::off);
    google::protobuf::SetLogHandler(nullptr);
    absl::StatusOr<std::unique_ptr<Device>> device =
        OpenDevice({.backend = "host", .host_capacity = 256 * kMiB, .host_granularity = 2 * kMiB});
    if (!device.ok()) {
      std::fprintf(stderr, "host device: %s\n", device.status().ToString().c_str());
      std::abort();
    }
    d->device = *std::move(device);
    d->manager =
        std::make_unique<PoolManager>(d->device.get(), ManagerOptions{.budget_bytes = 128 * kMiB,
                                                                      .max_pool_reserved_bytes = uint64_t{1} << 36,
                                                                      .lease_ttl = absl::Seconds(1),
                                                                      .daemon_uid = static_cast<uint32_t>(getuid())});
    d->service = std::make_unique<KvdService>(
        d->manager.get(),
        KvdService::Options{.granularity = d->device->granularity(), .default_release_wait = absl::Milliseconds(1)});
    grpc::ServerBuilder builder;
    builder.RegisterService(d->service.get());
    d->threads = std::make_unique<CompletionThreads>(&builder, 2);
    d->server = builder.BuildAndStart();
    d->service->ListenForCalls(d->threads->cq());
    d->threads->Start();
    d->stub = std::make_unique<grpc::GenericStub>(d->server->InProcessChannel(grpc::ChannelArguments()));
    d->token = *d->manager->OpenSession(kUid, 1, "fuzz");
    d->admin = *d->manager->Authenticate(*d->manager->OpenSession(0, 1, "admin"));
    const google::protobuf::ServiceDescriptor* service =
        google::protobuf::DescriptorPool::generated_pool()->FindServiceByName("kvd.v1.Kvd");
    for (int i = 0; i < service->method_count(); ++i) {
      const google::protobuf::MethodDescriptor* m = service->method(i);
      d->methods.push_back({"/kvd.v1.Kvd/" + m->name(), m->server_streaming()});
    }
    return d;
  }();
  return *d;
}

// Pool "p" as every input finds it; nothing else.
void Reset(Daemon& d) {
  for (const PoolView& pool : d.manager->ListPools(d.admin)) {
    if (pool.name != "p" || pool.state != PoolState::kAwake || pool.committed_blocks != 64 ||
        pool.clients.size() > 16) {
      d.manager->DeletePool(d.admin, pool.name, /*force=*/true).IgnoreError();
    }
  }
  if (!d.manager->GetPool(d.admin, "p").ok()) {
    const Caller owner = *d.manager->Authenticate(d.token);
    PoolSpec spec{
        .name = "p",
        .dims =
            {.layers = 2, .capacity_blocks = 256, .heads = 2, .block_tokens = 16, .channels = 1024, .element_bytes = 2},
        .initial_blocks = 40};
    d.manager->CreatePool(owner, spec).IgnoreError();
  }
}

void CheckStatus(const std::string& method, const grpc::Status& status) {
  if (status.error_code() == grpc::StatusCode::UNKNOWN) {
    std::fprintf(stderr, "%s answered UNKNOWN (%s): an exception escaped the handler\n", method.c_str(),
                 status.error_message().c_str());
    std::abort();
  }
}

void* Tag(intptr_t n) { return reinterpret_cast<void*>(n); }

}  // namespace
}  // namespace kvd::daemon

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvd::daemon;
  if (size < 2) return 0;
  Daemon& d = TheDaemon();
  const Daemon::Method& method = d.methods[data[0] % d.methods.size()];
  const bool with_session = (data[1] & 1) != 0;
  grpc::Slice slice(data + 2, size - 2);
  const grpc::ByteBuffer request(&slice, 1);

  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  if (with_session) context.AddMetadata(kvd::wire::kSessionMetadataKey, d.token);
  grpc::CompletionQueue cq;
  grpc::Status status;
  void* tag = nullptr;
  bool ok = false;
  if (!method.server_streaming) {
    grpc::ByteBuffer response;
    std::unique_ptr<grpc::GenericClientAsyncResponseReader> call =
        d.stub->PrepareUnaryCall(&context, method.path, request, &cq);
    call->StartCall();
    call->Finish(&response, &status, Tag(1));
    cq.Next(&tag, &ok);
  } else {
    // Watch: send the request, read what comes for a moment, then hang up as a dying client would.
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(20));
    std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call = d.stub->PrepareCall(&context, method.path, &cq);
    call->StartCall(Tag(1));
    cq.Next(&tag, &ok);
    if (ok) {
      call->Write(request, Tag(2));
      cq.Next(&tag, &ok);
    }
    if (ok) {
      call->WritesDone(Tag(3));
      cq.Next(&tag, &ok);
    }
    grpc::ByteBuffer event;
    while (ok) {
      call->Read(&event, Tag(4));
      cq.Next(&tag, &ok);
    }
    call->Finish(&status, Tag(5));
    cq.Next(&tag, &ok);
  }
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  CheckStatus(method.path, status);
  Reset(d);
  return 0;
}
