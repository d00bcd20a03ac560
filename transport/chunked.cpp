#include "transport/chunked.hpp"

#include <algorithm>

namespace troupe::transport {

namespace {

// Waits for an operation to end (each has its own deadline); an error when
// it failed.
result<op_status> await(transfer_engine& engine, op_handle op) {
  for (;;) {
    auto st = engine.wait(op, std::chrono::milliseconds(1000));
    if (!st) return std::unexpected(st.error());
    if (st->state == op_state::done) return *st;
    if (st->state == op_state::failed) return std::unexpected(st->failure);
  }
}

result<op_handle> post_op(transfer_engine& engine, const op_spec& spec) {
  auto h = engine.prepare(spec);
  if (!h) return std::unexpected(h.error());
  if (auto p = engine.post(*h); !p) {
    engine.release(*h);
    return std::unexpected(p.error());
  }
  return *h;
}

result<void> check_options(const chunk_options& opt, std::uint64_t transfer_id) {
  if (opt.chunk_bytes == 0)
    return make_error(errc::invalid_argument, "chunked transfer: chunk size must be positive");
  if (opt.window == 0)
    return make_error(errc::invalid_argument, "chunked transfer: window must be at least 1");
  if (transfer_id == 0 || transfer_id > max_transfer_id) {
    return make_error(
        errc::invalid_argument,
        "chunked transfer: transfer id " + std::to_string(transfer_id) + " is not in [1, 2^48)");
  }
  return {};
}

std::size_t chunk_size(const tensor_header& h, std::uint32_t i) {
  const std::uint64_t off = std::uint64_t{i} * h.chunk_bytes;
  return static_cast<std::size_t>(std::min<std::uint64_t>(h.chunk_bytes, h.total_bytes - off));
}

}  // namespace

tensor_sender::tensor_sender(transfer_engine& engine, peer_id peer, tensor_header header,
                             const void* data, chunk_options opt)
    : engine_(engine),
      peer_(peer),
      header_(std::move(header)),
      data_(static_cast<const std::uint8_t*>(data)),
      opt_(opt) {}

tensor_sender::~tensor_sender() {
  for (auto h : in_flight_) engine_.release(h);
}

result<void> tensor_sender::post_next() {
  op_spec s;
  s.kind = op_kind::send;
  s.peer = peer_;
  s.tag = chunk_tag(header_.transfer_id, next_chunk_);
  s.local = const_cast<std::uint8_t*>(data_ + std::uint64_t{next_chunk_} * header_.chunk_bytes);
  s.bytes = chunk_size(header_, next_chunk_);
  s.timeout = opt_.timeout;
  auto h = post_op(engine_, s);
  if (!h) return std::unexpected(h.error());
  in_flight_.push_back(*h);
  ++next_chunk_;
  return {};
}

result<void> tensor_sender::start() {
  if (started_) return make_error(errc::invalid_argument, "tensor_sender: already started");
  if (auto c = check_options(opt_, header_.transfer_id); !c) return c;
  if (auto p = plan_chunks(header_, opt_.chunk_bytes); !p) return p;
  if (header_.total_bytes > 0 && data_ == nullptr)
    return make_error(errc::invalid_argument, "tensor_sender: no data");
  started_ = true;
  header_bytes_ = encode(header_);
  op_spec s;
  s.kind = op_kind::send;
  s.peer = peer_;
  s.tag = header_tag(header_.transfer_id);
  s.local = header_bytes_.data();
  s.bytes = header_bytes_.size();
  s.timeout = opt_.timeout;
  auto h = post_op(engine_, s);
  if (!h) return std::unexpected(h.error());
  in_flight_.push_back(*h);
  while (next_chunk_ < header_.chunk_count && in_flight_.size() < opt_.window + 1) {
    if (auto p = post_next(); !p) return p;
  }
  return {};
}

result<bool> tensor_sender::progress() {
  if (!started_) return make_error(errc::invalid_argument, "tensor_sender: not started");
  while (!in_flight_.empty()) {
    auto st = engine_.poll(in_flight_.front());
    if (!st) return std::unexpected(st.error());
    if (st->state == op_state::failed) {
      return make_error(st->failure.code, "transfer " + std::to_string(header_.transfer_id) + ": " +
                                              st->failure.message);
    }
    if (st->state != op_state::done) break;
    engine_.release(in_flight_.front());
    in_flight_.erase(in_flight_.begin());
    if (next_chunk_ < header_.chunk_count) {
      if (auto p = post_next(); !p) return std::unexpected(p.error());
    }
  }
  return in_flight_.empty() && next_chunk_ == header_.chunk_count;
}

result<void> tensor_sender::finish() {
  if (!started_) {
    if (auto s = start(); !s) return s;
  }
  while (!in_flight_.empty()) {
    auto st = await(engine_, in_flight_.front());
    if (!st)
      return make_error(st.error().code, "transfer " + std::to_string(header_.transfer_id) + ": " +
                                             st.error().message);
    engine_.release(in_flight_.front());
    in_flight_.erase(in_flight_.begin());
    if (next_chunk_ < header_.chunk_count) {
      if (auto p = post_next(); !p) return p;
    }
  }
  return {};
}

tensor_receiver::tensor_receiver(transfer_engine& engine, tensor_header expected, chunk_options opt)
    : engine_(engine), expected_(std::move(expected)), opt_(opt) {}

tensor_receiver::~tensor_receiver() {
  if (header_op_) engine_.release(header_op_);
  for (auto h : ops_) engine_.release(h);
}

result<void> tensor_receiver::start() {
  if (header_op_) return {};
  if (auto c = check_options(opt_, expected_.transfer_id); !c) return c;
  header_buf_.assign(std::min<std::size_t>(opt_.limits.max_message_bytes, 64 * 1024), 0);
  op_spec s;
  s.kind = op_kind::recv;
  s.tag = header_tag(expected_.transfer_id);
  s.local = header_buf_.data();
  s.bytes = header_buf_.size();
  s.timeout = opt_.timeout;
  auto h = post_op(engine_, s);
  if (!h) return std::unexpected(h.error());
  header_op_ = *h;
  return {};
}

result<tensor_header> tensor_receiver::take_header() {
  if (auto s = start(); !s) return std::unexpected(s.error());
  auto st = await(engine_, header_op_);
  engine_.release(header_op_);
  header_op_ = 0;
  const std::string where = "transfer " + std::to_string(expected_.transfer_id) + ": ";
  if (!st) return make_error(st.error().code, where + "header: " + st.error().message);
  auto h = decode_tensor_header(std::span(header_buf_.data(), st->bytes), opt_.limits);
  if (!h) return make_error(h.error().code, where + h.error().message);
  if (auto c = check_expected(*h, expected_); !c) return std::unexpected(c.error());
  return h;
}

result<void> tensor_receiver::receive_chunks(
    const tensor_header& h, std::size_t window, const std::function<void*(std::uint32_t)>& dest,
    const std::function<result<void>(std::uint32_t, std::size_t)>& done) {
  const std::string where = "transfer " + std::to_string(h.transfer_id) + ": ";
  auto post_chunk = [&](std::uint32_t i) -> result<void> {
    op_spec s;
    s.kind = op_kind::recv;
    s.tag = chunk_tag(h.transfer_id, i);
    s.local = dest(i);
    s.bytes = chunk_size(h, i);
    s.timeout = opt_.timeout;
    auto op = post_op(engine_, s);
    if (!op) return std::unexpected(op.error());
    ops_.push_back(*op);
    return {};
  };
  std::uint32_t posted = 0;
  while (posted < h.chunk_count && posted < window) {
    if (auto p = post_chunk(posted++); !p) return p;
  }
  for (std::uint32_t i = 0; i < h.chunk_count; ++i) {
    auto st = await(engine_, ops_.front());
    engine_.release(ops_.front());
    ops_.erase(ops_.begin());
    if (!st)
      return make_error(st.error().code,
                        where + "chunk " + std::to_string(i) + ": " + st.error().message);
    if (st->bytes != chunk_size(h, i)) {
      return make_error(errc::corrupt_data,
                        where + "chunk " + std::to_string(i) + " has " + std::to_string(st->bytes) +
                            " bytes, the header says " + std::to_string(chunk_size(h, i)));
    }
    if (auto c = done(i, st->bytes); !c) return c;
    // Chunk i's buffer is free again: the chunk `window` ahead may go there.
    if (posted < h.chunk_count) {
      if (auto p = post_chunk(posted++); !p) return p;
    }
  }
  return {};
}

result<tensor_header> tensor_receiver::receive(
    const std::function<result<void>(const chunk_view&)>& consume) {
  auto h = take_header();
  if (!h) return h;
  const std::size_t window =
      std::min<std::size_t>(opt_.window, std::max<std::uint32_t>(h->chunk_count, 1));
  std::vector<std::vector<std::uint8_t>> staging(window, std::vector<std::uint8_t>(h->chunk_bytes));
  auto r = receive_chunks(
      *h, window, [&](std::uint32_t i) -> void* { return staging[i % window].data(); },
      [&](std::uint32_t i, std::size_t bytes) {
        return consume(
            chunk_view{i, std::uint64_t{i} * h->chunk_bytes, staging[i % window].data(), bytes});
      });
  if (!r) return std::unexpected(r.error());
  return h;
}

result<tensor_header> tensor_receiver::receive_into(void* dst, std::size_t capacity) {
  auto h = take_header();
  if (!h) return h;
  if (h->total_bytes > capacity) {
    return make_error(errc::invalid_argument, "transfer " + std::to_string(h->transfer_id) + ": " +
                                                  std::to_string(h->total_bytes) +
                                                  " bytes do not fit the " +
                                                  std::to_string(capacity) + "-byte destination");
  }
  auto* out = static_cast<std::uint8_t*>(dst);
  auto r = receive_chunks(
      *h, opt_.window,
      [&](std::uint32_t i) -> void* { return out + std::uint64_t{i} * h->chunk_bytes; },
      [](std::uint32_t, std::size_t) -> result<void> { return {}; });
  if (!r) return std::unexpected(r.error());
  return h;
}

result<void> send_tensor(transfer_engine& engine, peer_id peer, const tensor_header& header,
                         const void* data, const chunk_options& opt) {
  tensor_sender s(engine, peer, header, data, opt);
  if (auto r = s.start(); !r) return r;
  return s.finish();
}

result<tensor_header> receive_tensor(transfer_engine& engine, const tensor_header& expected,
                                     void* dst, std::size_t capacity, const chunk_options& opt) {
  tensor_receiver r(engine, expected, opt);
  return r.receive_into(dst, capacity);
}

}  // namespace troupe::transport
