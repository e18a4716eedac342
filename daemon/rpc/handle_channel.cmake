# kvd_handle_channel: the handle channel server (SCM_RIGHTS over a SOCK_SEQPACKET Unix socket). Included
# from daemon/rpc/CMakeLists.txt; paths are relative to this file.
add_library(kvd_handle_channel STATIC ${CMAKE_CURRENT_LIST_DIR}/handle_channel.cc)
target_include_directories(kvd_handle_channel PUBLIC ${PROJECT_SOURCE_DIR})
target_link_libraries(kvd_handle_channel
  PUBLIC kvd_proto kvd_device kvd_peer_acceptor absl::flat_hash_map absl::span absl::status absl::statusor
         absl::strings absl::synchronization absl::time
  PRIVATE kvd_codec absl::cleanup absl::memory Threads::Threads)
kvd_target_defaults(kvd_handle_channel)
