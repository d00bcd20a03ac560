// bench/llama: TinyLlama-shaped random models (GGUF F16, Q8_0, Q4_0, written
// by troupe itself): prefill of 512 tokens and decode of 128, with 2 threads
// and 1, median of several runs. Decode is printed next to its limit
// measured in the same run (read bandwidth / bytes of weights per token),
// prefill next to oneDNN's u8s8 GEMM rate and llama.cpp's figures.
//   bench_llama [--threads 2,1] [--formats f16,q8_0,q4_0] [--runs 3]
//               [--prompt 512] [--gen 128] [--models DIR] [--quick]
#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench/common/measure.hpp"
#include "kernels/cpu/onednn_matmul.hpp"
#include "models/llama.hpp"
#include "models/random_model.hpp"

using namespace troupe;
using namespace troupe::bench;
namespace k = troupe::kernels;

namespace {

struct options {
  std::vector<int> threads{2, 1};
  std::vector<std::string> formats{"f16", "q8_0", "q4_0"};
  int runs = 3;
  int prompt = 512, gen = 128;
  std::string models = "build/bench-models";
  bool quick = false;
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

bool exists(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0;
}

// llama.cpp on this machine kind, 2 threads (issue 3): decode t/s, its
// fraction of the limit, prefill-512 t/s.
struct llama_cpp_ref {
  double decode, fraction, prefill;
};
const std::map<std::string, llama_cpp_ref> llama_cpp = {
    {"f16", {17.6, 0.82, 126}}, {"q8_0", {24.5, 0.61, 98}}, {"q4_0", {52.5, 0.69, 160}}};

// FLOPs per prompt token of the decoder's weight matmuls (2 per weight); the
// LM head runs once per prompt (only the last token's logits are needed).
double layer_flops_per_token(const models::llama_config& c) {
  const double H = double(c.hidden_size), D = double(c.head_dim), F = double(c.intermediate_size);
  const double per_layer =
      H * D * double(c.num_heads) * 2 + H * D * double(c.num_kv_heads) * 2 + 3 * H * F;
  return 2 * per_layer * double(c.num_layers);
}
double lm_head_flops(const models::llama_config& c) {
  return 2 * double(c.hidden_size) * double(c.vocab_size);
}

// oneDNN u8s8 GEMM rate on 512 x 2048 x 5632 (GOP/s), best of `reps`.
double onednn_u8s8_gops(k::cpu::context& ctx, int reps) {
  const std::int64_t M = 512, K = 2048, N = 5632;
  auto w = k::tensor::empty(ctx.memory(), k::dtype::f32, {N, K});
  auto x = k::tensor::empty(ctx.memory(), k::dtype::f32, {M, K});
  auto y = k::tensor::empty(ctx.memory(), k::dtype::f32, {M, N});
  if (!w || !x || !y) return 0;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (std::int64_t i = 0; i < w->numel(); ++i) w->data_as<float>()[i] = nd(rng);
  for (std::int64_t i = 0; i < x->numel(); ++i) x->data_as<float>()[i] = nd(rng);
  auto wq = k::quantize(ctx.memory(), *w, k::weight_format::int8_sym);
  if (!wq) return 0;
  ctx.prepare_onednn_thread();
  auto mm = k::cpu::onednn_matmul::create(ctx, *wq, M, k::cpu::onednn_kind::u8s8);
  if (!mm || !mm->prepare_input(ctx, *x)) return 0;
  double best_s = 1e9;
  for (int r = 0; r < reps; ++r) {
    const double t0 = now_s();
    if (!mm->execute(ctx, *y)) return 0;
    best_s = std::min(best_s, now_s() - t0);
  }
  return 2.0 * double(M) * double(K) * double(N) / best_s / 1e9;
}

std::vector<std::int32_t> random_tokens(int n, std::uint32_t seed, std::int64_t vocab) {
  std::mt19937 rng(seed);
  std::vector<std::int32_t> t(static_cast<std::size_t>(n));
  for (auto& v : t)
    v = static_cast<std::int32_t>(259 + rng() % static_cast<std::uint32_t>(vocab - 259));
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--threads") {
      opt.threads.clear();
      for (const auto& t : split(next())) opt.threads.push_back(std::atoi(t.c_str()));
    } else if (a == "--formats") {
      opt.formats = split(next());
    } else if (a == "--runs") {
      opt.runs = std::atoi(next().c_str());
    } else if (a == "--prompt") {
      opt.prompt = std::atoi(next().c_str());
    } else if (a == "--gen") {
      opt.gen = std::atoi(next().c_str());
    } else if (a == "--models") {
      opt.models = next();
    } else if (a == "--quick") {
      opt.quick = true;
    } else {
      std::fprintf(stderr,
                   "usage: %s [--threads 2,1] [--formats f16,q8_0,q4_0] [--runs N] [--prompt N] "
                   "[--gen N] [--models DIR] [--quick]\n",
                   argv[0]);
      return 2;
    }
  }
  for (int t : opt.threads)
    if (t < 1 || t > 256) {
      std::fprintf(stderr, "bad thread count\n");
      return 2;
    }
  if (opt.runs < 1 || opt.prompt < 1 || opt.gen < 2) {
    std::fprintf(stderr, "--runs, --prompt must be >= 1 and --gen >= 2\n");
    return 2;
  }
  auto cfg = models::tinyllama_shape();
  if (opt.quick) {  // smoke run: 2 layers, short sequences
    cfg.num_layers = 2;
    opt.prompt = std::min(opt.prompt, 32);
    opt.gen = std::min(opt.gen, 8);
    opt.runs = 1;
  }
  std::string cmd = "mkdir -p '" + opt.models + "'";
  if (std::system(cmd.c_str()) != 0) return 1;
  std::printf(
      "troupe bench/llama: TinyLlama-1.1B shape (dim %lld, %lld layers, %lld heads, %lld KV heads, "
      "FFN %lld, vocab %lld), random weights\n",
      static_cast<long long>(cfg.hidden_size), static_cast<long long>(cfg.num_layers),
      static_cast<long long>(cfg.num_heads), static_cast<long long>(cfg.num_kv_heads),
      static_cast<long long>(cfg.intermediate_size), static_cast<long long>(cfg.vocab_size));
  std::printf("prefill %d tokens, decode %d tokens, median of %d runs; load average at start %s\n",
              opt.prompt, opt.gen, opt.runs, load_average().c_str());
  std::printf(
      "limit = read GB/s (pass right before each decode run) / weight bytes per token; frac = "
      "decode / limit (median of pairs)\n\n");
  std::printf(
      "%-6s %-3s %9s %9s %8s %8s %6s | %10s %9s %8s | llama.cpp 2t: decode  frac  prefill\n",
      "format", "thr", "GB/token", "decode", "limit", "frac", "", "prefill", "GOP/s", "/u8s8");
  for (int threads : opt.threads) {
    auto dev = make_device(threads);
    auto& ctx = dev->ctx();  // the CPU kernels beside the model: oneDNN and the bandwidth pass
    const double u8s8 = onednn_u8s8_gops(ctx, opt.quick ? 1 : 5);
    auto bw = make_bw_buffer(ctx, opt.quick ? (std::size_t{64} << 20) : (std::size_t{1} << 30));
    if (!bw.storage) return 1;
    for (const auto& fname : opt.formats) {
      auto fmt = k::weight_format_from_string(fname);
      if (!fmt) {
        std::fprintf(stderr, "%s\n", fmt.error().message.c_str());
        return 2;
      }
      const std::string path =
          opt.models + "/tinyllama-" + fname + (opt.quick ? "-2l" : "") + ".gguf";
      if (!exists(path)) {
        models::random_model_spec spec;
        spec.config = cfg;
        spec.format = *fmt;
        if (auto r = models::write_random_gguf(path, spec); !r) {
          std::fprintf(stderr, "%s\n", r.error().message.c_str());
          return 1;
        }
      }
      auto model = models::llama_model::load(path, *dev);
      if (!model) {
        std::fprintf(stderr, "%s\n", model.error().message.c_str());
        return 1;
      }
      const auto& m = **model;
      const double bytes_tok = double(m.bytes_per_token());
      std::vector<double> prefill_tps, decode_tps, fractions, limits;
      for (int r = 0; r < opt.runs; ++r) {
        auto cache = m.make_cache(
            dev->memory(),
            models::kv_options{.block_size = 16, .capacity_tokens = opt.prompt + opt.gen + 16});
        if (!cache) return 1;
        const auto s = cache->add_sequence();
        const auto prompt =
            random_tokens(opt.prompt, static_cast<std::uint32_t>(r + 1), cfg.vocab_size);
        double t0 = now_s();
        auto logits = m.forward(*dev, *cache, std::vector<models::step_input>{{s, prompt, false}});
        if (!logits) {
          std::fprintf(stderr, "%s\n", logits.error().message.c_str());
          return 1;
        }
        prefill_tps.push_back(opt.prompt / (now_s() - t0));
        const double gbps = bandwidth_pass(ctx, bw.data(), bw.bytes);
        std::int32_t tok = 300;
        t0 = now_s();
        for (int g = 0; g < opt.gen; ++g) {
          std::vector<std::int32_t> one{tok};
          auto l = m.forward(*dev, *cache, std::vector<models::step_input>{{s, one, false}});
          if (!l) return 1;
          tok = static_cast<std::int32_t>(259 + (g * 7919) % 30000);
        }
        const double tps = opt.gen / (now_s() - t0);
        decode_tps.push_back(tps);
        limits.push_back(gbps * 1e9 / bytes_tok);
        fractions.push_back(tps / limits.back());
      }
      const double pf = median(prefill_tps);
      const double gops =
          (pf * layer_flops_per_token(cfg) + pf / opt.prompt * lm_head_flops(cfg)) / 1e9;
      const auto ref = llama_cpp.count(fname) ? llama_cpp.at(fname) : llama_cpp_ref{0, 0, 0};
      std::printf(
          "%-6s %-3d %9.3f %9.2f %8.2f %8.3f %6s | %10.1f %9.1f %8.3f | %19.1f %5.2f %8.0f\n",
          fname.c_str(), threads, bytes_tok / 1e9, median(decode_tps), median(limits),
          median(fractions), "", pf, gops, u8s8 > 0 ? gops / u8s8 : 0, ref.decode, ref.fraction,
          ref.prefill);
      std::fflush(stdout);
    }
    std::printf("(%d threads: oneDNN u8s8 GEMM 512x2048x5632 = %.1f GOP/s in this run)\n", threads,
                u8s8);
  }
  return 0;
}
