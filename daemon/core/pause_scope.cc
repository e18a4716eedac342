#include "daemon/core/pause_scope.h"

#include <utility>

namespace kvd::daemon {

const Pause& PauseScope::Begin(const std::vector<ChunkRecord>& added, std::vector<ByteRange> ranges) {
  Pause pause{.id = next_id_++, .ranges = std::move(ranges)};
  for (const ChunkRecord& r : added) {
    pause.added.push_back(r.info);
    pause.fds[r.info.id] = r.fd();
  }
  pause_ = std::move(pause);
  return *pause_;
}

size_t PauseScope::Seal() {
  pause_->waiting = pause_->asked;
  return pause_->asked.size();
}

bool PauseScope::Acknowledge(const std::string& client_id, uint64_t pause_id) {
  if (!pause_.has_value() || pause_->id != pause_id || !pause_->waiting.contains(client_id)) return false;
  pause_->waiting.erase(client_id);
  pause_->acknowledged.insert(client_id);
  return true;
}

void PauseScope::Forget(const std::string& client_id) {
  if (!pause_.has_value()) return;
  pause_->waiting.erase(client_id);
  pause_->asked.erase(client_id);
}

int PauseScope::FdOf(uint64_t chunk_id) const {
  if (!pause_.has_value()) return -1;
  auto it = pause_->fds.find(chunk_id);
  return it == pause_->fds.end() ? -1 : it->second;
}

std::optional<Pause> PauseScope::End() {
  std::optional<Pause> ended = std::move(pause_);
  pause_.reset();
  return ended;
}

}  // namespace kvd::daemon
