// The parts of the actor tests' reference: a LLaVA folder loaded for the
// plain generation loop, which the actor pipeline's outputs are compared with.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_device.hpp"
#include "models/generate.hpp"
#include "models/image_processor.hpp"
#include "models/llava.hpp"
#include "models/tokenizer.hpp"

namespace troupe::test {

/// The model of `dir` on a CPU device of 2 threads, its tokenizer and its
/// image preprocessor.
class llava_parts {
 protected:
  explicit llava_parts(const std::string& dir) {
    ctx_ = kernels::cpu::cpu_device::with_threads(2);
    auto m = models::llava_model::load(dir, *ctx_);
    EXPECT_TRUE(m) << (m ? "" : m.error().message);
    if (m) model_ = std::move(*m);
    auto t = models::tokenizer::load(dir);
    EXPECT_TRUE(t);
    if (t) tok_.emplace(std::move(*t));
    auto pc = models::load_image_processor_config(dir);
    EXPECT_TRUE(pc);
    if (pc) pre_ = *pc;
  }

  /// Images (a video's frames) through the image preprocessor: pixel
  /// values [N, 3, S, S], row-major.
  std::vector<float> pixels_of(const std::vector<models::image>& images) const {
    std::vector<float> px;
    for (const auto& f : images) {
      auto p = models::preprocess_image(f, pre_);
      EXPECT_TRUE(p);
      if (p) px.insert(px.end(), p->data.begin(), p->data.end());
    }
    return px;
  }

  /// A prepared prompt through the plain generation loop, alone: its tokens.
  std::vector<std::int32_t> generate_alone(const models::llava_prompt& prep,
                                           const models::sampling_params& params,
                                           const models::kv_options& kv = {}) {
    models::generation_request req;
    req.prompt = prep.tokens;
    req.image_token = prep.image_token;
    req.image_embeds = prep.image_embeds;
    req.params = params;
    models::generate_options opts;
    opts.kv = kv;
    auto out = models::generate_batch(*ctx_, model_->language_model(), {req},
                                      {[](std::int32_t) { return std::string(); }}, {}, opts);
    EXPECT_TRUE(out) << (out ? "" : out.error().message);
    return out ? (*out)[0].tokens : std::vector<std::int32_t>{};
  }

  std::unique_ptr<kernels::cpu::cpu_device> ctx_;
  std::unique_ptr<models::llava_model> model_;
  std::optional<models::tokenizer> tok_;
  models::image_processor_config pre_;
};

}  // namespace troupe::test
