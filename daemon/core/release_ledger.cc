#include "daemon/core/release_ledger.h"

#include <algorithm>
#include <utility>

namespace kvd::daemon {

bool ReleaseLedger::Holds(const Handed& handed, const std::vector<ChunkInfo>& chunks) {
  return std::any_of(chunks.begin(), chunks.end(), [&](const ChunkInfo& c) { return handed.contains(c.id); });
}

uint64_t ReleaseLedger::Open(uint64_t id, Release release) {
  // A detached client still holding some of the chunks is waited for too; it has no stream to be told on,
  // so its session's end (or an acknowledgement of an earlier release) settles it.
  for (const auto& [holder_id, holder] : holders_) {
    if (Holds(holder.handed, release.chunks)) release.waiting.insert(holder_id);
  }
  if (id == 0) return 0;
  releases_.emplace(id, std::move(release));
  Settle();
  return releases_.contains(id) ? id : 0;
}

const Release* ReleaseLedger::Find(uint64_t id) const {
  auto r = releases_.find(id);
  return r == releases_.end() ? nullptr : &r->second;
}

uint64_t ReleaseLedger::PendingBytes() const {
  uint64_t sum = restart_pending_bytes_;
  for (const auto& [id, r] : releases_) sum += r.bytes;
  return sum;
}

bool ReleaseLedger::Acknowledge(uint64_t id, const std::string& client_id, Handed* handed) {
  auto r = releases_.find(id);
  if (r == releases_.end() || !r->second.waiting.contains(client_id)) return false;
  r->second.waiting.erase(client_id);
  for (const ChunkInfo& chunk : r->second.chunks) handed->erase(chunk.id);
  Settle();
  return true;
}

Holder* ReleaseLedger::FindHolder(absl::string_view client_id) {
  auto h = holders_.find(client_id);
  return h == holders_.end() ? nullptr : &h->second;
}

bool ReleaseLedger::HolderAcknowledge(uint64_t id, absl::string_view client_id) {
  auto h = holders_.find(client_id);
  if (h == holders_.end()) return false;
  if (!Acknowledge(id, h->first, &h->second.handed)) return false;
  if (h->second.handed.empty()) holders_.erase(h);
  return true;
}

void ReleaseLedger::Detach(const std::string& client_id, const std::string& session, Handed held, bool keep_holding) {
  for (auto& [id, release] : releases_) {
    if (!keep_holding || !Holds(held, release.chunks)) release.waiting.erase(client_id);
  }
  if (keep_holding && !held.empty()) {
    // Its releases keep waiting for it: only the session's end proves the memory unmapped.
    holders_[client_id] = Holder{.session = session, .handed = std::move(held)};
  }
  Settle();
}

void ReleaseLedger::Forget(absl::string_view client_id) {
  // A copy: erasing the holder may free the string `client_id` views.
  const std::string id(client_id);
  if (auto h = holders_.find(id); h != holders_.end()) holders_.erase(h);
  for (auto& [release_id, release] : releases_) release.waiting.erase(id);
  Settle();
}

std::vector<std::string> ReleaseLedger::HoldersOf(absl::string_view session) const {
  std::vector<std::string> out;
  for (const auto& [id, holder] : holders_) {
    if (holder.session == session) out.push_back(id);
  }
  return out;
}

void ReleaseLedger::HandOver(absl::string_view session, const std::string& client_id, Handed* handed,
                             std::set<uint64_t>* fetched, const std::function<void(uint64_t, const Release&)>& tell) {
  for (auto h = holders_.begin(); h != holders_.end();) {
    if (h->second.session != session) {
      ++h;
      continue;
    }
    for (const auto& [chunk, bytes] : h->second.handed) {
      (*handed)[chunk] = bytes;
      fetched->insert(chunk);
    }
    for (auto& [release_id, release] : releases_) {
      if (release.waiting.erase(h->first) == 0) continue;
      release.waiting.insert(client_id);
      tell(release_id, release);
    }
    h = holders_.erase(h);
  }
}

void ReleaseLedger::Clear() {
  releases_.clear();
  holders_.clear();
  restart_pending_bytes_ = 0;
}

uint64_t ReleaseLedger::ForgetRestartPending() {
  const uint64_t bytes = restart_pending_bytes_;
  restart_pending_bytes_ = 0;
  budget_->Give(bytes);
  return bytes;
}

// See Note [Who holds a released chunk] in docs/architecture.md.
void ReleaseLedger::Settle() {
  for (auto it = releases_.begin(); it != releases_.end();) {
    if (it->second.waiting.empty()) {
      budget_->Give(it->second.bytes);
      it = releases_.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace kvd::daemon
