#pragma once

// The gateway's Prometheus metrics: vLLM's names under a `troupe:` prefix
// (requests, tokens, latency histograms), rendered in the text exposition
// format. Thread-safe; the HTTP handlers record, /metrics renders.

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "actors/protocol.hpp"

namespace troupe::serve {

class histogram {
 public:
  explicit histogram(std::vector<double> bounds)
      : bounds_(std::move(bounds)), counts_(bounds_.size() + 1) {}
  void observe(double v);
  /// The text lines of `name` (buckets, _sum, _count); `labels` (e.g.
  /// `model_name="m"`) go on each.
  void render(std::string& out, const std::string& name, const std::string& labels = "") const;
  std::uint64_t count() const { return count_; }

 private:
  std::vector<double> bounds_;
  std::vector<std::uint64_t> counts_;
  double sum_ = 0;
  std::uint64_t count_ = 0;
};

class metrics {
 public:
  /// `model_name`: the served name, the model_name label of the request
  /// and cluster metrics (vLLM's).
  explicit metrics(std::string model_name = "troupe");
  /// A request ended (the gateway saw its finish event).
  void finished(const actors::finish_event& f, const std::vector<double>& token_gaps_s);
  void failed_http(int status);
  /// A response went out with this status (every request, errors included).
  void responded(int status);
  /// Renders everything, with the cluster's gauges from `status`.
  std::string render(const actors::cluster_status* status) const;

 private:
  mutable std::mutex mtx_;
  std::map<std::string, std::uint64_t> success_;   ///< by finished_reason
  std::map<int, std::uint64_t> http_errors_;       ///< by status
  std::map<int, std::uint64_t> responses_;         ///< by status, every response
  std::map<std::string, std::uint64_t> failures_;  ///< requests that ended in an error, by code
  std::uint64_t prompt_tokens_ = 0, generation_tokens_ = 0, preemptions_ = 0;
  std::string label_;  ///< model_name="..."
  histogram ttft_, itl_, e2e_, queue_;
  histogram prompt_hist_, generation_hist_;  ///< tokens per request
  histogram prefill_, decode_, inference_;   ///< seconds per request
};

}  // namespace troupe::serve
