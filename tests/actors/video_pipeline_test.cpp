// Videos through the actors (prompt placement, the encoder's frames batched
// with images, the scheduler, the stages) against llava_model::prepare and
// the plain generation loop: token-identical, alone and together, on one
// and two stages; a bad video fails its own request only.
#include <gtest/gtest.h>

#include <fstream>

#include "actor_test.hpp"
#include "actors/data_plane.hpp"
#include "actors/encoder.hpp"
#include "actors/prompt.hpp"
#include "actors/prompt_worker.hpp"
#include "actors/runtime.hpp"
#include "kernels/cpu/cpu_device.hpp"
#include "llava_reference.hpp"
#include "models/image.hpp"
#include "models/image_processor.hpp"
#include "models/llava.hpp"
#include "models/video.hpp"

namespace troupe::actors {
namespace {

// The bundled shapes model with troupe's video keys (tools/make_video_model_fixture.py).
const std::string model_dir = std::string(TROUPE_FIXTURES_DIR) + "/llava_video";
const std::string video_dir = std::string(TROUPE_FIXTURES_DIR) + "/video";
const std::string shapes_dir = std::string(TROUPE_FIXTURES_DIR) + "/shapes";

std::vector<std::uint8_t> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

struct item {
  std::string file;  // *.png from shapes, else a video
  std::int32_t num_frames = 0;
  double fps = 0;
};

struct video_case {
  std::string prompt;  // with <image> and <video> where they go
  std::vector<item> media;
  int max_tokens = 12;
};

std::string why(const caf::error& e) {
  return e.context().match_elements<std::string>() ? e.context().get_as<std::string>(0) : "";
}

bool is_image(const item& m) {
  return m.file.ends_with(".png");
}

std::string path_of(const item& m) {
  return (is_image(m) ? shapes_dir : video_dir) + "/" + m.file;
}

models::video_sampling sampling_of(const item& m) {
  models::video_sampling s;
  if (m.num_frames > 0) s.num_frames = m.num_frames;
  s.fps = m.fps;
  return s;
}

class reference : test::llava_parts {
 public:
  reference() : llava_parts(model_dir) {}

  std::vector<std::int32_t> ids(const video_case& c) const {
    auto ids = tok_->encode("USER: " + c.prompt + " ASSISTANT:", true, true);
    EXPECT_TRUE(ids);
    return *ids;
  }

  models::sampling_params params(const video_case& c) const {
    models::sampling_params p;
    p.max_tokens = c.max_tokens;
    if (auto eos = tok_->special_ids().eos) p.stop_token_ids.push_back(*eos);
    return p;
  }

  /// A video's frames, decoded and preprocessed: [F, 3, S, S].
  std::vector<float> frames(const item& m, std::int64_t* n) const {
    auto v = models::decode_video(read_bytes(path_of(m)), sampling_of(m));
    EXPECT_TRUE(v) << (v ? "" : v.error().message);
    auto px = pixels_of(v->frames);
    *n = static_cast<std::int64_t>(v->frames.size());
    return px;
  }

  /// llava_model::prepare (each video's frames encoded together, alone)
  /// and the plain generation loop.
  std::vector<std::int32_t> solo(const video_case& c) {
    std::vector<float> pixels;
    std::int64_t n_images = 0;
    std::vector<std::vector<float>> frame_data;
    std::vector<std::int64_t> counts;
    for (const auto& m : c.media) {
      if (is_image(m)) {
        auto img = models::load_image(path_of(m));
        EXPECT_TRUE(img);
        auto p = models::preprocess_image(*img, pre_);
        EXPECT_TRUE(p);
        pixels.insert(pixels.end(), p->data.begin(), p->data.end());
        ++n_images;
      } else {
        std::int64_t n = 0;
        frame_data.push_back(frames(m, &n));
        counts.push_back(n);
      }
    }
    const std::int64_t side = model_->image_size();
    kernels::tensor pv;
    if (n_images > 0)
      pv = *kernels::tensor::view(pixels.data(), kernels::dtype::f32, {n_images, 3, side, side});
    std::vector<kernels::tensor> videos;
    for (std::size_t k = 0; k < frame_data.size(); ++k)
      videos.push_back(*kernels::tensor::view(frame_data[k].data(), kernels::dtype::f32,
                                              {counts[k], 3, side, side}));
    auto prep = model_->prepare(*ctx_, ids(c), pv, {}, videos);
    EXPECT_TRUE(prep) << (prep ? "" : prep.error().message);
    return prep ? generate_alone(*prep, params(c)) : std::vector<std::int32_t>{};
  }

  /// The scheduler's request, as the prompt worker makes it.
  generate_request request(const video_case& c, std::uint64_t id) const {
    generate_request r;
    r.id = id;
    r.prompt_tokens = ids(c);
    r.params = params(c);
    std::vector<media_data> images, videos;
    for (const auto& m : c.media) {
      media_data d{m.file, read_bytes(path_of(m)),
                   is_image(m) ? media_kind::image : media_kind::video};
      d.num_frames = m.num_frames;
      d.fps = m.fps;
      (is_image(m) ? images : videos).push_back(std::move(d));
    }
    auto setup = load_prompt_setup(model_dir);
    EXPECT_TRUE(setup) << (setup ? "" : setup.error().message);
    auto placed = place_media(*setup, std::move(images), {}, r, std::move(videos));
    EXPECT_TRUE(placed) << (placed ? "" : why(placed.error()));
    return r;
  }

  const models::llava_model& model() const { return *model_; }
  kernels::device& device() { return *ctx_; }
};

reference& ref() {
  static reference r;
  return r;
}

std::vector<video_case> cases() {
  return {
      {"<video>\nDescribe the image.", {{"square.mp4", 4}}},
      {"<image>\n<video>\nDescribe the image.", {{"shapes_001.png"}, {"square.webm"}}},
      {"<video>\n<video>\nDescribe the image.", {{"square.avi", 3}, {"square.mp4", 8, 2.0}}},
      {"<video>\n<image>\nDescribe the image.", {{"square_aac.mp4", 5}, {"shapes_004.png"}}},
      {"<video>\nDescribe the image.", {{"square.mp4", 4}}},  // the first video again
  };
}

struct video_pipeline_test : ::testing::Test {
  caf::actor_system sys{test::actor_config()};

  std::unique_ptr<local_runtime> start(int stages, int max_batch = 8) {
    runtime_config cfg;
    cfg.model = model_dir;
    cfg.stages = stages;
    cfg.encoder.max_batch = max_batch;
    cfg.encoder.max_wait_ms = 20;
    auto d = parse_devices(stages > 1 ? "cpu:0-0,cpu:1-1" : "cpu");
    EXPECT_TRUE(d);
    cfg.devices = *d;
    auto rt = local_runtime::start(sys, cfg);
    EXPECT_TRUE(rt) << (rt ? "" : rt.error().message);
    return std::move(*rt);
  }
};

using test::run_all;

TEST(VideoPlacement, VideosFollowTheirPlaceholdersWithTheirFrameCounts) {
  auto r = ref().request(cases()[3], 1);  // <video> then <image>
  ASSERT_EQ(r.media.size(), 2u);
  EXPECT_EQ(r.media[0].kind, media_kind::video);
  EXPECT_EQ(r.media[0].num_frames, 5);
  EXPECT_EQ(r.media[1].kind, media_kind::image);
  ASSERT_EQ(r.video_tokens.size(), 1u);
  EXPECT_EQ(r.video_tokens[0], 5 * ref().model().tokens_per_frame());
  // Default sampling: 8 of the 30 frames; fps 2 over 3 s: 6 frames.
  EXPECT_EQ(ref().request(cases()[1], 2).video_tokens[0], 8 * 17);
  auto two = ref().request(cases()[2], 3);
  EXPECT_EQ(two.video_tokens, (std::vector<std::int64_t>{3 * 17, 6 * 17}));
}

TEST(VideoPlacement, BadVideosAndModelsWithoutVideoAreRefusedByName) {
  auto setup = load_prompt_setup(model_dir);
  ASSERT_TRUE(setup);
  EXPECT_EQ(setup->video_text, "<video>");
  generate_request r;
  r.prompt_tokens = ref().ids(cases()[0]);
  auto garbage = place_media(*setup, {}, {}, r, {{"noise.mp4", {0, 0, 0, 9, 'x'}, {}}});
  ASSERT_FALSE(garbage);
  EXPECT_NE(why(garbage.error()).find("noise.mp4"), std::string::npos) << why(garbage.error());
  // A playlist never reaches FFmpeg's demuxers.
  generate_request p;
  p.prompt_tokens = ref().ids(cases()[0]);
  auto playlist =
      place_media(*setup, {}, {}, p, {{"list.m3u8", read_bytes(video_dir + "/playlist.m3u8"), {}}});
  ASSERT_FALSE(playlist);
  EXPECT_NE(why(playlist.error()).find("not supported"), std::string::npos)
      << why(playlist.error());
  generate_request two;
  two.prompt_tokens = ref().ids(cases()[0]);  // one placeholder
  const auto v = read_bytes(video_dir + "/square.mp4");
  auto extra = place_media(*setup, {}, {}, two, {{"a.mp4", v, {}}, {"b.mp4", v, {}}});
  ASSERT_FALSE(extra);
  EXPECT_NE(why(extra.error()).find("1 of 2 videos"), std::string::npos) << why(extra.error());
  // Too many frames asked for.
  generate_request many;
  many.prompt_tokens = ref().ids(cases()[0]);
  media_data lots{"a.mp4", v, media_kind::video};
  lots.num_frames = 65;
  auto refused_frames = place_media(*setup, {}, {}, many, {lots});
  ASSERT_FALSE(refused_frames);
  EXPECT_NE(why(refused_frames.error()).find("num_frames 65"), std::string::npos)
      << why(refused_frames.error());
  // A model that takes no video (the bundled one).
  auto plain = load_prompt_setup(TROUPE_BUNDLED_MODEL);
  ASSERT_TRUE(plain);
  EXPECT_TRUE(plain->video_text.empty());
  generate_request d;
  d.prompt_tokens = {0, 5, 6};
  auto refused = place_media(*plain, {}, {}, d, {{"a.mp4", v, {}}});
  ASSERT_FALSE(refused);
  EXPECT_NE(why(refused.error()).find("takes none"), std::string::npos) << why(refused.error());
  actors::prompt_input in;
  in.prompt = "Describe it.";
  in.videos = 1;
  auto no_template = render_prompt(*plain, in);
  ASSERT_FALSE(no_template);
  EXPECT_NE(no_template.error().message.find("video"), std::string::npos);
}

TEST(VideoPlacement, TheManifestsMediaLimitsApply) {
  auto setup = load_prompt_setup(model_dir);
  ASSERT_TRUE(setup);
  cluster::media_entry m;
  m.video_frames = 3;
  m.max_video_frames = 5;
  m.max_videos = 1;
  apply_media_limits(*setup, m);
  const auto v = read_bytes(video_dir + "/square.mp4");  // 3 s, 30 frames
  // A request that names no frame count gets the manifest's, written into
  // the item (the encoder samples the same).
  generate_request r;
  r.prompt_tokens = ref().ids(cases()[0]);
  auto ok = place_media(*setup, {}, {}, r, {{"a.mp4", v, {}}});
  ASSERT_TRUE(ok) << why(ok.error());
  EXPECT_EQ(r.media[0].num_frames, 3);
  EXPECT_EQ(r.video_tokens[0], 3 * 17);
  // More frames than max_video_frames, more videos than max_videos, a
  // video longer than max_video_seconds: refused by name.
  generate_request many;
  many.prompt_tokens = ref().ids(cases()[0]);
  media_data six{"b.mp4", v, media_kind::video};
  six.num_frames = 6;
  auto frames = place_media(*setup, {}, {}, many, {six});
  ASSERT_FALSE(frames);
  EXPECT_NE(why(frames.error()).find("outside 1-5"), std::string::npos) << why(frames.error());
  generate_request two;
  two.prompt_tokens = ref().ids(cases()[2]);
  auto videos = place_media(*setup, {}, {}, two, {{"a.mp4", v, {}}, {"b.mp4", v, {}}});
  ASSERT_FALSE(videos);
  EXPECT_NE(why(videos.error()).find("[media] max_videos"), std::string::npos)
      << why(videos.error());
  m.max_video_seconds = 2;
  apply_media_limits(*setup, m);
  generate_request longer;
  longer.prompt_tokens = ref().ids(cases()[0]);
  auto seconds = place_media(*setup, {}, {}, longer, {{"a.mp4", v, {}}});
  ASSERT_FALSE(seconds);
  EXPECT_NE(why(seconds.error()).find("longer than the limit"), std::string::npos)
      << why(seconds.error());
}

TEST(VideoPlacement, TheTemplateWritesTheVideoPlaceholders) {
  auto setup = load_prompt_setup(model_dir);
  ASSERT_TRUE(setup);
  actors::prompt_input in;
  in.prompt = "What moves?";
  in.images = 1;
  in.videos = 2;
  std::string text;
  auto ids = render_prompt(*setup, in, &text);
  ASSERT_TRUE(ids) << ids.error().message;
  EXPECT_NE(text.find("<image>\n<video>\n<video>\nWhat moves?"), std::string::npos) << text;
  EXPECT_EQ(std::count(ids->begin(), ids->end(), 397), 2);
  in.prompt = "<video> then <image>: what moves?";
  auto placed = render_prompt(*setup, in);
  ASSERT_FALSE(placed);  // one <video> placeholder for two videos
  EXPECT_NE(placed.error().message.find("placeholders for 2 videos"), std::string::npos)
      << placed.error().message;
}

TEST_F(video_pipeline_test, videos_alone_and_together_match_prepare_on_one_and_two_stages) {
  const auto cs = cases();
  std::vector<std::vector<std::int32_t>> want;
  for (const auto& c : cs) want.push_back(ref().solo(c));
  // The answers depend on the frames: other frames of the same file give
  // another answer (else rows gone astray could pass unseen).
  auto other = cs[0];
  other.media = {{"square.mp4", 2}};
  ASSERT_NE(ref().solo(other), want[0]);
  for (const auto& w : want) EXPECT_GE(w.size(), 4u);
  for (int stages : {1, 2}) {
    auto rt = start(stages);
    client cl(sys, rt->scheduler());
    for (std::size_t i = 0; i < cs.size(); ++i) {
      auto f = cl.run(ref().request(cs[i], client::next_id()));
      ASSERT_TRUE(f) << f.error().message;
      EXPECT_EQ(f->tokens, want[i]) << stages << " stage(s): " << cs[i].prompt;
      EXPECT_NE(f->reason, finish_reason::error) << f->error;
    }
    // All at once: frames of different videos and images in one batch.
    std::vector<generate_request> reqs;
    for (const auto& c : cs) reqs.push_back(ref().request(c, client::next_id()));
    auto got = run_all(cl, reqs);
    for (std::size_t i = 0; i < cs.size(); ++i) {
      EXPECT_EQ(got[i].tokens, want[i]) << stages << " stage(s), together: " << cs[i].prompt;
      EXPECT_NE(got[i].reason, finish_reason::error) << got[i].error;
    }
    // The videos' own counters: 6 videos a round, two rounds; the fifth
    // case's video is the first's again, and the second round's are all
    // seen before: at least 7 from the encoder cache.
    const auto st = cl.stats();
    std::int64_t videos = 0;
    for (const auto& c : cs)
      for (const auto& m : c.media) videos += is_image(m) ? 0 : 1;
    EXPECT_EQ(videos, 6);
    EXPECT_EQ(st.videos, 2 * videos);
    EXPECT_EQ(st.video_encodes, 2 * videos);
    EXPECT_EQ(st.videos_waiting, 0);
    EXPECT_GE(st.video_cache_hits, 7);
    EXPECT_LE(st.video_cache_hits, st.videos);
    EXPECT_GT(st.video_encode_wait_ms, 0);
    EXPECT_EQ(st.clips, 0);
  }
}

TEST_F(video_pipeline_test, a_bad_video_fails_its_request_and_the_others_go_on) {
  auto rt = start(1);
  client cl(sys, rt->scheduler());
  const auto cs = cases();
  // Headers that promise frames the data does not hold: the prompt worker
  // counted them, the encoder finds fewer.
  auto cut = ref().request(cs[0], client::next_id());
  cut.media[0].bytes.resize(cut.media[0].bytes.size() / 2);
  cut.media[0].name = "cut.mp4";
  auto garbage = ref().request(cs[1], client::next_id());
  garbage.media[1].bytes.assign(4000, 0x5a);
  garbage.media[1].name = "noise.webm";
  auto good = ref().request(cs[2], client::next_id());
  auto got = run_all(cl, {cut, garbage, good});
  EXPECT_EQ(got[0].reason, finish_reason::error);
  EXPECT_NE(got[0].error.find("cut.mp4"), std::string::npos) << got[0].error;
  EXPECT_EQ(got[1].reason, finish_reason::error);
  EXPECT_NE(got[1].error.find("noise.webm"), std::string::npos) << got[1].error;
  EXPECT_EQ(got[2].tokens, ref().solo(cs[2])) << got[2].error;
  // A video whose token count the request states wrongly is caught where
  // the encoder's rows arrive.
  auto lying = ref().request(cs[0], client::next_id());
  lying.video_tokens[0] += 17;
  auto f = cl.run(lying);
  ASSERT_TRUE(f);
  EXPECT_EQ(f->reason, finish_reason::error);
  EXPECT_NE(f->error.find("does not match the prompt"), std::string::npos) << f->error;
  // Counts that do not match the videos are refused at admission.
  auto miscounted = ref().request(cs[0], client::next_id());
  miscounted.video_tokens.push_back(17);
  auto r = cl.submit(miscounted, {});
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code, error_code::invalid_request);
  // An image where the prompt places a video: refused, naming both.
  auto swapped = ref().request(cs[1], client::next_id());  // <image> then <video>
  std::swap(swapped.media[0], swapped.media[1]);
  r = cl.submit(swapped, {});
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find(
                "media item 0 is a video but the prompt's placeholder 0 is for an image"),
            std::string::npos)
      << r.error().message;
}

TEST_F(video_pipeline_test, frames_batch_with_images_and_keep_their_bits) {
  auto dev = kernels::cpu::cpu_device::with_threads(1);
  std::shared_ptr<kernels::device> shared = std::move(dev);
  auto spec = parse_devices("cpu");
  ASSERT_TRUE(spec);
  auto res = make_media_encoder(spec->front(), shared, model_dir, {});
  ASSERT_TRUE(res) << res.error().message;
  encoder_options o;
  o.max_batch = 16;
  o.max_wait_ms = 200;  // long enough for all three to arrive
  auto enc = spawn_encoder(sys, *res, o);
  caf::scoped_actor self{sys};
  // A 4-frame video, an image and a 3-frame video: 8 inputs, one batch,
  // the image among the frames.
  std::vector<media_data> items = {
      {"square.mp4", read_bytes(video_dir + "/square.mp4"), media_kind::video},
      {"shapes_001.png", read_bytes(shapes_dir + "/shapes_001.png"), media_kind::image},
      {"square.avi", read_bytes(video_dir + "/square.avi"), media_kind::video}};
  items[0].num_frames = 4;
  items[2].num_frames = 3;
  // Asked for at once, answered in any order: each reply by its request.
  using handle = decltype(self->request(enc, caf::infinite, encode_atom::value, encode_request{}));
  std::vector<handle> asked;
  for (std::size_t k = 0; k < items.size(); ++k)
    asked.push_back(self->request(enc, caf::infinite, encode_atom::value,
                                  encode_request{7, static_cast<std::int32_t>(k), items[k]}));
  std::vector<encode_reply> replies;
  for (auto& h : asked)
    h.receive([&](encode_reply& r) { replies.push_back(r); },
              [&](caf::error& e) { ADD_FAILURE() << sys.render(e); });
  ASSERT_EQ(replies.size(), items.size());
  for (const auto& r : replies) EXPECT_EQ(r.batch, 8) << "one batch of 1 image and 7 frames";
  // Each item's rows, taken in index order, are those it has alone.
  auto& m = ref().model();
  std::int64_t n = 0;
  const auto side = m.image_size();
  std::vector<kernels::result<kernels::tensor>> alone;
  std::vector<std::vector<float>> keep;
  for (const auto& it : items) {
    if (it.kind == media_kind::image) {
      auto img = models::load_image(shapes_dir + "/" + it.name);
      auto pc = models::load_image_processor_config(model_dir);
      ASSERT_TRUE(img && pc);
      auto p = models::preprocess_image(*img, *pc);
      ASSERT_TRUE(p);
      keep.push_back(p->data);
      alone.push_back(m.encode_images(
          *shared,
          *kernels::tensor::view(keep.back().data(), kernels::dtype::f32, {1, 3, side, side})));
    } else {
      keep.push_back(ref().frames({it.name, it.num_frames}, &n));
      alone.push_back(m.encode_frames(
          *shared,
          *kernels::tensor::view(keep.back().data(), kernels::dtype::f32, {n, 3, side, side})));
    }
  }
  std::int64_t first = 0;
  for (std::size_t k = 0; k < items.size(); ++k) {
    ASSERT_TRUE(alone[k]) << alone[k].error().message;
    const auto rows = alone[k]->dim(0);
    EXPECT_EQ(rows, replies[k].rows) << items[k].name;
    tensor_ref got;
    self->request(enc, caf::infinite, rows_atom::value, media_rows_request{7, first, rows, ""})
        .receive([&](tensor_ref& r) { got = r; },
                 [&](caf::error& e) { ADD_FAILURE() << sys.render(e); });
    ASSERT_FALSE(got.empty());
    auto batched = data_plane::local().take(got, *shared);
    ASSERT_TRUE(batched) << batched.error().message;
    ASSERT_EQ(batched->numel(), alone[k]->numel());
    EXPECT_EQ(std::memcmp(batched->data(), alone[k]->data(), alone[k]->nbytes()), 0)
        << items[k].name << ": batched rows differ from its rows alone";
    first += rows;
  }
  // The same video again comes from the cache.
  self->send(enc, encode_atom::value, encode_request{8, 0, items[0]});
  self->receive([&](encode_reply& r) { EXPECT_TRUE(r.cached); },
                [&](caf::error& e) { ADD_FAILURE() << sys.render(e); });
}

// A video's audio track through the audio tower (vLLM's
// use_audio_in_video), on a model that hears and sees video
// (tests/fixtures/llava_omni): its rows follow the frames', as
// llava_model::prepare lays them out.
class omni_reference : test::llava_parts {
 public:
  omni_reference() : llava_parts(std::string(TROUPE_FIXTURES_DIR) + "/llava_omni") {}

  std::vector<std::int32_t> ids() const {
    auto ids = tok_->encode("USER: <video>\nWhat is heard? ASSISTANT:", true, true);
    EXPECT_TRUE(ids);
    return *ids;
  }

  /// prepare with the frames and the track, and the plain loop.
  std::vector<std::int32_t> solo(const std::vector<std::uint8_t>& bytes, int frames) {
    models::video_sampling s;
    s.num_frames = frames;
    s.audio = true;
    auto v = models::decode_video(bytes, s);
    EXPECT_TRUE(v) << (v ? "" : v.error().message);
    auto px = pixels_of(v->frames);
    const auto side = model_->image_size();
    std::vector<kernels::tensor> videos{
        *kernels::tensor::view(px.data(), kernels::dtype::f32,
                               {static_cast<std::int64_t>(v->frames.size()), 3, side, side})};
    std::vector<std::span<const float>> sounds{v->sound.samples};
    last_samples = static_cast<std::int64_t>(v->sound.samples.size());
    auto prep = model_->prepare(*ctx_, ids(), kernels::tensor{}, {}, videos, {}, sounds);
    EXPECT_TRUE(prep) << (prep ? "" : prep.error().message);
    last_rows = prep ? static_cast<std::int64_t>(prep->image_embeds.size()) /
                           model_->config().text.hidden_size
                     : 0;
    return prep ? generate_alone(*prep, params()) : std::vector<std::int32_t>{};
  }

  models::sampling_params params() const {
    models::sampling_params p;
    p.max_tokens = 12;
    if (auto eos = tok_->special_ids().eos) p.stop_token_ids.push_back(*eos);
    return p;
  }

  const models::llava_model& model() const { return *model_; }
  std::int64_t last_rows = 0, last_samples = 0;
};

TEST_F(video_pipeline_test, a_videos_audio_track_is_heard_after_its_frames) {
  const std::string omni = std::string(TROUPE_FIXTURES_DIR) + "/llava_omni";
  omni_reference ref2;
  const auto bytes = read_bytes(video_dir + "/square_aac.mp4");  // 2 s, an AAC tone
  const auto want = ref2.solo(bytes, 3);
  const auto rows = ref2.last_rows;
  // 3 frames of 17 rows, then the track's tokens (about 2 s: a whole
  // window of 200 frames and the AAC tail's few).
  EXPECT_GT(ref2.last_samples, 32000);
  EXPECT_EQ(rows, 3 * 17 + ref2.model().audio_tokens(ref2.last_samples));
  // Without the track, another answer (else a track gone astray would pass).
  auto setup = load_prompt_setup(omni);
  ASSERT_TRUE(setup) << setup.error().message;
  auto request = [&](bool audio) {
    generate_request r;
    r.id = client::next_id();
    r.prompt_tokens = ref2.ids();
    r.params = ref2.params();
    media_data v{"square_aac.mp4", bytes, media_kind::video};
    v.num_frames = 3;
    v.audio = audio;
    auto placed = place_media(*setup, {}, {}, r, {v});
    EXPECT_TRUE(placed) << (placed ? "" : why(placed.error()));
    return r;
  };
  auto heard = request(true);
  EXPECT_EQ(heard.video_tokens, (std::vector<std::int64_t>{rows}));
  runtime_config cfg;
  cfg.model = omni;
  cfg.encoder.max_wait_ms = 20;
  auto d = parse_devices("cpu");
  ASSERT_TRUE(d);
  cfg.devices = *d;
  auto rt = local_runtime::start(sys, cfg);
  ASSERT_TRUE(rt) << rt.error().message;
  client cl(sys, (*rt)->scheduler());
  auto got = run_all(cl, {heard, request(true), request(false)});
  EXPECT_EQ(got[0].tokens, want) << got[0].error;
  EXPECT_EQ(got[1].tokens, want) << got[1].error;
  EXPECT_NE(got[2].reason, finish_reason::error) << got[2].error;
  EXPECT_NE(got[2].tokens, want) << "the track changed nothing";
  // A video without a track, or a model that does not hear: refused by name.
  generate_request silent;
  silent.prompt_tokens = ref2.ids();
  media_data quiet{"square.mp4", read_bytes(video_dir + "/square.mp4"), media_kind::video};
  quiet.audio = true;
  auto none = place_media(*setup, {}, {}, silent, {quiet});
  ASSERT_FALSE(none);
  EXPECT_NE(why(none.error()).find("square.mp4: its audio track was asked for, but it has none"),
            std::string::npos)
      << why(none.error());
  auto deaf = load_prompt_setup(model_dir);
  ASSERT_TRUE(deaf);
  generate_request d2;
  d2.prompt_tokens = ref().ids(cases()[0]);
  media_data v{"square_aac.mp4", bytes, media_kind::video};
  v.audio = true;
  auto refused = place_media(*deaf, {}, {}, d2, {v});
  ASSERT_FALSE(refused);
  EXPECT_NE(why(refused.error()).find("no audio tower"), std::string::npos) << why(refused.error());
}

}  // namespace
}  // namespace troupe::actors
