// Translation between the v1 API's messages and the core's domain types. Pure functions, no I/O;
// FromProto validates nothing beyond shape (the core validates values and names the fields). The value
// types the saved state shares (dims, layout resolution, chunks, pool state, metadata, backend) are in
// daemon/codec/codec.h, included here.
#pragma once

#include <vector>

#include "daemon/codec/codec.h"
#include "daemon/core/geometry.h"
#include "daemon/core/layout_chain.h"
#include "daemon/core/pool_manager.h"
#include "daemon/core/pool_spec.h"
#include "kvd/device.h"
#include "kvd/v1/kvd.pb.h"

namespace kvd::daemon {

LayoutRequest FromProto(const v1::LayoutRequest& proto);

v1::Geometry ToProto(const Geometry& geometry);
// The same into `out`, on its arena if it has one.
void ToProto(const Geometry& geometry, v1::Geometry* out);

// Pools, chunks, leases and events (the PoolManager's views). Times become Unix milliseconds.
PoolSpec FromProto(const v1::CreatePoolRequest& proto);
std::vector<BlockCopy> FromProto(const google::protobuf::RepeatedPtrField<v1::BlockCopy>& proto);

v1::Durability ToProto(Durability durability);
// INVALID_ARGUMENT "<field>.timeout_ms: ..." past 600000.
absl::StatusOr<PauseOptions> FromProto(const v1::PauseOptions& proto, absl::string_view field);
v1::EventType ToProto(EventType type);
v1::Lease ToProto(const Lease& lease);
void ToProto(const ClientView& client, v1::ClientInfo* out);
v1::Pool ToProto(const PoolView& pool);
v1::PoolUpdate ToProto(const PoolUpdate& update);
// The same into `out`, whose submessages are made on its arena if it has one (a reply built on an arena
// allocates nothing per chunk from the heap: Note [Replies are built on an arena] in docs/architecture.md).
void ToProto(const Lease& lease, v1::Lease* out);
void ToProto(const PoolView& pool, v1::Pool* out);
void ToProto(const PoolUpdate& update, v1::PoolUpdate* out);
v1::PoolEvent ToProto(const PoolEvent& event);
// daemon_version is the build's version (KVD_VERSION); handle_types lists what status.capabilities says
// is delivered (POSIX_FD, DMA_BUF, FABRIC); capabilities carries the probes' details.
v1::DeviceInfo ToProto(const DeviceStatus& status);
v1::DescribeTransferResponse ToProto(const TransferPlan& plan);
v1::ByteRange ToProto(const ByteRange& range);
std::vector<ByteRange> FromProto(const google::protobuf::RepeatedPtrField<v1::ByteRange>& proto);
v1::ExportRangesResponse ToProto(const RangeExport& exported, bool span_chunks);

}  // namespace kvd::daemon
