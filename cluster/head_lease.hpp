#pragma once

// Which head a node takes orders from (issue 22: one head).
//
// A head joins each node with a term: a number that only grows from one
// legitimate head to the next (the head's start time in milliseconds since
// the epoch; a standby head taking over later starts later). A node grants
// its lease to the first head it sees and then to any head with a higher
// term, and refuses a head with a lower one, or another head with the
// same. Orders (placements, pings, shutdown) are obeyed only from the
// lease's holder; an old head that comes back (a SIGSTOPped one,
// continued) is refused with error_code::not_the_head and steps down.
//
// A head must also be the process at the manifest's head address (the
// gatekeeper checks by connecting there): a process holding the head's
// certificate but not its address gets no lease, whatever its term.
//
// Plain C++ (no CAF): node ids are strings here.

#include <cstdint>
#include <mutex>
#include <string>

namespace troupe::cluster {

class head_lease {
 public:
  enum class verdict { granted, stale, contested };

  /// A head (`node_id`, `term`) asks for the lease.
  verdict offer(const std::string& node_id, std::uint64_t term);
  /// Whether orders from `node_id` are obeyed.
  bool holds(const std::string& node_id) const;

  std::uint64_t term() const { return term_; }
  const std::string& holder() const { return holder_; }

 private:
  std::string holder_;
  std::uint64_t term_ = 0;
};

const char* to_string(head_lease::verdict v);

/// The process's lease (shared by its gatekeeper and its agent).
struct shared_head_lease {
  std::mutex mtx;
  head_lease lease;
};
shared_head_lease& local_head_lease();

}  // namespace troupe::cluster
