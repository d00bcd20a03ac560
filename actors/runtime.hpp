#pragma once

// One node's actor runtime in one process: the stages (shard + kv_store per
// device), the vision encoder and the scheduler, spawned from a config, and
// the client through which the CLI (and later the HTTP gateway) talk to it.

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "actors/client.hpp"
#include "actors/device_spec.hpp"
#include "actors/encoder.hpp"
#include "actors/node.hpp"
#include "actors/protocol.hpp"
#include "actors/scheduler.hpp"
#include "actors/stage.hpp"
#include "actors/tp_group.hpp"

namespace troupe::actors {

struct runtime_config {
  std::string model;                 ///< HF folder (LLaMA or LLaVA) or GGUF file
  std::vector<device_spec> devices;  ///< stage i runs on devices[i % size]; empty: "cpu"
  int stages = 1;                    ///< pipeline stages (contiguous, even layer ranges)
  int encoder_device = 0;            ///< index into devices for the vision encoder
  models::quant_plan plan;
  models::kv_options kv;        ///< per stage
  scheduler_options scheduler;  ///< kv / kv_blocks / micro_batches are filled in
  encoder_options encoder;
  kernels::attention_options attention;
  node_options node;
  /// "host:port" of a `troupe worker` serving the last layers: the local
  /// stages split the layers before it, and activations go to it over the
  /// transfer engine (UCX) while control goes over CAF.
  std::string remote_tail;
  /// "host:port" of `troupe worker --tp-rank R --tp-size K` processes, R =
  /// 1..K-1 (in any order): the model runs tensor-parallel over this
  /// process (rank 0) and them, joined by ring all-reduces over the
  /// transfer engine. Needs stages == 1 and no remote_tail.
  std::vector<std::string> tp_peers;
  /// How long to wait for the remote worker to answer.
  std::chrono::milliseconds remote_timeout{30000};
};

/// The actors of a running pipeline.
class local_runtime {
 public:
  /// Loads every stage and spawns the actors; errors name the stage/device.
  static kernels::result<std::unique_ptr<local_runtime>> start(caf::actor_system& sys,
                                                               const runtime_config& cfg);
  ~local_runtime();

  scheduler_actor scheduler() const { return scheduler_; }
  node_actor node() const { return node_; }
  /// The current actors (a restart replaces them).
  std::vector<shard_actor> shards() const;
  std::vector<kv_store_actor> kv_stores() const;
  encoder_actor encoder() const;
  const model_frontend& frontend() const { return frontend_; }
  /// The layer ranges of the stages, e.g. "cpu:0 [0,2) cpu:1 [2,4)".
  std::string describe() const;
  /// Stops every actor.
  void stop();
  /// Tensor parallelism across processes: this rank's all-reduce counters
  /// so far (nothing without --tp-peer) and the group's size.
  std::optional<transport::allreduce_totals> tp_allreduce() const;
  int tp_size() const;

 private:
  local_runtime() = default;
  caf::actor_system* sys_ = nullptr;
  model_frontend frontend_;
  std::vector<std::shared_ptr<stage_resources>> stage_res_;
  std::shared_ptr<encoder_resources> encoder_res_;
  std::optional<stage_handles> remote_tail_;
  std::vector<std::pair<std::string, stage_handles>> tp_peers_;  ///< address, handles (rank order)
  std::shared_ptr<tp_group> tp_;
  std::shared_ptr<node_handles> handles_ = std::make_shared<node_handles>();
  node_actor node_;
  scheduler_actor scheduler_;
};

}  // namespace troupe::actors
