#include "actors/device_probe.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>

#include "kernels/matmul.hpp"
#include "kernels/quant.hpp"

namespace troupe::actors {

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

/// The best of `run`'s rates over at least `min_reps` runs and `min_s`
/// seconds: the peak the device reaches, with the runs that met other work
/// on its cores dropped. A span of many scheduler time slices keeps a
/// moment's contention (a process starting beside it, the head's threads)
/// from lowering every run. `run` returns a rate, or 0 on failure.
template <class F>
double best_rate(F&& run, int min_reps, double min_s) {
  double best = 0;
  const auto t0 = clock_type::now();
  for (int rep = 0; rep < min_reps || (seconds_since(t0) < min_s && rep < 10000); ++rep) {
    const double r = run();
    if (!(r > 0)) return 0;
    best = std::max(best, r);
  }
  return best;
}

std::int64_t resident_now() {
  std::ifstream f("/proc/self/statm");
  std::int64_t pages = 0, resident = 0;
  if (!(f >> pages >> resident)) return 0;
  return resident * static_cast<std::int64_t>(::sysconf(_SC_PAGESIZE));
}

std::int64_t available_memory() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  std::int64_t kb = 0;
  std::string unit;
  while (f >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024;
  return 0;
}

/// Host memory for the probe's weights (and its input before the device
/// takes it).
kernels::memory_pool& host_pool() {
  static const auto pool = kernels::memory_pool::create();
  return *pool;
}

// Weight bytes per second of y = x w^T for one token, rotating through
// copies of the matrix so that the total exceeds the caches; the best of a
// few passes (the others met other work on the cores).
double gemv_rate(kernels::device& dev, kernels::weight_format f, const kernels::tensor& wf,
                 const kernels::tensor& x, kernels::tensor& y, std::size_t rotate_bytes) {
  auto wq = kernels::quantize(host_pool(), wf, f, 32);  // prepare takes host weights
  if (!wq) return 0;
  auto first = dev.prepare(*wq);
  if (!first) return 0;
  std::vector<kernels::matrix> mats{*first};
  std::size_t total = first->bytes();
  while (total < rotate_bytes) {
    auto c = dev.prepare(*wq);  // a copy in new memory
    if (!c) break;
    total += c->bytes();
    mats.push_back(std::move(*c));
  }
  for (const auto& m : mats) (void)dev.matmul(x, m, y);  // warm-up
  return best_rate(
      [&] {
        const auto t0 = clock_type::now();
        for (const auto& m : mats)
          if (!dev.matmul(x, m, y)) return 0.0;
        return static_cast<double>(total) / std::max(1e-9, seconds_since(t0));
      },
      4, 0.03);
}

double gemm_rate(kernels::device& dev, kernels::weight_format f, const kernels::tensor& wf) {
  auto w = kernels::quantize(host_pool(), wf, f, 32);
  if (!w) return 0;
  auto p = dev.prepare(*w);
  if (!p) return 0;
  const std::int64_t m = 16, n = wf.dim(0), k = wf.dim(1);
  auto x = kernels::tensor::empty(dev.memory(), kernels::dtype::f32, {m, k});
  auto y = kernels::tensor::empty(dev.memory(), kernels::dtype::f32, {m, n});
  if (!x || !y || !dev.fill_zero(*x)) return 0;
  (void)dev.matmul(*x, *p, *y);
  return best_rate(
      [&] {
        const auto t0 = clock_type::now();
        if (!dev.matmul(*x, *p, *y)) return 0.0;
        return 2.0 * static_cast<double>(m * n * k) / std::max(1e-9, seconds_since(t0));
      },
      3, 0.02);
}

}  // namespace

device_probe measure_device(kernels::device& dev, std::int64_t memory_limit) {
  device_probe p;
  p.device = dev.info().name;
  const auto t0 = clock_type::now();
  const std::int64_t own = resident_now();
  const std::int64_t cap = memory_limit > 0 ? memory_limit : available_memory() + own;
  p.memory_bytes = std::max<std::int64_t>(0, cap - own);
  if (const auto pool = static_cast<std::int64_t>(dev.info().memory_bytes);
      !dev.memory().host_accessible() && pool > 0) {
    // A device with memory of its own (a GPU): its pool's size, capped by
    // the manifest's limit.
    p.memory_bytes = memory_limit > 0 ? std::min(memory_limit, pool) : pool;
  }
  {
    std::lock_guard lock(dev.run_lock());
    p.cores = dev.info().cores;
    const std::int64_t n = 1024, k = 1024;
    auto wf = kernels::tensor::empty(host_pool(), kernels::dtype::f32, {n, k});
    auto xh = kernels::tensor::empty(host_pool(), kernels::dtype::f32, {1, k});
    auto y = kernels::tensor::empty(dev.memory(), kernels::dtype::f32, {1, n});
    kernels::result<kernels::tensor> x = kernels::make_error(kernels::errc::internal, "no input");
    if (wf && xh && y) {
      std::mt19937 gen(7);
      std::uniform_real_distribution<float> u(-1.f, 1.f);
      for (std::int64_t i = 0; i < n * k; ++i) wf->data_as<float>()[i] = u(gen);
      for (std::int64_t i = 0; i < k; ++i) xh->data_as<float>()[i] = u(gen);
      x = kernels::to_device(dev, *xh);
    }
    if (wf && x && y) {
      // 32 MiB of f32 weights per pass: past the private caches, and a
      // pass stays a few ms at tens of GB/s. A big shared L3 may still
      // hold it; the stages' weights of a small model sit there too.
      const std::size_t rotate = std::size_t{32} << 20;
      p.gemv_f32 = gemv_rate(dev, kernels::weight_format::f32, *wf, *x, *y, rotate);
      p.gemv_f16 = gemv_rate(dev, kernels::weight_format::f16, *wf, *x, *y, rotate / 2);
      p.gemv_q8_0 = gemv_rate(dev, kernels::weight_format::q8_0, *wf, *x, *y, rotate / 4);
      p.gemv_q4_0 = gemv_rate(dev, kernels::weight_format::q4_0, *wf, *x, *y, rotate / 8);
      p.gemm_f32 = gemm_rate(dev, kernels::weight_format::f32, *wf);
      p.gemm_f16 = gemm_rate(dev, kernels::weight_format::f16, *wf);
      p.gemm_q8_0 = gemm_rate(dev, kernels::weight_format::q8_0, *wf);
      p.gemm_q4_0 = gemm_rate(dev, kernels::weight_format::q4_0, *wf);
    }
    wf = {};
    xh = {};
    x = {};
    y = {};
    dev.memory().trim();
    host_pool().trim();  // the copies were the probe's, not the stages'
  }
  p.probe_ms = seconds_since(t0) * 1e3;
  return p;
}

foreign_load::foreign_load(std::vector<int> cores) : cores_(std::move(cores)) {
  online_ = std::max(1, static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN)));
  last_ = read();
}

foreign_load::times foreign_load::read() const {
  times t;
  std::ifstream f("/proc/stat");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("cpu", 0) != 0) break;
    std::istringstream in(line);
    std::string name;
    in >> name;
    bool take = false;
    if (cores_.empty()) {
      take = name == "cpu";
    } else if (name.size() > 3) {
      const int id = std::atoi(name.c_str() + 3);
      take = std::find(cores_.begin(), cores_.end(), id) != cores_.end();
    }
    if (!take) continue;
    std::int64_t v[8] = {};
    for (auto& x : v) in >> x;
    // user nice system idle iowait irq softirq steal
    const std::int64_t idle = v[3] + v[4];
    std::int64_t all = 0;
    for (auto x : v) all += x;
    t.total += all;
    t.busy += all - idle;
  }
  std::ifstream s("/proc/self/stat");
  std::string stat;
  std::getline(s, stat);
  // Fields after the command name (which may hold spaces) start past ')'.
  if (const auto close = stat.rfind(')'); close != std::string::npos) {
    std::istringstream in(stat.substr(close + 2));
    std::string field;
    std::int64_t utime = 0, stime = 0;
    for (int i = 3; i <= 15 && in >> field; ++i) {
      if (i == 14) utime = std::atoll(field.c_str());
      if (i == 15) stime = std::atoll(field.c_str());
    }
    t.self = utime + stime;
  }
  return t;
}

double foreign_load::sample() {
  const auto now = read();
  const auto prev = last_;
  last_ = now;
  const double total = static_cast<double>(now.total - prev.total);
  if (total <= 0) return 0;
  const double busy = static_cast<double>(now.busy - prev.busy);
  // This process's threads may also run on cores outside the set (an
  // unpinned scheduler thread); counting all of its time is the cautious
  // side: the other work is then never overstated.
  const double self = static_cast<double>(now.self - prev.self);
  return std::clamp((busy - self) / total, 0.0, 1.0);
}

}  // namespace troupe::actors
