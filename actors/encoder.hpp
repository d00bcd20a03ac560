#pragma once

#include <memory>

#include "actors/core/batching.hpp"
#include "actors/device.hpp"
#include "actors/device_spec.hpp"
#include "actors/protocol.hpp"
#include "models/audio.hpp"
#include "models/image_processor.hpp"
#include "models/llava.hpp"
#include "models/video.hpp"

namespace troupe::actors {

/// Dynamic batching of an encoder (actors/core/batching.hpp).
using encoder_options = core::batching_options;

/// What a media encoder runs on: the model's vision tower, and its audio
/// tower when the model hears.
struct encoder_resources {
  device_spec device;                    ///< as the manifest names it
  std::shared_ptr<kernels::device> dev;  ///< its compute (shared with its other actors)
  std::shared_ptr<const models::llava_model> model;
  models::image_processor_config preprocessor;
  models::image_limits limits;
  models::audio_limits audio_limits;
  models::video_limits video_limits;
  /// Audio waiting to be encoded, in seconds, at most (its features are
  /// held meanwhile: about 32 KB a second); a clip past it is refused as
  /// overloaded, to be sent again later.
  double max_waiting_audio_seconds = 3600;
  /// The encoder cache: an image's rows are kept under the SHA-256 of the
  /// tower's identity (`weights_id`) and its preprocessed pixels, up to
  /// this many bytes (least recently used out first; 0: no cache).
  std::int64_t cache_bytes = std::int64_t{256} << 20;
  std::string weights_id;  ///< the model's path and weight formats
};

/// Loads the vision tower and projector of the LLaVA folder `path` on
/// `device` (and its audio tower and projector, when it has them).
kernels::result<std::shared_ptr<encoder_resources>> make_media_encoder(
    const device_spec& spec, std::shared_ptr<kernels::device> device, const std::string& path,
    const models::quant_plan& plan);

/// Spawns the encoder (detached, pinned): decodes and preprocesses each
/// image on arrival, answers at once from its cache an image it encoded
/// before (the same pixels), batches the others, runs the vision tower + projector and
/// answers each request with the embeddings' shape. An audio clip is
/// decoded and resampled on arrival and cut into the tower's windows; the
/// windows of every clip waiting are batched by their frame count (a
/// whole window's with other whole windows), and a clip is answered once
/// its last window is encoded (its rows: its windows', in order). A
/// video's sampled frames are decoded and preprocessed on arrival and wait
/// with the images (one bucket: they share the vision tower); a batch's
/// frames are pooled and projected apart from its images, and a video is
/// answered once its last frame is. It holds the rows (on
/// its device) until the requester forgets the request or goes down, and
/// sends a chunk's rows straight to the first stage's process when asked
/// (rows_atom): they never pass through the scheduler.
encoder_actor spawn_encoder(caf::actor_system& sys, std::shared_ptr<encoder_resources> res,
                            encoder_options opts);

}  // namespace troupe::actors
