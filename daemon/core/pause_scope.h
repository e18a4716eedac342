// PauseScope: the one pause of a pool under way (docs/api.md, "Pauses and reshaping"; Note [Releases pause
// first] in docs/architecture.md): the clients asked, those yet to acknowledge and those that did, the new
// chunks they may fetch and the bytes a release takes. A room of Pool (pool.h) with no lock of its own: the
// pool's state lock guards it.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "daemon/core/chunk_table.h"
#include "daemon/core/pool_types.h"

namespace kvd::daemon {

struct Pause {
  uint64_t id = 0;
  std::vector<ChunkInfo> added;
  std::map<uint64_t, int> fds;  // borrowed from the manager's records
  std::set<std::string> asked;
  std::set<std::string> waiting;
  std::set<std::string> acknowledged;
  std::vector<ByteRange> ranges;  // a release's: the bytes going away
};

class PauseScope {
 public:
  // Starts a pause (replacing any) with `added` (their FDs borrowed until it ends) or a release's `ranges`;
  // the caller asks the clients (Ask) and then Seals it.
  const Pause& Begin(const std::vector<ChunkRecord>& added, std::vector<ByteRange> ranges);
  void Ask(const std::string& client_id) { pause_->asked.insert(client_id); }
  // Every client asked is now awaited. Returns how many.
  size_t Seal();

  bool active() const { return pause_.has_value(); }
  const Pause* get() const { return pause_.has_value() ? &*pause_ : nullptr; }
  // Whether no pause waits for an acknowledgement.
  bool Settled() const { return !pause_.has_value() || pause_->waiting.empty(); }
  bool Asked(const std::string& client_id) const { return pause_.has_value() && pause_->asked.contains(client_id); }
  // Client `client_id` paused for pause `pause_id`; false unless that pause waits for it.
  bool Acknowledge(const std::string& client_id, uint64_t pause_id);
  // The client detached: the pause no longer asks or waits for it.
  void Forget(const std::string& client_id);
  // The FD of a new chunk of the pause under way (the PAUSE's lease), or -1.
  int FdOf(uint64_t chunk_id) const;
  // Ends the pause; returns it (nullopt when none was under way).
  std::optional<Pause> End();

 private:
  std::optional<Pause> pause_;
  uint64_t next_id_ = 1;
};

}  // namespace kvd::daemon
