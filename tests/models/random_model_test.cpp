// troupe write-model's generator: rows are made in parallel, each from its
// own seed, so the file is the same for any thread count (the 7B benchmark
// model is written with every core of the GPU machine).
#include <gtest/gtest.h>

#include <unistd.h>
#include <fstream>
#include <iterator>
#include <string>

#include "models/random_model.hpp"

using namespace troupe::models;

namespace {

std::string bytes_of(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

std::string write(int threads, std::uint64_t seed, troupe::kernels::weight_format f) {
  random_model_spec spec;
  spec.config = tinyllama_shape();
  spec.config.num_layers = 2;
  spec.config.hidden_size = 64;
  spec.config.intermediate_size = 96;
  spec.config.num_heads = 4;
  spec.config.num_kv_heads = 2;
  spec.config.head_dim = 16;
  spec.config.vocab_size = 300;
  spec.format = f;
  spec.seed = seed;
  spec.threads = threads;
  const std::string path = ::testing::TempDir() + "random-" + std::to_string(getpid()) + "-" +
                           std::to_string(threads) + "-" + std::to_string(seed) + ".gguf";
  auto r = write_random_gguf(path, spec);
  EXPECT_TRUE(r.has_value()) << r.error().message;
  auto b = bytes_of(path);
  std::remove(path.c_str());
  return b;
}

TEST(RandomModel, TheFileIsTheSameForAnyThreadCount) {
  for (auto f : {troupe::kernels::weight_format::f16, troupe::kernels::weight_format::q4_0}) {
    const auto one = write(1, 7, f);
    ASSERT_GT(one.size(), 10000u);
    EXPECT_EQ(one, write(3, 7, f));
    EXPECT_EQ(one, write(16, 7, f));
    EXPECT_NE(one, write(1, 8, f));  // and the seed matters
  }
}

TEST(RandomModel, TheSevenBillionShapeIsLlamaTwo) {
  const auto c = llama2_7b_shape();
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.intermediate_size, 11008);
  EXPECT_EQ(c.num_layers, 32);
  EXPECT_EQ(c.num_heads, 32);
  EXPECT_EQ(c.num_kv_heads, 32);
  EXPECT_EQ(c.head_dim * c.num_heads, c.hidden_size);
  EXPECT_EQ(c.vocab_size, 32000);
}

}  // namespace
