// Audio clips through the actors (prompt placement, the encoder's batched
// windows, the scheduler, the stages) against llava_model::prepare and the
// plain generation loop: token-identical, alone and together, on one and
// two stages; bad clips fail their own request only.
#include <gtest/gtest.h>

#include <condition_variable>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>

#include "actor_test.hpp"
#include "actors/data_plane.hpp"
#include "actors/encoder.hpp"
#include "actors/prompt.hpp"
#include "actors/prompt_worker.hpp"
#include "actors/runtime.hpp"
#include "kernels/cpu/cpu_device.hpp"
#include "llava_reference.hpp"
#include "models/audio.hpp"
#include "models/generate.hpp"
#include "models/image.hpp"
#include "models/image_processor.hpp"
#include "models/llava.hpp"
#include "models/tokenizer.hpp"

namespace troupe::actors {
namespace {

// The bundled shapes model with a random audio tower (tools/make_hearing_fixture.py).
const std::string model_dir = std::string(TROUPE_FIXTURES_DIR) + "/llava_hears";
const std::string audio_dir = std::string(TROUPE_FIXTURES_DIR) + "/audio";
const std::string shapes_dir = std::string(TROUPE_FIXTURES_DIR) + "/shapes";

std::vector<std::uint8_t> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

struct audio_case {
  std::string prompt;              // with <image> and <audio> where they go
  std::vector<std::string> media;  // files in prompt order: *.png from shapes, others from audio
  int max_tokens = 12;
};

/// A troupe error's message.
std::string why(const caf::error& e) {
  return e.context().match_elements<std::string>() ? e.context().get_as<std::string>(0) : "";
}

bool is_image(const std::string& f) {
  return f.ends_with(".png");
}

std::string path_of(const std::string& f) {
  return (is_image(f) ? shapes_dir : audio_dir) + "/" + f;
}

class reference : test::llava_parts {
 public:
  reference() : llava_parts(model_dir) {}

  std::vector<std::int32_t> ids(const audio_case& c) const {
    auto ids = tok_->encode("USER: " + c.prompt + " ASSISTANT:", true, true);
    EXPECT_TRUE(ids);
    return *ids;
  }

  models::sampling_params params(const audio_case& c) const {
    models::sampling_params p;
    p.max_tokens = c.max_tokens;
    if (auto eos = tok_->special_ids().eos) p.stop_token_ids.push_back(*eos);
    return p;
  }

  /// llava_model::prepare (every clip encoded alone, window by window) and
  /// the plain generation loop.
  std::vector<std::int32_t> solo(const audio_case& c) {
    std::vector<float> pixels;
    std::int64_t n_images = 0;
    std::vector<std::vector<float>> clips;
    for (const auto& f : c.media) {
      if (is_image(f)) {
        auto img = models::load_image(path_of(f));
        EXPECT_TRUE(img);
        auto p = models::preprocess_image(*img, pre_);
        EXPECT_TRUE(p);
        pixels.insert(pixels.end(), p->data.begin(), p->data.end());
        ++n_images;
      } else {
        auto a = models::decode_audio_at(read_bytes(path_of(f)), 16000);
        EXPECT_TRUE(a) << (a ? "" : a.error().message);
        clips.push_back(std::move(a->samples));
      }
    }
    const std::int64_t side = model_->image_size();
    kernels::tensor pv;
    if (n_images > 0)
      pv = *kernels::tensor::view(pixels.data(), kernels::dtype::f32, {n_images, 3, side, side});
    std::vector<std::span<const float>> spans(clips.begin(), clips.end());
    auto prep = model_->prepare(*ctx_, ids(c), pv, spans);
    EXPECT_TRUE(prep) << (prep ? "" : prep.error().message);
    return prep ? generate_alone(*prep, params(c)) : std::vector<std::int32_t>{};
  }

  /// The scheduler's request, as the prompt worker makes it.
  generate_request request(const audio_case& c, std::uint64_t id) const {
    generate_request r;
    r.id = id;
    r.prompt_tokens = ids(c);
    r.params = params(c);
    std::vector<media_data> images, audios;
    for (const auto& f : c.media)
      (is_image(f) ? images : audios)
          .push_back(
              {f, read_bytes(path_of(f)), is_image(f) ? media_kind::image : media_kind::audio});
    auto setup = load_prompt_setup(model_dir);
    EXPECT_TRUE(setup) << (setup ? "" : setup.error().message);
    auto placed = place_media(*setup, std::move(images), std::move(audios), r);
    EXPECT_TRUE(placed);
    return r;
  }

  const models::llava_model& model() const { return *model_; }
};

reference& ref() {
  static reference r;
  return r;
}

std::vector<audio_case> cases() {
  return {
      {"<audio>\nDescribe the image.", {"speech16k.wav"}},
      {"<image>\n<audio>\nDescribe the image.", {"shapes_001.png", "speech16k.mp3"}},
      {"<audio>\n<audio>\nDescribe the image.", {"speech16k.flac", "stereo44k_24.wav"}},
      {"<audio>\n<image>\nDescribe the image.", {"float16k.wav", "shapes_004.png"}},
      {"<audio>\nDescribe the image.", {"speech16k.wav"}},  // the first clip again
  };
}

struct audio_pipeline_test : ::testing::Test {
  caf::actor_system sys{test::actor_config()};

  std::unique_ptr<local_runtime> start(int stages, int max_batch = 8,
                                       std::int64_t stream_idle_ms = 30000) {
    runtime_config cfg;
    cfg.model = model_dir;
    cfg.stages = stages;
    cfg.encoder.max_batch = max_batch;
    cfg.encoder.max_wait_ms = 20;
    cfg.scheduler.stream_idle_ms = stream_idle_ms;
    auto d = parse_devices(stages > 1 ? "cpu:0-0,cpu:1-1" : "cpu");
    EXPECT_TRUE(d);
    cfg.devices = *d;
    auto rt = local_runtime::start(sys, cfg);
    EXPECT_TRUE(rt) << (rt ? "" : rt.error().message);
    return std::move(*rt);
  }
};

using test::run_all;

TEST(AudioPlacement, MediaFollowTheirPlaceholdersAndClipsAreCountedOnce) {
  auto r = ref().request(cases()[3], 1);  // <audio> then <image>
  ASSERT_EQ(r.media.size(), 2u);
  EXPECT_EQ(r.media[0].kind, media_kind::audio);
  EXPECT_EQ(r.media[0].name, "float16k.wav");
  EXPECT_EQ(r.media[1].kind, media_kind::image);
  // 0.5 s: one window of 50 frames -> 25 encoder rows -> ceil(25 / 8) tokens.
  ASSERT_EQ(r.audio_tokens.size(), 1u);
  EXPECT_EQ(r.audio_tokens[0], ref().model().audio_tokens(8000));
  EXPECT_EQ(r.audio_tokens[0], 4);
  auto two = ref().request(cases()[2], 2);
  ASSERT_EQ(two.audio_tokens.size(), 2u);
  // 3.3 s: a whole window (13 tokens) and 130 frames (65 rows, 9 tokens).
  EXPECT_EQ(two.audio_tokens[0], 22);
  EXPECT_EQ(two.audio_tokens[1], ref().model().audio_tokens(16000));
}

TEST(AudioPlacement, BadClipsAndMismatchesAreRefusedByName) {
  auto setup = load_prompt_setup(model_dir);
  ASSERT_TRUE(setup);
  EXPECT_EQ(setup->audio_text, "<audio>");
  generate_request r;
  r.prompt_tokens = ref().ids(cases()[0]);
  auto garbage = place_media(*setup, {}, {{"noise.wav", {'R', 'I', 'F', 'F', 1, 2, 3}, {}}}, r);
  ASSERT_FALSE(garbage);
  EXPECT_NE(why(garbage.error()).find("noise.wav"), std::string::npos);
  generate_request two;
  two.prompt_tokens = ref().ids(cases()[0]);  // one placeholder
  auto clip = read_bytes(audio_dir + "/float16k.wav");
  auto extra = place_media(*setup, {}, {{"a.wav", clip, {}}, {"b.wav", clip, {}}}, two);
  ASSERT_FALSE(extra);
  EXPECT_NE(why(extra.error()).find("1 of 2 audio clips"), std::string::npos) << why(extra.error());
  // A model that does not hear.
  auto deaf = load_prompt_setup(TROUPE_BUNDLED_MODEL);
  ASSERT_TRUE(deaf);
  generate_request d;
  d.prompt_tokens = {0, 5, 6};
  auto refused = place_media(*deaf, {}, {{"a.wav", clip, {}}}, d);
  ASSERT_FALSE(refused);
  EXPECT_NE(why(refused.error()).find("no audio tower"), std::string::npos);
}

TEST_F(audio_pipeline_test, clips_alone_and_together_match_prepare_on_one_and_two_stages) {
  const auto cs = cases();
  std::vector<std::vector<std::int32_t>> want;
  for (const auto& c : cs) want.push_back(ref().solo(c));
  // The answers depend on the clips (else this test could not see rows
  // gone astray): another clip, another answer.
  auto other = cs[0];
  other.media = {"float16k.wav"};
  ASSERT_NE(ref().solo(other), want[0]);
  for (const auto& w : want) EXPECT_GE(w.size(), 4u);
  for (int stages : {1, 2}) {
    auto rt = start(stages);
    client cl(sys, rt->scheduler());
    // One at a time: each clip's windows batched with its own.
    for (std::size_t i = 0; i < cs.size(); ++i) {
      auto f = cl.run(ref().request(cs[i], client::next_id()));
      ASSERT_TRUE(f) << f.error().message;
      EXPECT_EQ(f->tokens, want[i]) << stages << " stage(s): " << cs[i].prompt;
      EXPECT_NE(f->reason, finish_reason::error) << f->error;
    }
    // All at once: windows of different clips and requests in one batch.
    std::vector<generate_request> reqs;
    for (const auto& c : cs) reqs.push_back(ref().request(c, client::next_id()));
    auto got = run_all(cl, reqs);
    for (std::size_t i = 0; i < cs.size(); ++i) {
      EXPECT_EQ(got[i].tokens, want[i]) << stages << " stage(s), together: " << cs[i].prompt;
      EXPECT_NE(got[i].reason, finish_reason::error) << got[i].error;
    }
  }
}

TEST_F(audio_pipeline_test, a_bad_clip_fails_its_request_and_the_others_go_on) {
  auto rt = start(1);
  client cl(sys, rt->scheduler());
  const auto cs = cases();
  auto bad = ref().request(cs[0], client::next_id());
  bad.media[0].bytes.resize(60);  // a WAV header and a few samples, lying about its length
  bad.media[0].name = "cut.wav";
  auto garbage = ref().request(cs[1], client::next_id());
  garbage.media[1].bytes.assign(4000, 0x5a);
  garbage.media[1].name = "noise.mp3";
  auto good = ref().request(cs[2], client::next_id());
  auto got = run_all(cl, {bad, garbage, good});
  EXPECT_EQ(got[0].reason, finish_reason::error);
  EXPECT_NE(got[0].error.find("cut.wav"), std::string::npos) << got[0].error;
  EXPECT_EQ(got[1].reason, finish_reason::error);
  EXPECT_NE(got[1].error.find("noise.mp3"), std::string::npos) << got[1].error;
  EXPECT_EQ(got[2].tokens, ref().solo(cs[2])) << got[2].error;
  // A clip whose token count the request states wrongly is caught where
  // the encoder's rows arrive.
  auto lying = ref().request(cs[0], client::next_id());
  lying.audio_tokens[0] += 1;
  auto f = cl.run(lying);
  ASSERT_TRUE(f);
  EXPECT_EQ(f->reason, finish_reason::error);
  EXPECT_NE(f->error.find("does not match the prompt"), std::string::npos) << f->error;
  // Counts that do not match the clips are refused at admission.
  auto miscounted = ref().request(cs[0], client::next_id());
  miscounted.audio_tokens.push_back(3);
  auto r = cl.submit(miscounted, {});
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code, error_code::invalid_request);
  // Media out of their placeholders' order (an image where the prompt
  // places a clip) are refused at admission, naming both.
  auto swapped = ref().request(cs[1], client::next_id());  // <image> then <audio>
  std::swap(swapped.media[0], swapped.media[1]);
  r = cl.submit(swapped, {});
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code, error_code::invalid_request);
  EXPECT_NE(r.error().message.find("media item 0 is an audio clip"), std::string::npos)
      << r.error().message;
}

TEST_F(audio_pipeline_test, the_encoder_batches_windows_of_different_clips) {
  auto dev = kernels::cpu::cpu_device::with_threads(1);
  std::shared_ptr<kernels::device> shared = std::move(dev);
  auto spec = parse_devices("cpu");
  ASSERT_TRUE(spec);
  auto res = make_media_encoder(spec->front(), shared, model_dir, {});
  ASSERT_TRUE(res) << res.error().message;
  encoder_options o;
  o.max_batch = 4;
  o.max_wait_ms = 200;  // long enough for all four to arrive
  auto enc = spawn_encoder(sys, *res, o);
  caf::scoped_actor self{sys};
  // Four different 3.3 s clips (the same speech in three formats, and the
  // FLAC's samples are the WAV's: a follower) each have a whole window.
  const std::vector<std::string> files = {"speech16k.wav", "speech16k.mp3", "speech16k.flac",
                                          "stereo44k_24.wav"};
  std::vector<encode_reply> replies;
  for (std::size_t k = 0; k < files.size(); ++k)
    self->send(
        enc, encode_atom::value,
        encode_request{7,
                       static_cast<std::int32_t>(k),
                       {files[k], read_bytes(audio_dir + "/" + files[k]), media_kind::audio}});
  for (std::size_t k = 0; k < files.size(); ++k)
    self->receive([&](encode_reply& r) { replies.push_back(r); },
                  [&](caf::error& e) { ADD_FAILURE() << sys.render(e); });
  ASSERT_EQ(replies.size(), files.size());
  std::int64_t largest = 0, followers = 0;
  for (const auto& r : replies) {
    largest = std::max(largest, r.batch);
    followers += r.cached ? 1 : 0;
    EXPECT_EQ(r.hidden, 128);
  }
  // The WAV's and MP3's whole windows went together (the 1 s clip has
  // none; the FLAC is the WAV again and follows it).
  EXPECT_GE(largest, 2);
  EXPECT_EQ(followers, 1);
  // Each clip's rows, taken in index order from the encoder, are
  // llava_model::encode_audio's for the clip alone, bit for bit.
  std::int64_t first = 0;
  for (std::size_t k = 0; k < files.size(); ++k) {
    auto clip = models::decode_audio_at(read_bytes(audio_dir + "/" + files[k]), 16000);
    ASSERT_TRUE(clip);
    auto alone = ref().model().encode_audio(*shared, clip->samples);
    ASSERT_TRUE(alone) << alone.error().message;
    const auto rows = alone->dim(0);
    EXPECT_EQ(rows, replies[k].rows) << files[k];
    tensor_ref got;
    self->request(enc, caf::infinite, rows_atom::value, media_rows_request{7, first, rows, ""})
        .receive([&](tensor_ref& r) { got = r; },
                 [&](caf::error& e) { ADD_FAILURE() << sys.render(e); });
    ASSERT_FALSE(got.empty());
    auto batched = data_plane::local().take(got, *shared);
    ASSERT_TRUE(batched) << batched.error().message;
    ASSERT_EQ(batched->numel(), alone->numel());
    EXPECT_EQ(std::memcmp(batched->data_as<float>(), alone->data_as<float>(),
                          static_cast<std::size_t>(alone->numel()) * sizeof(float)),
              0)
        << files[k] << ": batched rows differ from the clip's alone";
    first += rows;
  }
  self->send_exit(enc, caf::exit_reason::user_shutdown);
}

}  // namespace
}  // namespace troupe::actors

namespace troupe::actors {
namespace {

TEST_F(audio_pipeline_test, audio_waiting_at_the_encoder_is_bounded) {
  std::shared_ptr<kernels::device> dev = kernels::cpu::cpu_device::with_threads(1);
  auto spec = parse_devices("cpu");
  ASSERT_TRUE(spec);
  auto res = make_media_encoder(spec->front(), dev, model_dir, {});
  ASSERT_TRUE(res) << res.error().message;
  (*res)->max_waiting_audio_seconds = 4;  // one 3.3 s clip fits, two do not
  encoder_options o;
  o.max_batch = 8;
  o.max_wait_ms = 300;  // the first clip waits while the second arrives
  auto enc = spawn_encoder(sys, *res, o);
  caf::scoped_actor self{sys};
  auto send = [&](std::int32_t index, const std::string& file) {
    self->send(
        enc, encode_atom::value,
        encode_request{9, index, {file, read_bytes(audio_dir + "/" + file), media_kind::audio}});
  };
  send(0, "speech16k.wav");
  send(1, "speech16k.mp3");
  std::vector<encode_reply> ok;
  std::vector<std::string> refused;
  for (int k = 0; k < 2; ++k)
    self->receive([&](encode_reply& r) { ok.push_back(r); },
                  [&](caf::error& e) {
                    EXPECT_EQ(troupe_code(e), static_cast<std::uint8_t>(error_code::overloaded));
                    refused.push_back(why(e));
                  });
  ASSERT_EQ(ok.size(), 1u);
  ASSERT_EQ(refused.size(), 1u);
  EXPECT_NE(refused[0].find("speech16k.mp3"), std::string::npos) << refused[0];
  EXPECT_NE(refused[0].find("limit 4 s"), std::string::npos) << refused[0];
  // Once the first is encoded, the second is taken.
  send(1, "speech16k.mp3");
  self->receive([&](encode_reply& r) { EXPECT_EQ(r.rows, ok[0].rows); },
                [&](caf::error& e) { ADD_FAILURE() << why(e); });
  self->send_exit(enc, caf::exit_reason::user_shutdown);
}

}  // namespace
}  // namespace troupe::actors

// -- streamed clips ----------------------------------------------------------------------------

namespace troupe::actors {
namespace {

/// A 16-bit 16 kHz WAV's samples as the little-endian PCM a stream carries.
std::vector<std::uint8_t> pcm16_of(const std::string& file) {
  auto a = models::decode_audio_at(read_bytes(audio_dir + "/" + file), 16000);
  EXPECT_TRUE(a);
  std::vector<std::uint8_t> out;
  for (float x : a->samples) {
    const auto v = static_cast<std::int16_t>(std::lround(x * 32768.0f));
    EXPECT_EQ(static_cast<float>(v) / 32768.0f, x) << file << " is not 16-bit PCM";
    out.push_back(static_cast<std::uint8_t>(static_cast<std::uint16_t>(v) & 0xff));
    out.push_back(static_cast<std::uint8_t>(static_cast<std::uint16_t>(v) >> 8));
  }
  return out;
}

/// The case's request with its last clip streamed (no bytes, no count yet).
generate_request streamed(const audio_case& c, std::uint64_t id) {
  auto r = ref().request(c, id);
  r.media.back().bytes.clear();
  r.media.back().stream = true;
  r.audio_tokens.back() = 0;
  return r;
}

/// A submitted request's end, waited for.
struct ending {
  std::mutex m;
  std::condition_variable cv;
  std::optional<finish_event> f;
  client::callbacks callbacks() {
    client::callbacks cb;
    cb.on_finish = [this](const finish_event& e) {
      std::lock_guard lock(m);
      f = e;
      cv.notify_all();
    };
    return cb;
  }
  finish_event wait() {
    std::unique_lock lock(m);
    cv.wait_for(lock, std::chrono::minutes(5), [&] { return f.has_value(); });
    return f.value_or(finish_event{});
  }
};

// A clip streamed in pieces that do not line up with the tower's 2 s
// windows gives the tokens of the whole clip sent at once (its windows are
// cut at the same samples), with and without an image before it, on one
// and two stages; each piece is answered once the windows it completes
// are encoded, with the rows the prompt then holds.
TEST_F(audio_pipeline_test, a_streamed_clip_answers_as_the_whole_clip_does) {
  const std::vector<audio_case> cs = {
      {"<audio>\nDescribe the image.", {"speech16k.wav"}},
      {"<image>\n<audio>\nDescribe the image.", {"shapes_001.png", "speech16k.wav"}},
  };
  const auto pcm = pcm16_of("speech16k.wav");  // 3.3 s: a whole window and a shorter one
  const auto samples = static_cast<std::int64_t>(pcm.size() / 2);
  const std::size_t piece = 2 * 11200;  // 0.7 s
  for (int stages : {1, 2}) {
    auto rt = start(stages);
    client cl(sys, rt->scheduler());
    for (const auto& c : cs) {
      const auto want = ref().solo(c);
      ASSERT_GE(want.size(), 4u);
      const auto id = client::next_id();
      ending end;
      auto ack = cl.submit(streamed(c, id), end.callbacks());
      ASSERT_TRUE(ack) << ack.error().message;
      std::vector<stream_progress> seen;
      for (std::size_t at = 0; at < pcm.size(); at += piece) {
        const auto n = std::min(piece, pcm.size() - at);
        const bool last = at + n == pcm.size();
        auto p = cl.send_audio(id,
                               {pcm.begin() + static_cast<std::ptrdiff_t>(at),
                                pcm.begin() + static_cast<std::ptrdiff_t>(at + n)},
                               last);
        ASSERT_TRUE(p) << p.error().message;
        seen.push_back(*p);
      }
      ASSERT_EQ(seen.size(), 5u);
      // 0.7 and 1.4 s: no whole window yet; 2.1 s: the first (13 rows).
      EXPECT_EQ(seen[0].rows, 0);
      EXPECT_EQ(seen[1].rows, 0);
      EXPECT_EQ(seen[2].rows, ref().model().audio_tokens(32000));
      EXPECT_EQ(seen[2].samples, 3 * 11200);
      EXPECT_FALSE(seen[3].done);
      EXPECT_TRUE(seen[4].done);
      EXPECT_EQ(seen[4].samples, samples);
      EXPECT_EQ(seen[4].rows, ref().model().audio_tokens(samples));
      const auto f = end.wait();
      EXPECT_NE(f.reason, finish_reason::error) << f.error;
      EXPECT_EQ(f.tokens, want) << stages << " stage(s): " << c.prompt;
      EXPECT_EQ(f.prompt_tokens, ack->prompt_tokens + seen[4].rows);
    }
  }
}

TEST_F(audio_pipeline_test, a_stream_that_breaks_the_rules_fails_its_request_with_the_reason) {
  auto rt = start(1, 8, /*stream_idle_ms=*/300);
  ASSERT_TRUE(rt);
  client cl(sys, rt->scheduler());
  const audio_case c{"<audio>\nDescribe the image.", {"speech16k.wav"}};
  // No such stream.
  auto none = cl.send_audio(987654321, {0, 0}, false);
  ASSERT_FALSE(none);
  EXPECT_EQ(none.error().code, error_code::not_found);
  // An odd byte count.
  {
    const auto id = client::next_id();
    ending end;
    ASSERT_TRUE(cl.submit(streamed(c, id), end.callbacks()));
    auto odd = cl.send_audio(id, {1, 2, 3}, false);
    ASSERT_FALSE(odd);
    EXPECT_EQ(odd.error().code, error_code::invalid_request);
    const auto f = end.wait();
    EXPECT_EQ(f.reason, finish_reason::error);
    EXPECT_NE(f.error.find("odd byte count"), std::string::npos) << f.error;
  }
  // Silence from the client: the stream's idle limit ends it.
  {
    const auto id = client::next_id();
    ending end;
    ASSERT_TRUE(cl.submit(streamed(c, id), end.callbacks()));
    ASSERT_TRUE(cl.send_audio(id, std::vector<std::uint8_t>(3200, 0), false));
    const auto f = end.wait();
    EXPECT_EQ(f.reason, finish_reason::error);
    EXPECT_NE(f.error.find("sent nothing for 0.300 s"), std::string::npos) << f.error;
    auto late = cl.send_audio(id, {0, 0}, true);
    EXPECT_FALSE(late) << "its request is gone";
  }
  // A clip that ends before one hop.
  {
    const auto id = client::next_id();
    ending end;
    ASSERT_TRUE(cl.submit(streamed(c, id), end.callbacks()));
    EXPECT_TRUE(cl.send_audio(id, {0, 0, 0, 0}, true));
    const auto f = end.wait();
    EXPECT_EQ(f.reason, finish_reason::error);
    EXPECT_NE(f.error.find("shorter than one hop"), std::string::npos) << f.error;
  }
  // Only the last medium, one stream, no bytes with it.
  const audio_case two{"<audio>\n<audio>\nDescribe the image.", {"speech16k.wav", "float16k.wav"}};
  auto first = ref().request(two, client::next_id());
  first.media.front().bytes.clear();
  first.media.front().stream = true;
  first.audio_tokens.front() = 0;
  auto r = cl.submit(first, {});
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("must be the request's last medium"), std::string::npos)
      << r.error().message;
  auto with_bytes = ref().request(c, client::next_id());
  with_bytes.media.back().stream = true;
  with_bytes.audio_tokens.back() = 0;
  r = cl.submit(with_bytes, {});
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("comes in chunks"), std::string::npos) << r.error().message;
  // The stream's requests left nothing behind: a plain request still runs.
  auto f = cl.run(ref().request(c, client::next_id()));
  ASSERT_TRUE(f);
  EXPECT_EQ(f->tokens, ref().solo(c));
}

}  // namespace
}  // namespace troupe::actors
