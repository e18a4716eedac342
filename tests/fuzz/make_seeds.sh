#!/usr/bin/env bash
# Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/) from the text-format requests
# below, with protoc --encode: run it after changing the proto or the seeds, and commit the result.
# rpc_request_fuzzer's seeds are [method index in kvd.v1.Kvd, flags (bit 0: with the session)] + the
# request; handle_channel_fuzzer's are [mode] + the packet; layout_fuzzer's are raw bytes.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=$root/tests/fuzz/corpus
proto=$root/proto/kvd/v1/kvd.proto
encode() { protoc --proto_path="$root/proto" --encode="kvd.v1.$1" "$proto"; }

# --- rpc_request_fuzzer ---------------------------------------------------------------------------------
methods=($(sed -n 's/^ *rpc \([A-Za-z]*\)(.*/\1/p' "$proto"))
index() { for i in "${!methods[@]}"; do [[ ${methods[$i]} == "$1" ]] && { echo "$i"; return; }; done; echo "no rpc $1" >&2; exit 1; }
rm -rf "$out/rpc_request_fuzzer" && mkdir -p "$out/rpc_request_fuzzer"
rpc() {  # name method flags text
  local file=$out/rpc_request_fuzzer/$1
  printf "\\x$(printf %02x "$(index "$2")")\\x$(printf %02x "$3")" >"$file"
  encode "$2Request" <<<"$4" >>"$file"
}
dims='dims { layers: 2 capacity_blocks: 256 heads: 2 block_tokens: 16 channels: 1024 element_bytes: 2 }'
rpc get_device_info GetDeviceInfo 0 ''
rpc resolve_layout ResolveLayout 0 "layout_request { backend_requirements { backend: \"FLASHINFER\" layouts: \"block-outermost\" } connector_preferences { connector: \"nixl\" layout: \"BLNHC\" } } $dims"
rpc resolve_conflict ResolveLayout 0 'layout_request { backend_requirements { backend: "A" layouts: "LBNHC" } backend_requirements { backend: "B" layouts: "BLNHC" } }'
rpc create CreatePool 1 "name: \"q\" $dims initial_blocks: 16 layout_request { env_layout: \"BLHNC\" } allowed_uids: 1001"
rpc create_group CreatePool 1 "name: \"g\" $dims group { name: \"engine\" rank: 1 size: 2 } peer_devices: \"*\""
rpc create_no_session CreatePool 0 "name: \"q\" $dims"
rpc get_pool GetPool 1 'name: "p"'
rpc list_pools ListPools 1 ''
rpc delete_pool DeletePool 1 'name: "p" force: true'
rpc attach Attach 1 'pool: "p" client_name: "engine"'
rpc attach_peer Attach 1 'pool: "p" client_name: "peer" device_uuid: "GPU-0000"'
rpc detach Detach 1 'pool: "p" client_id: "c1"'
rpc grow Grow 1 'pool: "p" target_blocks: 200'
rpc grow_past_capacity Grow 1 'pool: "p" target_blocks: 100000'
rpc shrink Shrink 1 'pool: "p" target_blocks: 8'
rpc shrink_wait Shrink 1 'pool: "p" target_blocks: 8 wait_for_release: true'
rpc sleep Sleep 1 'pool: "p"'
rpc sleep_all Sleep 1 'all: true'
rpc wake Wake 1 'pool: "p"'
rpc wake_all Wake 1 'all: true'
rpc watch Watch 1 'client_id: "c1"'
rpc acknowledge Acknowledge 1 'client_id: "c1" release_id: 1'
rpc zero_blocks ZeroBlocks 1 'pool: "p" block_ids: [0, 1, 63]'
rpc zero_blocks_repeated ZeroBlocks 1 'pool: "p" block_ids: [5, 5, 5, 5, 5, 5, 5, 5]'
rpc copy_blocks CopyBlocks 1 'pool: "p" copies { src: 0 dst: 1 } copies { src: 2 dst: 3 }'
rpc prepare_grow Prepare 1 'pool: "p" operation: OPERATION_GROW target_blocks: 128 ttl_ms: 1000'
rpc prepare_sleep Prepare 1 'pool: "p" operation: OPERATION_SLEEP'
rpc commit Commit 1 'transaction: "t1" wait_for_release: true'
rpc abort Abort 1 'transaction: "t1"'
rpc grant GrantPeerAccess 1 'pool: "p" device_uuid: "*"'
rpc revoke GrantPeerAccess 1 'pool: "p" device_uuid: "GPU-1" revoke: true'
rpc describe_transfer DescribeTransfer 1 'pool: "p" block_ids: [0, 7, 3]'
rpc describe_all DescribeTransfer 1 'pool: "p"'
rpc export_ranges ExportRanges 1 'client_id: "c1" ranges { offset: 0 bytes: 2097152 }'
rpc get_metadata GetPoolMetadata 1 'pool: "p"'
rpc set_metadata SetPoolMetadata 1 'pool: "p" expected_version: 0 data: "engine state"'
printf '\x04\x01\xff\xff\xff\xff\xff' >"$out/rpc_request_fuzzer/unparseable"
printf '\x02\x01\x0a\x02\xc3\x28' >"$out/rpc_request_fuzzer/invalid_utf8_name"

# --- handle_channel_fuzzer ------------------------------------------------------------------------------
hc=$out/handle_channel_fuzzer
rm -rf "$hc" && mkdir -p "$hc"
packet() { printf '\x00' >"$hc/$1"; encode HandleChannelRequest <<<"$2" >>"$hc/$1"; }
packet open_session 'open_session { client_name: "engine-0" }'
packet open_session_bad_name 'open_session { client_name: "bad name\n" }'
packet fetch_unknown 'fetch_handles { session_token: "s" lease_token: "l" }'
packet fetch_empty 'fetch_handles { }'
packet return_handles 'return_handles { session_token: "s" pool: "p" chunk_ids: [1, 2] last: true }'
packet nothing_set ''
printf '\x00\xff\xff\xff' >"$hc/garbage"
printf '\x01\x03' >"$hc/fetch_valid"
printf '\x01\x01lease' >"$hc/fetch_wrong_lease"
printf '\x01\x02session' >"$hc/fetch_wrong_session"
printf '\x01\x03\x1a\x00' >"$hc/fetch_valid_trailing_field"

# --- layout_fuzzer --------------------------------------------------------------------------------------
lf=$out/layout_fuzzer
rm -rf "$lf" && mkdir -p "$lf"
for i in $(seq 1 16); do head -c $((32 * i)) /dev/zero | tr '\0' "\\$(printf %03o $((i * 13 % 256)))" >"$lf/fill_$i"; done
printf 'LBNHC\x01\x02\x03\x04\x05\x06\x07\x08block-outermost\x00\x10\x20\x40\x80' >"$lf/names"
