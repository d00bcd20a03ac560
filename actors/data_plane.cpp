#include "actors/data_plane.hpp"
#include "actors/log.hpp"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <chrono>
#include <random>

#include "actors/tensor_registry.hpp"

namespace troupe::actors {

using kernels::errc;
using kernels::make_error;

namespace {
// The largest tensor a peer's ref may ask this process to allocate.
constexpr std::uint64_t opt_limits_bytes() {
  return std::uint64_t{16} << 30;
}
}  // namespace

data_plane& data_plane::local() {
  static data_plane d;
  return d;
}

data_plane::data_plane() {
  // 16 bits of process identity above a 32-bit counter (48-bit ids).
  std::random_device rd;
  prefix_ =
      ((static_cast<std::uint64_t>(rd()) ^ static_cast<std::uint64_t>(::getpid())) & 0x7fff) + 1;
}

data_plane::~data_plane() {
  {
    std::lock_guard lk(mtx_);
    stop_ = true;
  }
  cv_.notify_all();
  if (reaper_.joinable()) reaper_.join();
  std::lock_guard lk(mtx_);
  pushes_.clear();  // senders release their operations
}

void data_plane::attach(std::shared_ptr<transport::transfer_engine> engine,
                        transport::chunk_options opt) {
  std::lock_guard lk(mtx_);
  engine_ = std::move(engine);
  opt_ = opt;
  if (!reaper_.joinable()) reaper_ = std::thread([this] { reap_loop(); });
}

std::shared_ptr<transport::transfer_engine> data_plane::engine() const {
  std::lock_guard lk(mtx_);
  return engine_;
}

std::vector<std::uint8_t> data_plane::address() const {
  std::lock_guard lk(mtx_);
  return engine_ ? engine_->address() : std::vector<std::uint8_t>{};
}

kernels::result<void> data_plane::connect(const std::string& key,
                                          std::span<const std::uint8_t> address) {
  std::lock_guard lk(mtx_);
  if (!engine_)
    return make_error(errc::invalid_argument, "data plane: no transfer engine attached");
  if (peers_.count(key)) return {};
  auto p = engine_->connect(address);
  if (!p) return std::unexpected(p.error());
  peers_[key] = *p;
  return {};
}

std::optional<transport::peer_id> data_plane::peer(const std::string& key) const {
  std::lock_guard lk(mtx_);
  auto it = peers_.find(key);
  if (it == peers_.end()) return std::nullopt;
  return it->second;
}

bool data_plane::reachable(const std::string& key) const {
  std::lock_guard lk(mtx_);
  return peers_.count(key) != 0;
}

kernels::result<tensor_ref> data_plane::send(const std::string& key, const std::string& device,
                                             kernels::tensor t) {
  if (key.empty()) return park(device, std::move(t));
  return push(key, device, std::move(t));
}

tensor_ref data_plane::park(const std::string& device, kernels::tensor t) {
  return tensor_registry::local().put(device, std::move(t));
}

namespace {

/// Host memory for tensors that leave or enter a device whose memory host
/// code cannot touch (the transfer engine reads and writes host memory).
kernels::memory_pool& staging_pool() {
  static const auto pool = kernels::memory_pool::create();
  return *pool;
}

}  // namespace

kernels::result<tensor_ref> data_plane::push(const std::string& key, const std::string& device,
                                             kernels::tensor t) {
  if (!t.is_contiguous())
    return make_error(errc::invalid_argument, "data plane: only dense tensors are pushed");
  if (!kernels::host_readable(t)) {
    auto h = kernels::to_host(t, staging_pool());
    if (!h) return std::unexpected(h.error());
    t = std::move(*h);
  }
  std::unique_lock lk(mtx_);
  auto it = peers_.find(key);
  if (!engine_ || it == peers_.end()) {
    return make_error(errc::not_found, "data plane: process " + key + " is not connected");
  }
  tensor_ref ref;
  ref.device = device;
  ref.dtype = static_cast<std::uint8_t>(t.type());
  for (int i = 0; i < t.shape().ndim; ++i) ref.shape.push_back(t.shape()[i]);
  ref.transfer_id = (prefix_ << 32) | (next_++ & 0xffffffffu);
  transport::tensor_header h;
  h.transfer_id = ref.transfer_id;
  h.kind = transport::payload::activations;
  h.type = t.type();
  h.shape = ref.shape;
  h.device = device;
  push_rec rec;
  rec.t = std::move(t);
  rec.sender =
      std::make_unique<transport::tensor_sender>(*engine_, it->second, h, rec.t.data(), opt_);
  if (auto s = rec.sender->start(); !s) return std::unexpected(s.error());
  sent_[key] += rec.t.nbytes();
  pushes_.push_back(std::move(rec));
  lk.unlock();
  cv_.notify_all();
  return ref;
}

std::map<std::string, std::uint64_t> data_plane::bytes_sent() const {
  std::lock_guard lk(mtx_);
  return sent_;
}

kernels::result<kernels::tensor> data_plane::take(const tensor_ref& ref,
                                                  kernels::memory_pool& pool) {
  if (!pool.host_accessible())
    return make_error(errc::invalid_argument,
                      "data plane: take into host memory, or into a device with take(ref, device)");
  auto& reg = tensor_registry::local();
  auto local = reg.take(ref);
  if (local && !kernels::host_readable(*local)) return kernels::to_host(*local, pool);
  if (local || local.error().code != errc::not_found) return local;
  auto engine = this->engine();
  if (!engine) return local;  // no other process could have sent it
  if (ref.shape.empty() || ref.shape.size() > static_cast<std::size_t>(kernels::max_dims)) {
    return make_error(errc::invalid_argument,
                      "transfer " + std::to_string(ref.transfer_id) + ": bad shape in its ref");
  }
  if (ref.dtype > static_cast<std::uint8_t>(kernels::last_dtype)) {
    return make_error(errc::invalid_argument,
                      "transfer " + std::to_string(ref.transfer_id) + ": bad dtype in its ref");
  }
  // The ref came from another process: its shape must be sane before
  // anything is allocated for it.
  transport::tensor_header want;
  want.transfer_id = ref.transfer_id;
  want.kind = transport::payload::activations;
  want.type = static_cast<kernels::dtype>(ref.dtype);
  want.shape = ref.shape;
  if (auto p = transport::plan_chunks(want, std::size_t{1} << 30);
      !p || want.total_bytes > opt_limits_bytes()) {
    return make_error(errc::invalid_argument,
                      "transfer " + std::to_string(ref.transfer_id) + ": its ref describes " +
                          (p ? std::to_string(want.total_bytes) + " bytes, over the limit"
                             : "an impossible tensor: " + p.error().message));
  }
  kernels::shape_t shape;
  shape.ndim = static_cast<int>(ref.shape.size());
  for (std::size_t i = 0; i < ref.shape.size(); ++i) shape.dims[i] = ref.shape[i];
  auto t = kernels::tensor::empty(pool, static_cast<kernels::dtype>(ref.dtype), shape);
  if (!t) return std::unexpected(t.error());
  transport::chunk_options opt;
  {
    std::lock_guard lk(mtx_);
    opt = opt_;
  }
  auto got = transport::receive_tensor(*engine, want, t->data(), t->nbytes(), opt);
  if (!got) return std::unexpected(got.error());
  return std::move(*t);
}

kernels::result<kernels::tensor> data_plane::take(const tensor_ref& ref, kernels::device& dev) {
  auto t = take(ref, dev.memory().host_accessible() ? dev.memory() : staging_pool());
  if (!t) return t;
  return kernels::to_device(dev, *t);
}

void data_plane::forget(const std::string& key) {
  std::lock_guard lk(mtx_);
  auto it = peers_.find(key);
  if (it == peers_.end()) return;
  if (engine_) engine_->disconnect(it->second, /*gone=*/true);
  peers_.erase(it);
}

std::size_t data_plane::peers() const {
  std::lock_guard lk(mtx_);
  return peers_.size();
}

void data_plane::drop(const tensor_ref& ref) {
  tensor_registry::local().drop(ref);
}

std::size_t data_plane::pushes_in_flight() const {
  std::lock_guard lk(mtx_);
  return pushes_.size();
}

std::size_t data_plane::failed_pushes() const {
  std::lock_guard lk(mtx_);
  return failed_;
}

void data_plane::reap_loop() {
  std::unique_lock lk(mtx_);
  while (!stop_) {
    if (pushes_.empty()) {
      cv_.wait(lk);
      continue;
    }
    for (auto it = pushes_.begin(); it != pushes_.end();) {
      auto r = it->sender->progress();
      if (!r) {
        logging::of("data_plane").error("{}", r.error().message);
        ++failed_;
        it = pushes_.erase(it);
      } else if (*r) {
        it = pushes_.erase(it);
      } else {
        ++it;
      }
    }
    cv_.wait_for(lk, std::chrono::milliseconds(2));
  }
}

}  // namespace troupe::actors

#include <dirent.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/stat.h>

namespace troupe::actors {

int enable_tcp_nodelay_everywhere() {
  int changed = 0;
  DIR* d = ::opendir("/proc/self/fd");
  if (!d) return 0;
  while (dirent* e = ::readdir(d)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == ::dirfd(d)) continue;
    struct stat st {};
    if (::fstat(static_cast<int>(fd), &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    int type = 0, domain = 0;
    socklen_t len = sizeof type;
    if (::getsockopt(static_cast<int>(fd), SOL_SOCKET, SO_TYPE, &type, &len) != 0 ||
        type != SOCK_STREAM)
      continue;
    len = sizeof domain;
    if (::getsockopt(static_cast<int>(fd), SOL_SOCKET, SO_DOMAIN, &domain, &len) != 0 ||
        (domain != AF_INET && domain != AF_INET6))
      continue;
    int one = 1;
    if (::setsockopt(static_cast<int>(fd), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) == 0)
      ++changed;
  }
  ::closedir(d);
  return changed;
}

}  // namespace troupe::actors
