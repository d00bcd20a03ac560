#pragma once

// Synthetic clusters and models for the placement tests.

#include <random>
#include <string>

#include "placement/planner.hpp"

namespace troupe::placement::testing {

inline constexpr double GB = 1e9;
inline constexpr double GiB = 1024.0 * 1024 * 1024;

/// A device with the same GEMV bandwidth at every precision.
inline device_profile device(std::string id, std::string node, double gemv_gbps, double tflops,
                             double memory_gib, double load = 0,
                             device_kind kind = device_kind::gpu) {
  device_profile d;
  d.id = std::move(id);
  d.node = std::move(node);
  d.kind = kind;
  d.gemv_bytes_per_s = uniform(gemv_gbps * GB);
  d.gemm_flop_per_s = tflops * 1e12;
  d.memory_bytes = memory_gib * GiB;
  d.load = load;
  return d;
}

inline link_profile link(std::string a, std::string b, double gbps, double latency_s) {
  return {std::move(a), std::move(b), gbps * GB, latency_s};
}

/// A 7B-class LLaMA with `layers` layers (LLaMA-2-7B dimensions).
inline model_profile llama7b(int layers = 32) {
  return *llama_profile(layers, 4096, 11008, 32, 32, 128, 32000, false);
}

/// A small LLaMA: 8 layers of hidden 2048, so that clusters of a few devices
/// have interesting splits.
inline model_profile small_llama(int layers = 8) {
  return *llama_profile(layers, 2048, 5632, 32, 4, 64, 32000, false);
}

}  // namespace troupe::placement::testing
