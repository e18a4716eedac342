#include "daemon/rpc/convert.h"

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "kvd/status.h"

#ifndef KVD_VERSION
#define KVD_VERSION "unknown"
#endif

namespace kvd::daemon {
namespace {

uint64_t Micros(absl::Duration d) {
  const int64_t us = absl::ToInt64Microseconds(d);
  return us > 0 ? static_cast<uint64_t>(us) : 0;
}

}  // namespace

LayoutRequest FromProto(const v1::LayoutRequest& proto) {
  LayoutRequest r;
  r.override_layout = proto.override_layout();
  r.env_layout = proto.env_layout();
  for (const v1::BackendRequirement& b : proto.backend_requirements()) {
    r.backend_requirements.push_back({b.backend(), {b.layouts().begin(), b.layouts().end()}});
  }
  for (const v1::ConnectorPreference& c : proto.connector_preferences()) {
    r.connector_preferences.push_back({c.connector(), c.layout()});
  }
  return r;
}

v1::Geometry ToProto(const Geometry& g) {
  v1::Geometry p;
  ToProto(g, &p);
  return p;
}

void ToProto(const Geometry& g, v1::Geometry* out) {
  v1::Geometry& p = *out;
  p.set_layout(std::string(g.layout().name()));
  ToProto(g.dims(), p.mutable_dims());
  p.set_stride_l(g.stride(Dim::kL));
  p.set_stride_b(g.stride(Dim::kB));
  p.set_stride_h(g.stride(Dim::kH));
  p.set_stride_n(g.stride(Dim::kN));
  p.set_stride_c(g.stride(Dim::kC));
  p.set_offset(g.offset());
  p.set_layer_stride(g.layer_stride());
  p.set_block_stride(g.block_stride());
  p.set_segments(g.segments());
  p.set_segment_stride(g.segment_stride());
  p.set_reserved_bytes(g.reserved_bytes());
  p.set_granularity_bytes(g.granularity());
}

PoolSpec FromProto(const v1::CreatePoolRequest& proto) {
  return {.name = proto.name(),
          .dims = FromProto(proto.dims()),
          .initial_blocks = proto.initial_blocks(),
          .layout_request = FromProto(proto.layout_request()),
          .allowed_uids = {proto.allowed_uids().begin(), proto.allowed_uids().end()},
          .group = {.name = proto.group().name(), .rank = proto.group().rank(), .size = proto.group().size()},
          .peer_devices = {proto.peer_devices().begin(), proto.peer_devices().end()}};
}

std::vector<BlockCopy> FromProto(const google::protobuf::RepeatedPtrField<v1::BlockCopy>& proto) {
  std::vector<BlockCopy> copies;
  copies.reserve(proto.size());
  for (const v1::BlockCopy& c : proto) copies.push_back({.src = c.src(), .dst = c.dst()});
  return copies;
}

v1::Durability ToProto(Durability durability) {
  switch (durability) {
    case Durability::kNone:
      return v1::DURABILITY_NONE;
    case Durability::kClients:
      return v1::DURABILITY_CLIENTS;
    case Durability::kFdStore:
      return v1::DURABILITY_FD_STORE;
  }
  return v1::DURABILITY_UNSPECIFIED;
}

absl::StatusOr<PauseOptions> FromProto(const v1::PauseOptions& proto, absl::string_view field) {
  constexpr uint64_t kMaxTimeoutMs = 600000;
  if (proto.timeout_ms() > kMaxTimeoutMs) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".timeout_ms: ", proto.timeout_ms(), " is more than ", kMaxTimeoutMs, " (10 minutes)"));
  }
  return PauseOptions{.timeout = absl::Milliseconds(proto.timeout_ms()),
                      .detach_unresponsive = proto.detach_unresponsive()};
}

v1::EventType ToProto(EventType type) {
  switch (type) {
    case EventType::kChunksAdded:
      return v1::EVENT_TYPE_CHUNKS_ADDED;
    case EventType::kChunksReleased:
      return v1::EVENT_TYPE_CHUNKS_RELEASED;
    case EventType::kPoolDeleted:
      return v1::EVENT_TYPE_POOL_DELETED;
    case EventType::kDaemonStopping:
      return v1::EVENT_TYPE_DAEMON_STOPPING;
    case EventType::kDaemonRestarting:
      return v1::EVENT_TYPE_DAEMON_RESTARTING;
    case EventType::kPause:
      return v1::EVENT_TYPE_PAUSE;
    case EventType::kResume:
      return v1::EVENT_TYPE_RESUME;
    case EventType::kReclaim:
      return v1::EVENT_TYPE_RECLAIM;
  }
  return v1::EVENT_TYPE_UNSPECIFIED;
}

v1::Lease ToProto(const Lease& lease) {
  v1::Lease p;
  ToProto(lease, &p);
  return p;
}

void ToProto(const Lease& lease, v1::Lease* out) {
  out->set_token(lease.token);
  out->mutable_chunk_ids()->Reserve(static_cast<int>(lease.chunk_ids.size()));
  for (uint64_t id : lease.chunk_ids) out->add_chunk_ids(id);
  out->set_expires_at_unix_ms(UnixMillis(lease.expires));
}

void ToProto(const ClientView& client, v1::ClientInfo* out) {
  v1::ClientInfo& p = *out;
  p.set_client_id(client.id);
  p.set_name(client.name);
  p.set_uid(client.uid);
  p.set_pid(client.pid);
  p.set_mapped_bytes(client.mapped_bytes);
  p.set_attached_at_unix_ms(UnixMillis(client.attached_at));
  p.set_device_uuid(client.device_uuid);
  p.set_pausable(client.pausable);
}

v1::Pool ToProto(const PoolView& pool) {
  v1::Pool p;
  ToProto(pool, &p);
  return p;
}

void ToProto(const PoolView& pool, v1::Pool* out) {
  v1::Pool& p = *out;
  p.set_name(pool.name);
  p.set_state(ToProto(pool.state));
  // In place: the reply may be on an arena, where assigning a message built on the heap copies it.
  ToProto(pool.geometry, p.mutable_geometry());
  ToProto(pool.layout, p.mutable_layout());
  p.set_committed_blocks(pool.committed_blocks);
  p.set_committed_bytes(pool.committed_bytes);
  p.set_reserved_bytes(pool.reserved_bytes);
  p.set_pending_release_bytes(pool.pending_release_bytes);
  p.set_wake_blocks(pool.wake_blocks);
  p.set_kept_bytes(pool.kept_bytes);
  p.set_owner_uid(pool.owner_uid);
  for (uint32_t uid : pool.allowed_uids) p.add_allowed_uids(uid);
  for (const ClientView& c : pool.clients) ToProto(c, p.add_clients());
  p.mutable_chunks()->Reserve(static_cast<int>(pool.chunks.size()));
  for (const ChunkInfo& c : pool.chunks) ToProto(c, p.add_chunks());
  p.set_generation(pool.generation);
  p.set_created_at_unix_ms(UnixMillis(pool.created_at));
  if (!pool.group.name.empty()) {
    p.mutable_group()->set_name(pool.group.name);
    p.mutable_group()->set_rank(pool.group.rank);
    p.mutable_group()->set_size(pool.group.size);
  }
  for (const std::string& d : pool.peer_devices) p.add_peer_devices(d);
  p.set_transaction(pool.transaction);
  p.set_epoch(pool.epoch);
  p.set_metadata_version(pool.metadata_version);
  p.set_metadata_bytes(pool.metadata_bytes);
  for (uint64_t id : pool.missing_chunk_ids) p.add_missing_chunk_ids(id);
  p.set_client_count(static_cast<uint32_t>(pool.client_count));
  const PoolClaim& claim = pool.claim;
  ToProto(claim.policy, p.mutable_policy());
  p.set_policy_operator_bounds(claim.policy.operator_bounds);
  if (claim.usage.has_value()) {
    v1::PoolUsage* u = p.mutable_usage();
    u->set_live_blocks(claim.usage->live_blocks);
    u->set_evictable_blocks(claim.usage->evictable_blocks);
    u->set_used_blocks(claim.usage->used_blocks);
    u->set_reported_at_unix_ms(UnixMillis(claim.usage->reported_at));
  }
  if (claim.reclaim.id != 0 || !claim.reclaim.last_outcome.empty()) {
    v1::ReclaimState* r = p.mutable_reclaim();
    r->set_reclaim_id(claim.reclaim.id);
    r->set_asked_bytes(claim.reclaim.asked_bytes);
    r->set_given_bytes(claim.reclaim.given_bytes);
    if (claim.reclaim.id != 0) {
      r->set_asked_at_unix_ms(UnixMillis(claim.reclaim.asked_at));
      r->set_deadline_unix_ms(UnixMillis(claim.reclaim.deadline));
    }
    r->set_last_outcome(claim.reclaim.last_outcome);
  }
  for (const WaitingView& w : claim.waiting) {
    v1::WaitingRequest* q = p.add_waiting();
    q->set_asked_bytes(w.asked_bytes);
    q->set_waiting_since_unix_ms(UnixMillis(w.since));
    q->set_position(w.position);
  }
}

v1::PoolUpdate ToProto(const PoolUpdate& update) {
  v1::PoolUpdate p;
  ToProto(update, &p);
  return p;
}

void ToProto(const PoolUpdate& update, v1::PoolUpdate* out) {
  v1::PoolUpdate& p = *out;
  ToProto(update.pool, p.mutable_pool());
  for (const ChunkInfo& c : update.added) ToProto(c, p.add_added());
  if (update.lease.has_value()) ToProto(*update.lease, p.mutable_lease());
  for (uint64_t id : update.released_chunk_ids) p.add_released_chunk_ids(id);
  p.set_release_id(update.release_id);
  p.set_elapsed_us(Micros(update.elapsed));
  if (update.reshape.has_value()) {
    const ReshapeReport& r = *update.reshape;
    v1::Reshape* q = p.mutable_reshape();
    q->set_chunks_before(r.chunks_before);
    q->set_chunks_after(r.chunks_after);
    q->set_chunks_replaced(r.chunks_replaced);
    q->set_chunks_added(r.chunks_added);
    q->set_copied_bytes(r.copied_bytes);
    q->set_copy_us(Micros(r.copy));
    q->set_paused_clients(r.paused_clients);
    q->set_pause_us(Micros(r.pause));
    q->set_resumed_clients(r.resumed_clients);
    for (const std::string& id : r.detached_client_ids) q->add_detached_client_ids(id);
    for (const BlockCopy& m : r.moved_blocks) {
      v1::BlockCopy* c = q->add_moved_blocks();
      c->set_src(m.src);
      c->set_dst(m.dst);
    }
    q->set_target_reached(r.target_reached);
    q->set_steps(r.steps);
    q->set_max_pause_us(Micros(r.max_pause));
  }
}

v1::PoolEvent ToProto(const PoolEvent& event) {
  v1::PoolEvent p;
  p.set_sequence(event.sequence);
  p.set_pool(event.pool);
  p.set_type(ToProto(event.type));
  for (const ChunkInfo& c : event.chunks) *p.add_chunks() = ToProto(c);
  if (event.lease.has_value()) *p.mutable_lease() = ToProto(*event.lease);
  p.set_release_id(event.release_id);
  p.set_committed_blocks(event.committed_blocks);
  p.set_state(ToProto(event.state));
  for (const ByteRange& r : event.ranges.empty() ? MergeChunkRanges(event.chunks) : event.ranges) {
    *p.add_ranges() = ToProto(r);
  }
  p.set_pause_id(event.pause_id);
  p.set_applied(event.applied);
  p.set_forced(event.forced);
  if (event.type == EventType::kReclaim) {
    p.set_reclaim_id(event.reclaim_id);
    p.set_reclaim_bytes(event.reclaim_bytes);
    p.set_reclaim_deadline_unix_ms(UnixMillis(event.reclaim_deadline));
  }
  return p;
}

v1::DeviceInfo ToProto(const DeviceStatus& status) {
  v1::DeviceInfo p;
  p.set_backend(ToProto(status.info.backend));
  p.set_device_index(status.info.index > 0 ? static_cast<uint32_t>(status.info.index) : 0);
  p.set_device_name(status.info.name);
  p.set_device_uuid(status.info.uuid);
  p.set_total_bytes(status.info.total_bytes);
  p.set_free_bytes(status.info.free_bytes);
  p.set_committed_bytes(status.committed_bytes);
  p.set_budget_bytes(status.budget_bytes);
  p.set_granularity_bytes(status.info.granularity);
  p.set_max_chunk_bytes(status.max_chunk_bytes);
  p.set_epoch(status.epoch);
  p.set_started_at_unix_ms(UnixMillis(status.started_at));
  p.set_durability(ToProto(status.durability));
  p.set_state_degraded(status.state.degraded());
  p.set_state_error(status.state.error);
  p.set_state_save_failures(status.state.save_failures);
  p.set_headroom_bytes(status.headroom_bytes);
  p.set_foreign_bytes(status.foreign_bytes);
  p.set_available_bytes(status.available_bytes);
  p.set_waiting_requests(status.waiting_requests);
  p.set_waiting_bytes(status.waiting_bytes);
  p.set_driver_out_of_memory(status.driver_out_of_memory);
  p.set_host_tier_bytes(status.host_tier_bytes);
  p.set_host_tier_used_bytes(status.host_tier_used_bytes);
  p.set_host_tier_ready(status.host_tier_ready);
  const DeviceCapabilities& caps = status.capabilities;
  if (caps.posix_fd.supported) p.add_handle_types(v1::HANDLE_TYPE_POSIX_FD);
  if (caps.fabric.supported) p.add_handle_types(v1::HANDLE_TYPE_FABRIC);
  if (caps.dma_buf.supported) p.add_handle_types(v1::HANDLE_TYPE_DMA_BUF);
  v1::Capabilities* c = p.mutable_capabilities();
  auto set = [](v1::Capability* out, const Capability& in) {
    out->set_supported(in.supported);
    out->set_detail(in.detail);
  };
  set(c->mutable_posix_fd(), caps.posix_fd);
  set(c->mutable_fabric(), caps.fabric);
  set(c->mutable_dma_buf(), caps.dma_buf);
  set(c->mutable_gpu_direct_rdma_vmm(), caps.gpu_direct_rdma);
  c->set_range_spans_chunks(caps.range_spans_chunks);
  for (const PeerCapability& peer : caps.peers) {
    v1::PeerAccess* out = c->add_peers();
    out->set_device_index(peer.index > 0 ? static_cast<uint32_t>(peer.index) : 0);
    out->set_device_uuid(peer.uuid);
    out->set_access(peer.access);
    out->set_detail(peer.detail);
  }
  c->set_granularity_bytes(status.info.granularity);
  c->set_max_chunk_bytes(status.max_chunk_bytes);
  p.set_driver_version(status.info.driver_version);
  p.set_daemon_version(KVD_VERSION);
  p.set_reserved_bytes(status.reserved_bytes);
  p.set_pool_count(status.pools);
  return p;
}

v1::DescribeTransferResponse ToProto(const TransferPlan& plan) {
  v1::DescribeTransferResponse out;
  for (const TransferDescriptor& d : plan.descriptors) {
    v1::TransferDescriptor* p = out.add_descriptors();
    p->set_segment(d.segment);
    p->set_offset(d.offset);
    p->set_bytes(d.bytes);
    p->set_stride(d.stride);
    p->set_count(d.count);
  }
  out.set_blocks(plan.blocks);
  out.set_bytes(plan.bytes);
  out.set_committed_blocks(plan.committed_blocks);
  out.set_generation(plan.generation);
  return out;
}

v1::ByteRange ToProto(const ByteRange& range) {
  v1::ByteRange p;
  p.set_segment(range.segment);
  p.set_offset(range.offset);
  p.set_bytes(range.bytes);
  return p;
}

std::vector<ByteRange> FromProto(const google::protobuf::RepeatedPtrField<v1::ByteRange>& proto) {
  std::vector<ByteRange> out;
  out.reserve(proto.size());
  for (const v1::ByteRange& r : proto) out.push_back({r.segment(), r.offset(), r.bytes()});
  return out;
}

v1::ExportRangesResponse ToProto(const RangeExport& exported, bool span_chunks) {
  v1::ExportRangesResponse out;
  out.set_pool(exported.pool);
  for (const RangeHandle& h : exported.handles) {
    v1::RangeHandle* p = out.add_handles();
    p->set_segment(h.segment);
    p->set_offset(h.offset);
    p->set_bytes(h.bytes);
    p->set_fd_offset(h.fd_offset);
    for (uint64_t id : h.chunk_ids) p->add_chunk_ids(id);
  }
  *out.mutable_lease() = ToProto(exported.lease);
  out.set_handle_type(v1::HANDLE_TYPE_DMA_BUF);
  out.set_ranges_span_chunks(span_chunks);
  out.set_generation(exported.generation);
  return out;
}

}  // namespace kvd::daemon
