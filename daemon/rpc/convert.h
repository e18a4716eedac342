// Translation between the v1 API's messages and the core's domain types. Pure functions, no I/O;
// FromProto validates nothing beyond shape (the core validates values and names the fields).
#pragma once

#include <vector>

#include "daemon/core/geometry.h"
#include "daemon/core/layout_chain.h"
#include "daemon/core/pool_manager.h"
#include "daemon/core/pool_spec.h"
#include "kvd/device.h"
#include "kvd/v1/kvd.pb.h"

namespace kvd::daemon {

LayoutRequest FromProto(const v1::LayoutRequest& proto);
PoolDims FromProto(const v1::PoolDims& proto);

v1::LayoutRule ToProto(LayoutRule rule);
v1::LayoutResolution ToProto(const LayoutResolution& resolution);
v1::PoolDims ToProto(const PoolDims& dims);
v1::Geometry ToProto(const Geometry& geometry);

// Pools, chunks, leases and events (the PoolManager's views). Times become Unix milliseconds.
PoolSpec FromProto(const v1::CreatePoolRequest& proto);
std::vector<BlockCopy> FromProto(const google::protobuf::RepeatedPtrField<v1::BlockCopy>& proto);

v1::Backend ToProto(BackendKind backend);
v1::PoolState ToProto(PoolState state);
v1::Durability ToProto(Durability durability);
v1::PoolMetadata ToProto(absl::string_view pool, const PoolMetadata& metadata);
PoolMetadata FromProto(const v1::PoolMetadata& proto);
// The saved state's (kvd/state.proto) layout and chunks: INVALID_ARGUMENT for a layout or rule this
// build does not know.
absl::StatusOr<LayoutResolution> FromProto(const v1::LayoutResolution& proto);
ChunkInfo FromProto(const v1::Chunk& proto);
// INVALID_ARGUMENT "<field>.timeout_ms: ..." past 600000.
absl::StatusOr<PauseOptions> FromProto(const v1::PauseOptions& proto, absl::string_view field);
v1::EventType ToProto(EventType type);
v1::Chunk ToProto(const ChunkInfo& chunk);
v1::Lease ToProto(const Lease& lease);
v1::ClientInfo ToProto(const ClientView& client);
v1::Pool ToProto(const PoolView& pool);
v1::PoolUpdate ToProto(const PoolUpdate& update);
v1::PoolEvent ToProto(const PoolEvent& event);
// daemon_version is the build's version (KVD_VERSION); handle_types lists what status.capabilities says
// is delivered (POSIX_FD, DMA_BUF, FABRIC); capabilities carries the probes' details.
v1::DeviceInfo ToProto(const DeviceStatus& status);
v1::DescribeTransferResponse ToProto(const TransferPlan& plan);
v1::ByteRange ToProto(const ByteRange& range);
std::vector<ByteRange> FromProto(const google::protobuf::RepeatedPtrField<v1::ByteRange>& proto);
v1::ExportRangesResponse ToProto(const RangeExport& exported, bool span_chunks);

}  // namespace kvd::daemon
