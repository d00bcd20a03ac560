#pragma once

// Turning a client's job into the scheduler's request, off the head's
// threads. The head runs on CAF's scheduler (one worker thread), where it
// also answers heartbeats, places the model and serves `troupe status`; a
// long prompt (chat template, tokenizer) must not hold that thread. Each
// job is rendered on a detached actor of its own, which answers once and
// stops.

#include <functional>
#include <memory>

#include "actors/prompt.hpp"
#include "actors/protocol.hpp"

namespace troupe::actors {

/// How a prompt becomes token ids (render_prompt; tests inject their own).
using prompt_renderer = std::function<kernels::result<std::vector<std::int32_t>>(
    const prompt_setup&, const prompt_input&)>;

/// The scheduler's request for `job`: its prompt rendered, its sampling
/// from the job and the model's generation defaults. The error is the
/// user's (an invalid_request with the reason).
std::expected<generate_request, caf::error> request_of(const prompt_setup& setup,
                                                       const prompt_renderer& render,
                                                       job_request job);

/// Puts `images`, `audios` and `videos` into `req.media` in the order of
/// their placeholders in `req.prompt_tokens`, each clip's token count into
/// `req.audio_tokens` and each video's into `req.video_tokens`: each clip
/// is decoded here, each video's headers and packets read (a bad one is
/// refused now, by name, an invalid_request).
std::expected<void, caf::error> place_media(const prompt_setup& setup,
                                            std::vector<media_data> images,
                                            std::vector<media_data> audios, generate_request& req,
                                            std::vector<media_data> videos = {});

/// The sampling a video item asks for (its num_frames, 0: the default, and fps).
models::video_sampling video_sampling_of(const media_data& v);

/// A one-shot renderer: answers one render_atom with the request (or the
/// refusal), then stops.
using prompt_worker_actor =
    caf::typed_actor<caf::replies_to<render_atom, job_request>::with<generate_request>>;

/// Spawns a prompt worker on a thread of its own. `render` empty:
/// render_prompt.
prompt_worker_actor spawn_prompt_worker(caf::actor_system& sys,
                                        std::shared_ptr<const prompt_setup> setup,
                                        prompt_renderer render);

}  // namespace troupe::actors
