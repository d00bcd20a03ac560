// GGUF and safetensors readers against files written by the reference
// Python writers (tools/make_model_fixtures.py), and the GGUF writer
// round trip.
#include <gtest/gtest.h>

#include "../temp_path.hpp"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "kernels/quant.hpp"
#include "models/gguf.hpp"
#include "models/safetensors.hpp"

using namespace troupe;
using namespace troupe::models;

namespace {

std::string fixture(const std::string& name) {
  return std::string(TROUPE_FIXTURES_DIR) + "/models/" + name;
}

nlohmann::json load_json(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return nlohmann::json::parse(ss.str());
}

std::vector<float> to_floats(const kernels::tensor& t) {
  std::vector<float> out(static_cast<std::size_t>(t.numel()));
  for (std::int64_t r = 0; r < t.rows(); ++r) {
    float* y = out.data() + r * t.cols();
    switch (t.type()) {
      case kernels::dtype::f32:
        for (std::int64_t c = 0; c < t.cols(); ++c) y[c] = t.row_as<float>(r)[c];
        break;
      case kernels::dtype::f16:
        for (std::int64_t c = 0; c < t.cols(); ++c)
          y[c] = kernels::to_f32(t.row_as<kernels::f16>(r)[c]);
        break;
      case kernels::dtype::q8_0:
        kernels::dequantize_row_q8_0(t.row_as<kernels::block_q8_0>(r), y, t.cols());
        break;
      case kernels::dtype::q4_0:
        kernels::dequantize_row_q4_0(t.row_as<kernels::block_q4_0>(r), y, t.cols());
        break;
      default:
        ADD_FAILURE() << "unexpected dtype";
    }
  }
  return out;
}

}  // namespace

TEST(Gguf, ReadsWhatGgufPyWrote) {
  auto f = gguf_file::open(fixture("tiny.gguf"));
  ASSERT_TRUE(f) << f.error().message;
  EXPECT_EQ(f->version(), 3u);
  EXPECT_EQ(*f->find("general.architecture")->as_string(), "llama");
  EXPECT_EQ(*f->find("test.u32")->as_int(), 4000000000ll);
  EXPECT_EQ(*f->find("test.i32")->as_int(), -7);
  EXPECT_DOUBLE_EQ(*f->find("test.f32")->as_float(), 0.25);
  EXPECT_EQ(*f->find("test.bool")->as_int(), 1);
  EXPECT_EQ(*f->find("test.string")->as_string(), "h\xc3\xa9llo \xe2\x9c\x93");
  EXPECT_EQ(std::get<std::uint64_t>(f->find("test.u64")->value), (1ull << 63) + 5);
  const auto* strs = f->find("test.strings")->as_array();
  ASSERT_NE(strs, nullptr);
  EXPECT_EQ(strs->strings, (std::vector<std::string>{"a", "bb", ""}));
  EXPECT_EQ(f->find("test.ints")->as_array()->ints, (std::vector<std::int64_t>{1, -2, 3}));

  const auto expect = load_json(fixture("tiny.gguf.json"));
  for (const char* name : {"t.f32", "t.f16", "t.q8_0", "t.q4_0"}) {
    const auto* info = f->find_tensor(name);
    ASSERT_NE(info, nullptr) << name;
    const auto shape = expect["shapes"][name].get<std::vector<std::int64_t>>();
    ASSERT_EQ(info->shape().ndim, 2) << name;
    EXPECT_EQ(info->shape()[0], shape[0]) << name;
    EXPECT_EQ(info->shape()[1], shape[1]) << name;
    auto t = f->view(*info);
    ASSERT_TRUE(t);
    const auto got = to_floats(*t);
    const auto want = expect[name].get<std::vector<float>>();
    ASSERT_EQ(got.size(), want.size()) << name;
    for (std::size_t i = 0; i < got.size(); ++i)
      ASSERT_EQ(got[i], want[i]) << name << "[" << i << "]";
  }
}

TEST(Gguf, WriterRoundTrip) {
  auto pool = kernels::memory_pool::create();
  auto src = kernels::tensor::empty(*pool, kernels::dtype::f32, {4, 64});
  ASSERT_TRUE(src);
  for (std::int64_t i = 0; i < src->numel(); ++i)
    src->data_as<float>()[i] = std::sin(0.37f * float(i));
  auto q4 = kernels::quantize(*pool, *src, kernels::weight_format::q4_0);
  ASSERT_TRUE(q4);
  gguf_writer w;
  w.set_string("general.architecture", "llama");
  w.set_u32("llama.block_count", 22);
  w.set_f32("llama.rope.freq_base", 10000.0f);
  w.set_strings("tokenizer.ggml.tokens", {"<s>", "</s>", "hi"});
  w.set_f32s("tokenizer.ggml.scores", {0.0f, -1.5f, 2.0f});
  w.set_i32s("tokenizer.ggml.token_type", {3, 3, 1});
  auto bytes = [](const kernels::tensor& t) {
    return std::span<const std::byte>(static_cast<const std::byte*>(t.data()), t.nbytes());
  };
  ASSERT_TRUE(w.add_tensor("a", kernels::dtype::f32, src->shape(), bytes(*src)));
  ASSERT_TRUE(w.add_tensor("b", kernels::dtype::q4_0, q4->data.shape(), bytes(q4->data)));
  EXPECT_FALSE(w.add_tensor("b", kernels::dtype::q4_0, q4->data.shape(), bytes(q4->data)));
  EXPECT_FALSE(w.add_tensor("c", kernels::dtype::f32, {4, 63}, bytes(*src)));
  const std::string path = troupe::test::temp_path("roundtrip.gguf");
  ASSERT_TRUE(w.write(path));
  auto f = gguf_file::open(path);
  ASSERT_TRUE(f) << f.error().message;
  EXPECT_EQ(*f->find("llama.block_count")->as_int(), 22);
  EXPECT_EQ(f->find("tokenizer.ggml.tokens")->as_array()->strings[2], "hi");
  EXPECT_FLOAT_EQ(static_cast<float>(f->find("tokenizer.ggml.scores")->as_array()->floats[1]),
                  -1.5f);
  auto a = f->view(*f->find_tensor("a"));
  auto b = f->view(*f->find_tensor("b"));
  ASSERT_TRUE(a && b);
  EXPECT_EQ(std::memcmp(a->data(), src->data(), src->nbytes()), 0);
  EXPECT_EQ(std::memcmp(b->data(), q4->data.data(), q4->data.nbytes()), 0);
  std::remove(path.c_str());
}

TEST(Safetensors, ReadsWhatSafetensorsPyWrote) {
  const auto expect = load_json(fixture("tiny.safetensors.json"));
  auto m = safetensors_model::open(fixture("tiny.safetensors"));
  ASSERT_TRUE(m) << m.error().message;
  EXPECT_EQ(m->metadata().at("format"), "pt");
  for (const char* name : {"a", "b"}) {
    const auto* t = m->find(name);
    ASSERT_NE(t, nullptr);
    auto v = m->view(*t);
    ASSERT_TRUE(v);
    EXPECT_EQ(to_floats(*v), expect[name].get<std::vector<float>>()) << name;
  }
  EXPECT_EQ(m->find("a")->shape, (kernels::shape_t{4, 6}));
}

TEST(Safetensors, ReadsShardedIndex) {
  const auto expect = load_json(fixture("tiny.safetensors.json"));
  auto m = safetensors_model::open(fixture("model.safetensors.index.json"));
  ASSERT_TRUE(m) << m.error().message;
  EXPECT_EQ(m->files().size(), 2u);
  for (const char* name : {"a", "b", "c"}) {
    auto v = m->view(*m->find(name));
    ASSERT_TRUE(v);
    EXPECT_EQ(to_floats(*v), expect[name].get<std::vector<float>>()) << name;
  }
  // The directory form finds the index.
  auto d = safetensors_model::open(std::string(TROUPE_FIXTURES_DIR) + "/models");
  ASSERT_TRUE(d) << d.error().message;
  EXPECT_EQ(d->tensors().size(), 3u);
}
