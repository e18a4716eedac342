// FaultDevice: a Device that forwards to a real one, counts the handles and mappings its caller holds,
// and fails the Nth call of an operation (or the Nth fallible call of any kind) on request. It proves
// rollback: after a failed operation the live counts must be what they were before.
//
// The fallible calls are the ones that acquire something or can fail for want of it: Info, Reserve,
// Create, Import, Map, Export, ExportFabricHandle and ExportRange. An imported chunk counts as live as a
// created one does. The calls that give things back (Free,
// Release, Unmap) and the block operations are forwarded and counted, never failed.
#pragma once

#include <unistd.h>

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "kvd/device.h"
#include "kvd/status.h"

namespace kvd::testing {

class FaultDevice final : public Device {
 public:
  enum class Op {
    kReserve,
    kCreate,
    kMap,
    kExport,
    kInfo,
    kExportFabricHandle,
    kExportRange,
    kCopyRange,
    kImport,
    kRegisterHost
  };

  explicit FaultDevice(std::unique_ptr<Device> inner) : inner_(std::move(inner)) {}

  // The `nth` call (1-based, counted from now) of `op` fails with `status`.
  void FailNth(Op op, int nth, absl::Status status) {
    absl::MutexLock lock(&mu_);
    faults_[op] = {nth, std::move(status)};
  }
  // The `nth` fallible call (1-based, counted from now) of whatever operation fails with `status`; see
  // fault_pending() for whether it has happened yet.
  void FailNthCall(int nth, absl::Status status) {
    absl::MutexLock lock(&mu_);
    any_fault_ = {nth, std::move(status)};
  }
  // From now on every Create first notifies `*entered` (the first one only) and then waits for `*release`: a
  // caller held inside the device with the locks it holds across device calls. Null for both: Create runs at
  // once again. Both must outlive the Creates they hold.
  void HoldCreates(absl::Notification* entered, absl::Notification* release) {
    absl::MutexLock lock(&mu_);
    entered_ = entered;
    release_ = release;
  }
  // From now on the Creates after the next `pass` wait for `*release` (null: Create runs at once again); it
  // must outlive them.
  void HoldCreatesAfter(int pass, absl::Notification* release) {
    absl::MutexLock lock(&mu_);
    hold_after_pass_ = pass;
    hold_after_release_ = release;
  }
  // The next CopyFromHost notifies `*copied` (it must outlive that call).
  void NotifyNextCopyFromHost(absl::Notification* copied) {
    absl::MutexLock lock(&mu_);
    copied_from_host_ = copied;
  }
  // From now on every RegisterHost waits for `*release` (null: runs at once again); it must outlive them.
  void HoldRegistrations(absl::Notification* release) {
    absl::MutexLock lock(&mu_);
    register_release_ = release;
  }
  // Whether a FailNthCall fault is still waiting for its call.
  bool fault_pending() const {
    absl::MutexLock lock(&mu_);
    return any_fault_.countdown > 0;
  }
  // Fallible calls made since the device was made.
  int fallible_calls() const { return fallible_calls_; }
  // From now on the device claims fabric handles (a stand-in for a CUDA node whose fabric probe
  // succeeded): Capabilities() says so and ExportFabricHandle returns 64 bytes naming the chunk.
  void PretendFabric() { pretend_fabric_ = true; }
  // From now on the device claims range exports that span chunks (a stand-in for CUDA's DMA-BUF):
  // ExportRange refuses a range of which the process cannot read the first or last byte (as the driver
  // refuses one that is not mapped: FAILED_PRECONDITION "not mapped") and otherwise returns an FD of its own.
  void PretendRangeExport() { pretend_range_export_ = true; }
  int live_chunks() const { return live_chunks_; }
  int live_mappings() const { return live_mappings_; }
  int live_reservations() const { return live_reservations_; }
  // The host ranges registered now (RegisterHost, not yet unregistered): start -> bytes.
  std::map<uintptr_t, uint64_t> registered_host() const {
    absl::MutexLock lock(&mu_);
    return registered_host_;
  }
  // Copies to or from host memory whose host range is not inside one registered range.
  int copies_outside_one_registration() const { return copies_outside_; }

  BackendKind kind() const override { return inner_->kind(); }
  uint64_t granularity() const override { return inner_->granularity(); }
  absl::StatusOr<DeviceInfo> Info() override {
    if (absl::Status s = Fault(Op::kInfo); !s.ok()) return s;
    return inner_->Info();
  }

  absl::StatusOr<uint64_t> Reserve(uint64_t bytes) override {
    if (absl::Status s = Fault(Op::kReserve); !s.ok()) return s;
    absl::StatusOr<uint64_t> va = inner_->Reserve(bytes);
    if (va.ok()) ++live_reservations_;
    return va;
  }
  absl::Status Free(uint64_t va, uint64_t bytes) override {
    absl::Status s = inner_->Free(va, bytes);
    if (s.ok()) --live_reservations_;
    return s;
  }
  absl::StatusOr<Chunk> Create(uint64_t bytes) override {
    Hold();
    if (absl::Status s = Fault(Op::kCreate); !s.ok()) return s;
    absl::StatusOr<Chunk> c = inner_->Create(bytes);
    if (c.ok()) ++live_chunks_;
    return c;
  }
  absl::Status Release(const Chunk& chunk) override {
    absl::Status s = inner_->Release(chunk);
    if (s.ok()) --live_chunks_;
    return s;
  }
  absl::Status Map(uint64_t va, const Chunk& chunk, Access access) override {
    if (absl::Status s = Fault(Op::kMap); !s.ok()) return s;
    absl::Status s = inner_->Map(va, chunk, access);
    if (s.ok()) ++live_mappings_;
    return s;
  }
  absl::Status Unmap(uint64_t va, uint64_t bytes) override {
    absl::Status s = inner_->Unmap(va, bytes);
    if (s.ok()) --live_mappings_;
    return s;
  }
  absl::StatusOr<int> Export(const Chunk& chunk) override {
    if (absl::Status s = Fault(Op::kExport); !s.ok()) return s;
    return inner_->Export(chunk);
  }
  absl::StatusOr<Chunk> Import(int fd, uint64_t bytes) override {
    if (absl::Status s = Fault(Op::kImport); !s.ok()) return s;
    absl::StatusOr<Chunk> c = inner_->Import(fd, bytes);
    if (c.ok()) ++live_chunks_;
    return c;
  }
  absl::Status CheckPeerAccess(absl::string_view owner_uuid) override { return inner_->CheckPeerAccess(owner_uuid); }
  DeviceCapabilities Capabilities() const override {
    DeviceCapabilities caps = inner_->Capabilities();
    if (pretend_fabric_) caps.fabric = {true, "FaultDevice::PretendFabric"};
    if (pretend_range_export_) {
      caps.dma_buf = {true, "FaultDevice::PretendRangeExport"};
      caps.range_spans_chunks = true;
    }
    return caps;
  }
  absl::StatusOr<std::string> ExportFabricHandle(const Chunk& chunk) override {
    if (absl::Status s = Fault(Op::kExportFabricHandle); !s.ok()) return s;
    if (!pretend_fabric_) return inner_->ExportFabricHandle(chunk);
    std::string bytes = "fabric-" + std::to_string(chunk.handle);
    bytes.resize(64, '\0');
    return bytes;
  }
  absl::StatusOr<int> ExportRange(uint64_t va, uint64_t bytes) override {
    if (absl::Status s = Fault(Op::kExportRange); !s.ok()) return s;
    if (!pretend_range_export_) return inner_->ExportRange(va, bytes);
    // write(2) from memory the process cannot read fails with EFAULT instead of faulting: a probe of the range.
    int probe[2];
    if (pipe(probe) != 0) return absl::InternalError("FaultDevice::ExportRange: pipe");
    bool readable = true;
    for (const uint64_t at : {va, va + bytes - 1}) {
      readable = readable && write(probe[1], reinterpret_cast<const void*>(at), 1) == 1;
    }
    close(probe[1]);
    if (!readable) {
      close(probe[0]);
      return absl::FailedPreconditionError(
          absl::StrCat("FaultDevice::ExportRange: [0x", absl::Hex(va), ", +", bytes, ") is not mapped"));
    }
    return probe[0];
  }
  absl::Status RegisterHost(void* host, uint64_t bytes) override {
    absl::Notification* release;
    {
      absl::MutexLock lock(&mu_);
      release = register_release_;
    }
    if (release != nullptr) release->WaitForNotification();
    if (absl::Status s = Fault(Op::kRegisterHost); !s.ok()) return s;
    KVD_RETURN_IF_ERROR(inner_->RegisterHost(host, bytes));
    absl::MutexLock lock(&mu_);
    registered_host_[reinterpret_cast<uintptr_t>(host)] = bytes;
    return absl::OkStatus();
  }
  absl::Status UnregisterHost(void* host) override {
    KVD_RETURN_IF_ERROR(inner_->UnregisterHost(host));
    absl::MutexLock lock(&mu_);
    registered_host_.erase(reinterpret_cast<uintptr_t>(host));
    return absl::OkStatus();
  }
  absl::Status CopyToHost(void* dst, uint64_t src_va, uint64_t bytes) override {
    CheckRegistered(dst, bytes);
    return inner_->CopyToHost(dst, src_va, bytes);
  }
  absl::Status CopyFromHost(uint64_t dst_va, const void* src, uint64_t bytes) override {
    CheckRegistered(src, bytes);
    absl::Status s = inner_->CopyFromHost(dst_va, src, bytes);
    absl::MutexLock lock(&mu_);
    if (copied_from_host_ != nullptr) std::exchange(copied_from_host_, nullptr)->Notify();
    return s;
  }
  absl::Status CopyRange(uint64_t dst_va, uint64_t src_va, uint64_t bytes) override {
    if (absl::Status s = Fault(Op::kCopyRange); !s.ok()) return s;
    return inner_->CopyRange(dst_va, src_va, bytes);
  }
  absl::Status ZeroBlocks(const BlockSpan& span, absl::Span<const uint64_t> blocks) override {
    return inner_->ZeroBlocks(span, blocks);
  }
  absl::Status CopyBlocks(const BlockSpan& span, absl::Span<const BlockCopy> copies) override {
    return inner_->CopyBlocks(span, copies);
  }
  absl::Status PackBlocks(const BlockSpan& span, absl::Span<const uint64_t> blocks, uint64_t dst) override {
    return inner_->PackBlocks(span, blocks, dst);
  }
  absl::Status UnpackBlocks(const BlockSpan& span, uint64_t src, absl::Span<const uint64_t> blocks) override {
    return inner_->UnpackBlocks(span, src, blocks);
  }

 private:
  struct Fault_ {
    int countdown = 0;
    absl::Status status;
  };
  absl::Status Fault(Op op) {
    absl::MutexLock lock(&mu_);
    ++fallible_calls_;
    if (any_fault_.countdown > 0 && --any_fault_.countdown == 0) return std::move(any_fault_.status);
    auto it = faults_.find(op);
    if (it == faults_.end()) return absl::OkStatus();
    if (--it->second.countdown > 0) return absl::OkStatus();
    absl::Status s = std::move(it->second.status);
    faults_.erase(it);
    return s;
  }

  void CheckRegistered(const void* host, uint64_t bytes) {
    const auto start = reinterpret_cast<uintptr_t>(host);
    absl::MutexLock lock(&mu_);
    auto it = registered_host_.upper_bound(start);
    if (it == registered_host_.begin() || std::prev(it)->first + std::prev(it)->second < start + bytes) {
      ++copies_outside_;
    }
  }

  void Hold() {
    absl::Notification* release;
    absl::Notification* after = nullptr;
    {
      absl::MutexLock lock(&mu_);
      release = release_;
      if (entered_ != nullptr) std::exchange(entered_, nullptr)->Notify();
      if (hold_after_release_ != nullptr && hold_after_pass_-- <= 0) after = hold_after_release_;
    }
    if (release != nullptr) release->WaitForNotification();
    if (after != nullptr) after->WaitForNotification();
  }

  std::unique_ptr<Device> inner_;
  mutable absl::Mutex mu_;
  absl::Notification* entered_ ABSL_GUARDED_BY(mu_) = nullptr;
  absl::Notification* release_ ABSL_GUARDED_BY(mu_) = nullptr;
  absl::Notification* register_release_ ABSL_GUARDED_BY(mu_) = nullptr;
  int hold_after_pass_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Notification* hold_after_release_ ABSL_GUARDED_BY(mu_) = nullptr;
  absl::Notification* copied_from_host_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::map<Op, Fault_> faults_ ABSL_GUARDED_BY(mu_);
  Fault_ any_fault_ ABSL_GUARDED_BY(mu_);
  std::map<uintptr_t, uint64_t> registered_host_ ABSL_GUARDED_BY(mu_);
  std::atomic<int> live_chunks_{0}, live_mappings_{0}, live_reservations_{0}, fallible_calls_{0}, copies_outside_{0};
  std::atomic<bool> pretend_fabric_{false};
  std::atomic<bool> pretend_range_export_{false};
};

}  // namespace kvd::testing
