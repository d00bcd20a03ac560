#include "models/random_model.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <thread>
#include <vector>

#include "models/gguf.hpp"

namespace troupe::models {

using kernels::dtype;
using kernels::weight_format;

llama_config tinyllama_shape() {
  llama_config c;
  c.vocab_size = 32000;
  c.hidden_size = 2048;
  c.intermediate_size = 5632;
  c.num_layers = 22;
  c.num_heads = 32;
  c.num_kv_heads = 4;
  c.head_dim = 64;
  c.max_position_embeddings = 2048;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000;
  c.bos_token_ids = {1};
  c.eos_token_ids = {2};
  return c;
}

llama_config llama2_7b_shape() {
  llama_config c = tinyllama_shape();
  c.hidden_size = 4096;
  c.intermediate_size = 11008;
  c.num_layers = 32;
  c.num_heads = 32;
  c.num_kv_heads = 32;
  c.head_dim = 128;
  c.max_position_embeddings = 4096;
  return c;
}

namespace {

// splitmix64: the seed of one matrix row from (model seed, matrix, row), so
// a row's values do not depend on which thread made it or when.
std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return (x ^ (x >> 31)) | 1;  // xorshift needs a non-zero state
}

// A fast deterministic normal generator (xorshift + Box-Muller, float).
struct normal_gen {
  std::uint64_t s;
  float spare = 0;
  bool has_spare = false;
  std::uint64_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
  float uniform() { return (static_cast<float>(next() >> 40) + 0.5f) * (1.0f / 16777216.0f); }
  float operator()() {
    if (has_spare) {
      has_spare = false;
      return spare;
    }
    const float u = uniform(), v = uniform();
    const float r = std::sqrt(-2.0f * std::log(u));
    spare = r * std::sin(6.2831853f * v);
    has_spare = true;
    return r * std::cos(6.2831853f * v);
  }
};

}  // namespace

result<void> write_random_gguf(const std::string& path, const random_model_spec& spec) {
  const auto& c = spec.config;
  if (auto r = c.validate(path); !r) return r;
  const dtype mat_type = spec.format == weight_format::f32    ? dtype::f32
                         : spec.format == weight_format::f16  ? dtype::f16
                         : spec.format == weight_format::q8_0 ? dtype::q8_0
                         : spec.format == weight_format::q4_0 ? dtype::q4_0
                                                              : dtype::i32;
  if (mat_type == dtype::i32)
    return make_error(errc::unsupported_dtype, "random GGUF models are f32, f16, q8_0 or q4_0");
  if (c.vocab_size < 3 + 256)
    return make_error(errc::invalid_argument, "vocabulary too small for the byte tokens");
  normal_gen gen{spec.seed * 0x9e3779b97f4a7c15ull + 1};
  std::deque<std::vector<std::byte>> storage;  // stable addresses for the writer
  gguf_writer w;
  w.set_string("general.architecture", "llama");
  w.set_string("general.name", "troupe random");
  w.set_u32("llama.context_length", static_cast<std::uint32_t>(c.max_position_embeddings));
  w.set_u32("llama.embedding_length", static_cast<std::uint32_t>(c.hidden_size));
  w.set_u32("llama.block_count", static_cast<std::uint32_t>(c.num_layers));
  w.set_u32("llama.feed_forward_length", static_cast<std::uint32_t>(c.intermediate_size));
  w.set_u32("llama.attention.head_count", static_cast<std::uint32_t>(c.num_heads));
  w.set_u32("llama.attention.head_count_kv", static_cast<std::uint32_t>(c.num_kv_heads));
  w.set_u32("llama.rope.dimension_count", static_cast<std::uint32_t>(c.head_dim));
  w.set_f32("llama.attention.layer_norm_rms_epsilon", static_cast<float>(c.rms_norm_eps));
  w.set_f32("llama.rope.freq_base", static_cast<float>(c.rope_theta));
  w.set_u32("llama.vocab_size", static_cast<std::uint32_t>(c.vocab_size));
  std::vector<std::string> tokens;
  std::vector<float> scores;
  std::vector<std::int32_t> types;
  for (const char* s : {"<unk>", "<s>", "</s>"}) {
    tokens.emplace_back(s);
    scores.push_back(0);
    types.push_back(tokens.size() == 1 ? 2 : 3);  // UNKNOWN, CONTROL
  }
  for (int b = 0; b < 256; ++b) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "<0x%02X>", b);
    tokens.emplace_back(buf);
    scores.push_back(0);
    types.push_back(6);  // BYTE
  }
  for (std::int64_t i = static_cast<std::int64_t>(tokens.size()); i < c.vocab_size; ++i) {
    tokens.push_back("\xe2\x96\x81t" + std::to_string(i));
    scores.push_back(-static_cast<float>(i));
    types.push_back(1);  // NORMAL
  }
  w.set_string("tokenizer.ggml.model", "llama");
  w.set_strings("tokenizer.ggml.tokens", std::move(tokens));
  w.set_f32s("tokenizer.ggml.scores", scores);
  w.set_i32s("tokenizer.ggml.token_type", types);
  w.set_u32("tokenizer.ggml.bos_token_id", 1);
  w.set_u32("tokenizer.ggml.eos_token_id", 2);
  w.set_u32("tokenizer.ggml.unknown_token_id", 0);

  const int threads = spec.threads > 0
                          ? spec.threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::uint64_t matrix_index = 0;
  auto matrix = [&](const std::string& name, std::int64_t rows, std::int64_t cols) -> result<void> {
    auto rb = kernels::row_bytes(mat_type, cols);
    if (!rb) return std::unexpected(rb.error());
    auto& buf = storage.emplace_back(static_cast<std::size_t>(rows) * *rb);
    const std::uint64_t m = matrix_index++;
    // Rows in parallel, each from its own seed: the same bytes for any
    // thread count (a 7B model is ~7e9 normals).
    auto fill = [&, m](std::int64_t r0, std::int64_t r1) {
      std::vector<float> row(static_cast<std::size_t>(cols));
      for (std::int64_t r = r0; r < r1; ++r) {
        normal_gen gen{mix(spec.seed ^ mix((m << 32) + static_cast<std::uint64_t>(r)))};
        for (auto& v : row) v = spec.stddev * gen();
        std::byte* dst = buf.data() + static_cast<std::size_t>(r) * *rb;
        switch (mat_type) {
          case dtype::f32:
            std::memcpy(dst, row.data(), *rb);
            break;
          case dtype::f16:
            for (std::int64_t j = 0; j < cols; ++j)
              reinterpret_cast<kernels::f16*>(dst)[j] =
                  kernels::to_f16(row[static_cast<std::size_t>(j)]);
            break;
          case dtype::q8_0:
            kernels::quantize_row_q8_0(row.data(), reinterpret_cast<kernels::block_q8_0*>(dst),
                                       cols);
            break;
          default:
            kernels::quantize_row_q4_0(row.data(), reinterpret_cast<kernels::block_q4_0*>(dst),
                                       cols);
            break;
        }
      }
    };
    const std::int64_t n = std::min<std::int64_t>(threads, rows);
    std::vector<std::thread> team;
    for (std::int64_t t = 1; t < n; ++t) team.emplace_back(fill, rows * t / n, rows * (t + 1) / n);
    fill(0, n > 0 ? rows / n : rows);
    for (auto& t : team) t.join();
    return w.add_tensor(name, mat_type, {rows, cols}, buf);
  };
  auto norm = [&](const std::string& name) -> result<void> {
    auto& buf = storage.emplace_back(static_cast<std::size_t>(c.hidden_size) * sizeof(float));
    auto* f = reinterpret_cast<float*>(buf.data());
    for (std::int64_t i = 0; i < c.hidden_size; ++i) f[i] = 1.0f + 0.1f * gen();
    return w.add_tensor(name, dtype::f32, {c.hidden_size}, buf);
  };
  const std::int64_t H = c.hidden_size, D = c.head_dim;
  if (auto r = matrix("token_embd.weight", c.vocab_size, H); !r) return r;
  for (std::int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    for (auto r : {matrix(p + "attn_q.weight", c.num_heads * D, H),
                   matrix(p + "attn_k.weight", c.num_kv_heads * D, H),
                   matrix(p + "attn_v.weight", c.num_kv_heads * D, H),
                   matrix(p + "attn_output.weight", H, c.num_heads * D),
                   matrix(p + "ffn_gate.weight", c.intermediate_size, H),
                   matrix(p + "ffn_up.weight", c.intermediate_size, H),
                   matrix(p + "ffn_down.weight", H, c.intermediate_size),
                   norm(p + "attn_norm.weight"), norm(p + "ffn_norm.weight")})
      if (!r) return r;
  }
  if (auto r = norm("output_norm.weight"); !r) return r;
  if (auto r = matrix("output.weight", c.vocab_size, H); !r) return r;
  return w.write(path);
}

}  // namespace troupe::models
