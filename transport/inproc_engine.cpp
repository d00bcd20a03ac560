#include "transport/inproc_engine.hpp"

#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <unordered_map>

#include "transport/framing.hpp"

namespace troupe::transport {

namespace {

using clock = std::chrono::steady_clock;
constexpr std::uint32_t address_magic = 0x4e495054;  // "TPIN"
constexpr std::uint32_t region_magic = 0x47524954;   // "TIRG"

struct op_rec {
  op_spec spec;
  op_state state = op_state::prepared;
  clock::time_point deadline{};
  std::size_t moved = 0;
  const void* handed = nullptr;     // zero-copy receive: the sender's buffer
  std::shared_ptr<op_rec> partner;  // zero-copy: the send waiting for this receive's release
  error failure;
  std::uint64_t engine = 0;
};

struct region_rec {
  std::uint8_t* data = nullptr;
  std::size_t bytes = 0;
};

// Process-wide: every in-process engine, their queued sends and receives
// (by tag) and their exposed regions.
struct hub {
  std::mutex mtx;
  std::condition_variable cv;
  std::uint64_t next_engine = 1;
  std::unordered_map<std::uint64_t, bool> engines;  // alive
  std::unordered_map<std::uint64_t, std::deque<std::shared_ptr<op_rec>>> sends, recvs;
  std::unordered_map<std::uint64_t, region_rec> regions;  // by global region id
  std::uint64_t next_region = 1;

  static hub& get() {
    static hub h;
    return h;
  }

  static void fail(op_rec& o, std::string why) {
    o.state = op_state::failed;
    o.failure = error{errc::io_error, std::move(why)};
  }

  // Pairs a send with a receive (hub lock held).
  void match(const std::shared_ptr<op_rec>& s, const std::shared_ptr<op_rec>& r) {
    if (s->spec.bytes > r->spec.bytes && r->spec.local != nullptr) {
      const std::string why = "inproc: a message of " + std::to_string(s->spec.bytes) +
                              " bytes (tag " + std::to_string(s->spec.tag) +
                              ") is larger than the receive buffer of " +
                              std::to_string(r->spec.bytes);
      s->state = r->state = op_state::failed;
      s->failure = r->failure = error{errc::invalid_argument, why};
      return;
    }
    r->moved = s->spec.bytes;
    if (r->spec.local == nullptr) {
      r->handed = s->spec.local;
      r->partner = s;  // the send completes when the receive is released
    } else {
      if (s->spec.bytes) std::memcpy(r->spec.local, s->spec.local, s->spec.bytes);
      s->state = op_state::done;
      s->moved = s->spec.bytes;
    }
    r->state = op_state::done;
  }

  static void drop_from(std::deque<std::shared_ptr<op_rec>>& q, const op_rec* o) {
    for (auto it = q.begin(); it != q.end(); ++it) {
      if (it->get() == o) {
        q.erase(it);
        return;
      }
    }
  }

  void unqueue(const op_rec& o) {
    auto& m = o.spec.kind == op_kind::send ? sends : recvs;
    if (auto it = m.find(o.spec.tag); it != m.end()) {
      drop_from(it->second, &o);
      if (it->second.empty()) m.erase(it);
    }
  }

  void check_deadline(op_rec& o) {
    if (o.state != op_state::in_flight || clock::now() < o.deadline) return;
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(o.spec.timeout).count();
    unqueue(o);
    fail(o, std::string("inproc: ") + to_string(o.spec.kind) + " of " +
                std::to_string(o.spec.bytes) + " bytes (tag " + std::to_string(o.spec.tag) +
                ") timed out after " + std::to_string(ms) + " ms");
  }
};

}  // namespace

struct inproc_engine::impl {
  std::uint64_t id = 0;
  std::chrono::milliseconds default_timeout{};
  std::vector<std::uint64_t> peers;  // peer_id - 1 -> engine id
  std::unordered_map<op_handle, std::shared_ptr<op_rec>> ops;
  op_handle next_op = 1;
  std::unordered_map<region_handle, std::uint64_t> regions;  // handle -> hub region id
  region_handle next_region = 1;
};

inproc_engine::inproc_engine(std::chrono::milliseconds default_timeout)
    : p_(std::make_unique<impl>()) {
  auto& h = hub::get();
  std::lock_guard lk(h.mtx);
  p_->id = h.next_engine++;
  p_->default_timeout =
      default_timeout.count() > 0 ? default_timeout : std::chrono::milliseconds(30000);
  h.engines[p_->id] = true;
}

inproc_engine::~inproc_engine() {
  auto& h = hub::get();
  std::lock_guard lk(h.mtx);
  for (auto& [oh, o] : p_->ops) {
    h.unqueue(*o);
    if (o->partner) {
      o->partner->state = op_state::done;
      o->partner->moved = o->partner->spec.bytes;
    }
  }
  for (auto& [rh, gid] : p_->regions) h.regions.erase(gid);
  h.engines[p_->id] = false;
  h.cv.notify_all();
}

std::vector<std::uint8_t> inproc_engine::address() const {
  std::uint8_t body[8];
  std::memcpy(body, &p_->id, 8);
  return frame(address_magic, body);
}

result<peer_id> inproc_engine::connect(std::span<const std::uint8_t> peer_address) {
  auto body = unframe(address_magic, peer_address, 8, "inproc peer address");
  if (!body) return std::unexpected(body.error());
  if (body->size() != 8) return make_error(errc::corrupt_data, "inproc peer address: wrong size");
  std::uint64_t id = 0;
  std::memcpy(&id, body->data(), 8);
  auto& h = hub::get();
  std::lock_guard lk(h.mtx);
  auto it = h.engines.find(id);
  if (it == h.engines.end() || !it->second) {
    return make_error(errc::not_found,
                      "inproc: no engine " + std::to_string(id) + " in this process");
  }
  p_->peers.push_back(id);
  return static_cast<peer_id>(p_->peers.size());
}

void inproc_engine::disconnect(peer_id peer, bool /*gone*/) {
  if (peer >= 1 && peer <= p_->peers.size()) p_->peers[peer - 1] = 0;
}

result<region_handle> inproc_engine::expose(void* data, std::size_t bytes, remote_region& out) {
  if (!data || bytes == 0)
    return make_error(errc::invalid_argument, "inproc: expose needs a non-empty buffer");
  auto& h = hub::get();
  std::lock_guard lk(h.mtx);
  const std::uint64_t gid = h.next_region++;
  h.regions[gid] = region_rec{static_cast<std::uint8_t*>(data), bytes};
  std::uint8_t body[8];
  std::memcpy(body, &gid, 8);
  out.key = frame(region_magic, body);
  out.bytes = bytes;
  const region_handle rh = p_->next_region++;
  p_->regions[rh] = gid;
  return rh;
}

void inproc_engine::unexpose(region_handle region) {
  auto it = p_->regions.find(region);
  if (it == p_->regions.end()) return;
  auto& h = hub::get();
  std::lock_guard lk(h.mtx);
  h.regions.erase(it->second);
  p_->regions.erase(it);
}

result<op_handle> inproc_engine::prepare(const op_spec& spec) {
  if (spec.bytes > 0 && spec.local == nullptr && spec.kind != op_kind::recv) {
    return make_error(errc::invalid_argument,
                      std::string("inproc: ") + to_string(spec.kind) + " needs a local buffer");
  }
  if (spec.kind != op_kind::recv) {
    if (spec.peer == 0 || spec.peer > p_->peers.size() || p_->peers[spec.peer - 1] == 0) {
      return make_error(errc::invalid_argument,
                        "inproc: unknown peer " + std::to_string(spec.peer));
    }
  }
  if (spec.kind == op_kind::put || spec.kind == op_kind::get) {
    if (!spec.remote)
      return make_error(errc::invalid_argument, "inproc: put/get needs a remote region");
    auto body = unframe(region_magic, spec.remote->key, 8, "inproc remote region key");
    if (!body) return std::unexpected(body.error());
    if (body->size() != 8)
      return make_error(errc::corrupt_data, "inproc remote region key: wrong size");
    std::uint64_t gid = 0;
    std::memcpy(&gid, body->data(), 8);
    auto& h = hub::get();
    std::lock_guard lk(h.mtx);
    auto r = h.regions.find(gid);
    if (r == h.regions.end())
      return make_error(errc::not_found, "inproc: the remote region is not exposed");
    if (spec.remote_offset > r->second.bytes || spec.bytes > r->second.bytes - spec.remote_offset) {
      return make_error(errc::invalid_argument,
                        "inproc: " + std::string(to_string(spec.kind)) + " of " +
                            std::to_string(spec.bytes) + " bytes at offset " +
                            std::to_string(spec.remote_offset) + " exceeds the exposed " +
                            std::to_string(r->second.bytes) + " bytes");
    }
  }
  auto o = std::make_shared<op_rec>();
  o->spec = spec;
  if (o->spec.timeout.count() <= 0) o->spec.timeout = p_->default_timeout;
  o->engine = p_->id;
  const op_handle oh = p_->next_op++;
  p_->ops.emplace(oh, std::move(o));
  return oh;
}

result<void> inproc_engine::post(op_handle oh) {
  auto it = p_->ops.find(oh);
  if (it == p_->ops.end()) return make_error(errc::invalid_argument, "inproc: unknown operation");
  auto o = it->second;
  if (o->state != op_state::prepared)
    return make_error(errc::invalid_argument, "inproc: operation already posted");
  auto& h = hub::get();
  std::lock_guard lk(h.mtx);
  o->state = op_state::in_flight;
  o->deadline = clock::now() + o->spec.timeout;
  switch (o->spec.kind) {
    case op_kind::send: {
      if (!h.engines[p_->peers[o->spec.peer - 1]]) {
        hub::fail(*o, "inproc: the peer engine is gone");
        break;
      }
      auto q = h.recvs.find(o->spec.tag);
      if (q != h.recvs.end() && !q->second.empty()) {
        auto r = q->second.front();
        q->second.pop_front();
        if (q->second.empty()) h.recvs.erase(q);
        h.match(o, r);
      } else {
        h.sends[o->spec.tag].push_back(o);
      }
      break;
    }
    case op_kind::recv: {
      auto q = h.sends.find(o->spec.tag);
      if (q != h.sends.end() && !q->second.empty()) {
        auto s = q->second.front();
        q->second.pop_front();
        if (q->second.empty()) h.sends.erase(q);
        h.match(s, o);
      } else {
        h.recvs[o->spec.tag].push_back(o);
      }
      break;
    }
    case op_kind::put:
    case op_kind::get: {
      std::uint64_t gid = 0;
      auto body = unframe(region_magic, o->spec.remote->key, 8, "inproc remote region key");
      if (body) std::memcpy(&gid, body->data(), 8);
      auto r = h.regions.find(gid);
      if (r == h.regions.end()) {
        hub::fail(*o, "inproc: the remote region is no longer exposed");
        break;
      }
      if (o->spec.remote_offset > r->second.bytes ||
          o->spec.bytes > r->second.bytes - o->spec.remote_offset) {
        o->state = op_state::failed;
        o->failure = error{errc::invalid_argument,
                           "inproc: " + std::string(to_string(o->spec.kind)) + " of " +
                               std::to_string(o->spec.bytes) + " bytes at offset " +
                               std::to_string(o->spec.remote_offset) + " exceeds the exposed " +
                               std::to_string(r->second.bytes) + " bytes"};
        break;
      }
      std::uint8_t* remote = r->second.data + o->spec.remote_offset;
      if (o->spec.bytes) {
        if (o->spec.kind == op_kind::put) {
          std::memcpy(remote, o->spec.local, o->spec.bytes);
        } else {
          std::memcpy(o->spec.local, remote, o->spec.bytes);
        }
      }
      o->moved = o->spec.bytes;
      o->state = op_state::done;
      break;
    }
  }
  h.cv.notify_all();
  return {};
}

namespace {
op_status status_of(const op_rec& o) {
  op_status s;
  s.state = o.state;
  s.bytes = o.spec.kind == op_kind::recv ? o.moved : o.spec.bytes;
  s.data = o.handed;
  if (o.state == op_state::failed) s.failure = o.failure;
  return s;
}
}  // namespace

result<op_status> inproc_engine::poll(op_handle oh) {
  auto it = p_->ops.find(oh);
  if (it == p_->ops.end()) return make_error(errc::invalid_argument, "inproc: unknown operation");
  auto& h = hub::get();
  std::lock_guard lk(h.mtx);
  h.check_deadline(*it->second);
  return status_of(*it->second);
}

result<op_status> inproc_engine::wait(op_handle oh, std::chrono::milliseconds limit) {
  auto it = p_->ops.find(oh);
  if (it == p_->ops.end()) return make_error(errc::invalid_argument, "inproc: unknown operation");
  op_rec& o = *it->second;
  auto& h = hub::get();
  std::unique_lock lk(h.mtx);
  const auto until = clock::now() + limit;
  for (;;) {
    h.check_deadline(o);
    if (o.state != op_state::in_flight || clock::now() >= until) return status_of(o);
    h.cv.wait_until(lk, std::min(until, o.deadline));
  }
}

void inproc_engine::release(op_handle oh) {
  auto it = p_->ops.find(oh);
  if (it == p_->ops.end()) return;
  auto o = it->second;
  p_->ops.erase(it);
  auto& h = hub::get();
  std::lock_guard lk(h.mtx);
  h.unqueue(*o);
  if (o->partner) {
    // The receiver is done with the sender's buffer.
    o->partner->state = op_state::done;
    o->partner->moved = o->partner->spec.bytes;
    o->partner.reset();
  }
  h.cv.notify_all();
}

std::size_t inproc_engine::live_ops() const {
  return p_->ops.size();
}
std::size_t inproc_engine::live_regions() const {
  return p_->regions.size();
}

}  // namespace troupe::transport
