#pragma once

// The compute of one step on a stage's resources, without an actor. The
// caller holds the device (res.dev->run_lock()) around run_stage and
// sample_and_continue; they take the stage's KV lock themselves.
// `generation` is the KV cache's generation the caller started with: the
// step of a shard that a restarted pipeline replaced fails with
// errc::device_unavailable.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "actors/protocol.hpp"
#include "actors/stage.hpp"
#include "kernels/tensor.hpp"

namespace troupe::actors {

/// A step's copies to and from the remote KV tier, on this stage's side:
/// `in` holds this stage's rows of each block the step brings back (in the
/// order of its remote -> device moves), fetched from the vault before the
/// step; `out` (sized by the caller: a slot per device -> remote move)
/// receives the rows of each block it copies out, in the order of those
/// moves, which the caller then puts in the vault.
struct remote_rows {
  std::span<const std::byte> in;
  std::span<std::byte> out;
};

/// Runs this stage's part of a step; returns the activations (or logits on
/// the last stage). `remote`: where the step has remote-tier moves.
kernels::result<kernels::tensor> run_stage(stage_resources& res, step_batch& b,
                                           std::uint64_t generation, remote_rows* remote = nullptr);

/// Checks a multi-step batch: only a whole-model stage runs one, and every
/// sequence must sample from a one-token input without embeddings.
kernels::result<void> check_multi_step(const stage_resources& res, const step_batch& b);

/// On the last stage: samples the sequences that ask for it from `logits`
/// (the first pass), then, for a multi-step batch, runs the further passes,
/// each feeding the tokens just sampled back in, until every sequence has
/// its max_new tokens or sampled a stop token. Fills `o.sampled`.
kernels::result<void> sample_and_continue(stage_resources& res, step_batch& b,
                                          const kernels::tensor& logits, std::uint64_t generation,
                                          step_output& o);

}  // namespace troupe::actors
