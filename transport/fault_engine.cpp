#include "transport/fault_engine.hpp"

#include <algorithm>
#include <thread>

namespace troupe::transport {

fault_engine::fault_engine(std::shared_ptr<transfer_engine> inner,
                           std::chrono::milliseconds default_timeout)
    : inner_(std::move(inner)), default_timeout_(default_timeout) {}

void fault_engine::inject(fault_rule rule) {
  std::lock_guard lock(mtx_);
  rules_.push_back(rule);
}

std::size_t fault_engine::injected() const {
  std::lock_guard lock(mtx_);
  return injected_;
}

std::size_t fault_engine::live_ops() const {
  std::lock_guard lock(mtx_);
  return ops_.size();
}

result<op_handle> fault_engine::prepare(const op_spec& spec) {
  std::lock_guard lock(mtx_);
  op o;
  o.spec = spec;
  const auto n = ++seen_[spec.kind];
  for (const auto& r : rules_) {
    if (r.kind != spec.kind || (r.nth != 0 && r.nth != n)) continue;
    o.fault = r.what;
    o.delay = r.delay;
    if (r.what == fault_kind::truncate) o.spec.bytes = std::min(spec.bytes, r.bytes);
    ++injected_;
    break;
  }
  if (o.fault != fault_kind::drop && o.fault != fault_kind::fail) {
    auto h = inner_->prepare(o.spec);
    if (!h) return std::unexpected(h.error());
    o.inner = *h;
  }
  const auto handle = next_++;
  ops_.emplace(handle, std::move(o));
  return handle;
}

result<void> fault_engine::post(op_handle handle) {
  std::lock_guard lock(mtx_);
  auto it = ops_.find(handle);
  if (it == ops_.end()) return make_error(errc::invalid_argument, "fault engine: unknown op");
  auto& o = it->second;
  if (o.posted) return make_error(errc::invalid_argument, "fault engine: posted twice");
  o.posted = true;
  o.posted_at = clock::now();
  if (o.fault == fault_kind::fail)
    return make_error(errc::io_error,
                      std::string("injected fault: the ") + to_string(o.spec.kind) + " failed");
  if (o.fault == fault_kind::drop || o.fault == fault_kind::delay) return {};
  o.inner_posted = true;
  return inner_->post(o.inner);
}

result<op_status> fault_engine::advance(op& o) {
  op_status s;
  if (!o.posted) return s;  // prepared
  if (o.fault == fault_kind::fail) {
    s.state = op_state::failed;
    s.failure = error{errc::io_error, "injected fault: failed"};
    return s;
  }
  if (o.fault == fault_kind::drop) {
    const auto limit = o.spec.timeout.count() > 0 ? o.spec.timeout : default_timeout_;
    s.state = clock::now() - o.posted_at >= limit ? op_state::failed : op_state::in_flight;
    if (s.state == op_state::failed)
      s.failure = error{errc::io_error, std::string("injected fault: the ") +
                                            to_string(o.spec.kind) + " was dropped and timed out"};
    return s;
  }
  if (!o.inner_posted) {  // delayed
    if (clock::now() - o.posted_at < o.delay) {
      s.state = op_state::in_flight;
      return s;
    }
    o.inner_posted = true;
    if (auto p = inner_->post(o.inner); !p) {
      s.state = op_state::failed;
      s.failure = p.error();
      return s;
    }
  }
  return inner_->poll(o.inner);
}

result<op_status> fault_engine::poll(op_handle handle) {
  std::lock_guard lock(mtx_);
  auto it = ops_.find(handle);
  if (it == ops_.end()) return make_error(errc::invalid_argument, "fault engine: unknown op");
  return advance(it->second);
}

result<op_status> fault_engine::wait(op_handle handle, std::chrono::milliseconds limit) {
  const auto until = clock::now() + limit;
  for (;;) {
    std::unique_lock lock(mtx_);
    auto it = ops_.find(handle);
    if (it == ops_.end()) return make_error(errc::invalid_argument, "fault engine: unknown op");
    auto& o = it->second;
    auto s = advance(o);
    if (!s || s->state == op_state::done || s->state == op_state::failed) return s;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - clock::now());
    if (left.count() <= 0) return s;
    if (o.inner_posted && o.inner != 0) {
      const auto inner = o.inner;
      lock.unlock();  // the wrapped engine sleeps on its own event source
      return inner_->wait(inner, left);
    }
    lock.unlock();
    std::this_thread::sleep_for(std::min(left, std::chrono::milliseconds(1)));
  }
}

void fault_engine::release(op_handle handle) {
  std::lock_guard lock(mtx_);
  auto it = ops_.find(handle);
  if (it == ops_.end()) return;
  if (it->second.inner != 0) inner_->release(it->second.inner);
  ops_.erase(it);
}

}  // namespace troupe::transport
