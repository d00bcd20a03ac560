#include "transport/fault_engine.hpp"

#include <algorithm>
#include <thread>

namespace troupe::transport {

namespace {

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  for (;;) {
    const auto at = s.find(sep);
    out.push_back(s.substr(0, at));
    if (at == std::string_view::npos) return out;
    s.remove_prefix(at + 1);
  }
}

std::optional<std::uint64_t> number(std::string_view s) {
  if (s.empty() || s.size() > 18) return std::nullopt;
  std::uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + static_cast<std::uint64_t>(c - '0');
  }
  return v;
}

}  // namespace

result<std::vector<fault_rule>> parse_fault_rules(std::string_view text) {
  std::vector<fault_rule> rules;
  if (text.empty()) return rules;
  if (text.size() > 4096) return make_error(errc::invalid_argument, "fault rules: too long");
  for (auto item : split(text, ',')) {
    const auto f = split(item, ':');
    auto bad = [&](const std::string& why) {
      return make_error(errc::invalid_argument,
                        "fault rule '" + std::string(item.substr(0, 64)) + "': " + why);
    };
    if (f.size() < 3 || f.size() > 5) return bad("expected KIND:NTH:WHAT[:ARG][:min=BYTES]");
    fault_rule r;
    if (f[0] == "send")
      r.kind = op_kind::send;
    else if (f[0] == "recv")
      r.kind = op_kind::recv;
    else if (f[0] == "put")
      r.kind = op_kind::put;
    else if (f[0] == "get")
      r.kind = op_kind::get;
    else
      return bad("the kind is send, recv, put or get");
    const auto nth = number(f[1]);
    if (!nth) return bad("NTH is a count (0: every one)");
    r.nth = *nth;
    if (f[2] == "fail")
      r.what = fault_kind::fail;
    else if (f[2] == "drop")
      r.what = fault_kind::drop;
    else if (f[2] == "delay")
      r.what = fault_kind::delay;
    else if (f[2] == "truncate")
      r.what = fault_kind::truncate;
    else
      return bad("WHAT is fail, drop, delay or truncate");
    for (std::size_t i = 3; i < f.size(); ++i) {
      if (f[i].substr(0, 4) == "min=") {
        const auto v = number(f[i].substr(4));
        if (!v) return bad("min= takes a byte count");
        r.min_bytes = *v;
        continue;
      }
      const auto v = number(f[i]);
      if (!v || i != 3) return bad("ARG is a number, right after WHAT");
      if (r.what == fault_kind::delay)
        r.delay = std::chrono::milliseconds(*v);
      else if (r.what == fault_kind::truncate)
        r.bytes = *v;
      else
        return bad("only delay and truncate take an ARG");
    }
    if ((r.what == fault_kind::delay || r.what == fault_kind::truncate) && f.size() == 3)
      return bad("delay and truncate need an ARG");
    rules.push_back(r);
  }
  return rules;
}

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
  // Every rule counts the operations it could pick; the first whose count
  // matches applies.
  const fault_rule* applied = nullptr;
  for (std::size_t i = 0; i < rules_.size(); ++i) {
    const auto& r = rules_[i];
    if (r.kind != spec.kind || spec.bytes < r.min_bytes) continue;
    const auto n = ++seen_[static_cast<std::ptrdiff_t>(i)];
    if (!applied && (r.nth == 0 || r.nth == n)) applied = &r;
  }
  if (applied) {
    o.fault = applied->what;
    o.delay = applied->delay;
    if (applied->what == fault_kind::truncate) o.spec.bytes = std::min(spec.bytes, applied->bytes);
    ++injected_;
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
