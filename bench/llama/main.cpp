// bench/llama: LLaMA-shaped random models (GGUF F16, Q8_0, Q4_0, written by
// troupe itself; TinyLlama's shape or LLaMA-2-7B's): prefill of 512 tokens
// and decode of 128, with 2 threads and 1. Every figure is taken in rounds
// that interleave what is compared: troupe's prefill, oneDNN's u8s8 GEMM,
// the read bandwidth (the best of several read loops, right before decode),
// troupe's decode and, when llama-cpp-python can be imported, llama.cpp on
// the same file and threads (tools/bench_llamacpp.py --one). Each ratio is
// the median over the rounds of that round's ratio, with its range.
// Formats: f32, f16, q8_0, q4_0 are written by troupe; any other name is a
// llama.cpp ftype (q4_k_m, q5_k_m, q6_k, q5_0, iq4_xs, ...), written from the
// F16 file by llama.cpp's own quantizer (tools/bench_llamacpp.py --quantize,
// so it needs llama-cpp-python). The limit divides the read bandwidth by the
// bytes a token needs in the FILE's format (the 2-D weights, one embedding
// row, the LM head): troupe's packed matrices may hold a little more.
//   bench_llama [--threads 2,1] [--formats f16,q8_0,q4_0] [--rounds 5]
//               [--prompt 512] [--gen 128] [--models DIR] [--shape tinyllama|llama2-7b]
//               [--llamacpp auto|off|PYTHONPATH] [--quick]
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench/common/measure.hpp"
#include "kernels/cpu/onednn_matmul.hpp"
#include "models/gguf.hpp"
#include "models/llama.hpp"
#include "models/random_model.hpp"

using namespace troupe;
using namespace troupe::bench;
namespace k = troupe::kernels;

namespace {

struct options {
  std::vector<int> threads{2, 1};
  std::vector<std::string> formats{"f16", "q8_0", "q4_0"};
  int rounds = 5;
  int prompt = 512, gen = 128;
  std::string models = "build/bench-models";
  std::string shape = "tinyllama";
  std::string llamacpp = "auto";  // auto, off, or a PYTHONPATH holding llama_cpp
  std::string tool = "tools/bench_llamacpp.py";
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

std::string quoted(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// llama.cpp through llama-cpp-python, one run per call (a process of its
// own, so troupe's model and llama.cpp's are never resident at once in a
// measured section).
struct llama_cpp {
  std::string python_path;  // empty: the interpreter's own
  std::string tool;
  std::string why_not;  // set when llama.cpp cannot be measured

  std::string env() const {
    return python_path.empty() ? "" : "PYTHONPATH=" + quoted(python_path) + " ";
  }
  static llama_cpp find(const options& o) {
    llama_cpp l;
    l.tool = o.tool;
    if (o.llamacpp == "off") {
      l.why_not = "--llamacpp off";
      return l;
    }
    if (o.llamacpp != "auto") l.python_path = o.llamacpp;
    if (!exists(l.tool)) {
      l.why_not = l.tool + " not found (run from the repository root or pass --llamacpp-tool)";
      return l;
    }
    const std::string probe = l.env() + "python3 -c 'import llama_cpp' >/dev/null 2>&1";
    if (std::system(probe.c_str()) != 0)
      l.why_not =
          "llama_cpp cannot be imported (python3 -m pip install --target DIR "
          "llama-cpp-python==0.3.36, then --llamacpp DIR)";
    return l;
  }
  // {prefill t/s, decode t/s} of one run, or nothing.
  std::optional<std::pair<double, double>> run(const std::string& model, int threads, int prompt,
                                               int gen) const {
    if (!why_not.empty()) return std::nullopt;
    const std::string cmd = env() + "python3 " + quoted(tool) + " --one --threads " +
                            std::to_string(threads) + " --prompt " + std::to_string(prompt) +
                            " --gen " + std::to_string(gen) + " " + quoted(model) + " 2>/dev/null";
    std::FILE* f = ::popen(cmd.c_str(), "r");
    if (f == nullptr) return std::nullopt;
    double p = 0, d = 0;
    const int got = std::fscanf(f, "%lf %lf", &p, &d);
    const int rc = ::pclose(f);
    if (got != 2 || rc != 0 || p <= 0 || d <= 0) return std::nullopt;
    return std::make_pair(p, d);
  }

  // Writes `dst` from `src` with llama.cpp's quantizer (ftype e.g. "q4_k_m").
  bool quantize(const std::string& src, const std::string& dst, const std::string& ftype) const {
    if (!why_not.empty()) return false;
    const std::string cmd = env() + "python3 " + quoted(tool) + " --quantize " + quoted(src) + " " +
                            quoted(dst) + " " + quoted(ftype) + " >/dev/null 2>&1";
    return std::system(cmd.c_str()) == 0;
  }
};

// Bytes of weights a decoded token reads in the file's own formats: every
// 2-D tensor but the embedding table, one row of it, and the table again
// when it is also the LM head.
double file_bytes_per_token(const std::string& path) {
  auto f = models::gguf_file::open(path);
  if (!f) return 0;
  double b = 0;
  bool tied = f->find_tensor("output.weight") == nullptr;
  for (const auto& t : f->tensors()) {
    if (t.ne.size() != 2) continue;
    if (t.name == "token_embd.weight") {
      b += double(t.bytes) / double(t.ne[1]);
      if (tied) b += double(t.bytes);
    } else {
      b += double(t.bytes);
    }
  }
  return b;
}

// "median [min-max]" of per-round ratios.
std::string spread(const std::vector<double>& v, const char* fmt = "%.2f") {
  if (v.empty()) return "-";
  char a[32], b[32], c[32];
  std::snprintf(a, sizeof a, fmt, median(v));
  std::snprintf(b, sizeof b, fmt, *std::min_element(v.begin(), v.end()));
  std::snprintf(c, sizeof c, fmt, *std::max_element(v.begin(), v.end()));
  return std::string(a) + " [" + b + "-" + c + "]";
}

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
    } else if (a == "--rounds" || a == "--runs") {
      opt.rounds = std::atoi(next().c_str());
    } else if (a == "--prompt") {
      opt.prompt = std::atoi(next().c_str());
    } else if (a == "--gen") {
      opt.gen = std::atoi(next().c_str());
    } else if (a == "--models") {
      opt.models = next();
    } else if (a == "--shape") {
      opt.shape = next();
    } else if (a == "--llamacpp") {
      opt.llamacpp = next();
    } else if (a == "--llamacpp-tool") {
      opt.tool = next();
    } else if (a == "--quick") {
      opt.quick = true;
    } else {
      std::fprintf(stderr,
                   "usage: %s [--threads 2,1] [--formats f16,q8_0,q4_0] [--rounds N] [--prompt N] "
                   "[--gen N] [--models DIR] [--shape tinyllama|llama2-7b] "
                   "[--llamacpp auto|off|PYTHONPATH] [--llamacpp-tool PATH] [--quick]\n",
                   argv[0]);
      return 2;
    }
  }
  for (int t : opt.threads)
    if (t < 1 || t > 256) {
      std::fprintf(stderr, "bad thread count\n");
      return 2;
    }
  if (opt.rounds < 1 || opt.prompt < 1 || opt.gen < 2) {
    std::fprintf(stderr, "--rounds, --prompt must be >= 1 and --gen >= 2\n");
    return 2;
  }
  if (opt.shape != "tinyllama" && opt.shape != "llama2-7b") {
    std::fprintf(stderr, "--shape: tinyllama or llama2-7b\n");
    return 2;
  }
  auto cfg = opt.shape == "tinyllama" ? models::tinyllama_shape() : models::llama2_7b_shape();
  if (opt.quick) {  // smoke run: 2 layers, short sequences, one round
    cfg.num_layers = 2;
    opt.prompt = std::min(opt.prompt, 32);
    opt.gen = std::min(opt.gen, 8);
    opt.rounds = 1;
  }
  const auto lcpp = llama_cpp::find(opt);
  std::string cmd = "mkdir -p '" + opt.models + "'";
  if (std::system(cmd.c_str()) != 0) return 1;
  std::printf(
      "troupe bench/llama: %s shape (dim %lld, %lld layers, %lld heads, %lld KV heads, FFN %lld, "
      "vocab %lld), random weights\n",
      opt.shape.c_str(), static_cast<long long>(cfg.hidden_size),
      static_cast<long long>(cfg.num_layers), static_cast<long long>(cfg.num_heads),
      static_cast<long long>(cfg.num_kv_heads), static_cast<long long>(cfg.intermediate_size),
      static_cast<long long>(cfg.vocab_size));
  std::printf(
      "prefill %d tokens, decode %d tokens, %d interleaved rounds; load average at start %s\n",
      opt.prompt, opt.gen, opt.rounds, load_average().c_str());
  std::printf(
      "limit = the best read pass (of %zu read loops, right before each decode) / the weight bytes "
      "a token needs in the file's formats (GB/tok; troupe: what its packed matrices read); each "
      "ratio: the median over the rounds of that round's ratio [min-max]\n",
      read_kernels().size());
  if (lcpp.why_not.empty())
    std::printf("llama.cpp: measured in each round on the same file (%s)\n\n", lcpp.tool.c_str());
  else
    std::printf("llama.cpp: not measured: %s\n\n", lcpp.why_not.c_str());
  std::printf("%-6s %-3s %8s %8s %8s %8s %-18s | %8s %-18s | %7s %7s %-18s %-18s\n", "format",
              "thr", "GB/tok", "troupe", "decode", "limit", "decode/limit", "prefill",
              "prefill/u8s8", "l.cpp:d", "l.cpp:p", "decode/l.cpp", "prefill/l.cpp");
  for (int threads : opt.threads) {
    auto dev = make_device(threads);
    auto& ctx = dev->ctx();  // the CPU kernels beside the model: oneDNN and the bandwidth pass
    auto bw = make_bw_buffer(ctx, opt.quick ? (std::size_t{64} << 20) : (std::size_t{1} << 30));
    if (!bw.storage) return 1;
    std::map<std::string, int> winners;  // which read loop gave the limit
    std::vector<double> u8s8_all;
    for (const auto& fname : opt.formats) {
      auto model_path = [&](const std::string& f) {
        return opt.models + "/" + opt.shape + "-" + f + (opt.quick ? "-2l" : "") + ".gguf";
      };
      std::function<int(const std::string&)> write = [&](const std::string& f) -> int {
        const std::string path = model_path(f);
        if (exists(path)) return 0;
        auto fmt = k::weight_format_from_string(f);
        // troupe writes its own formats and ggml's simple block formats
        // (every matrix in the one format); llama.cpp's quantizer the rest.
        using wf = k::weight_format;
        if (fmt && (*fmt <= wf::q4_0 || *fmt == wf::q4_1 || *fmt == wf::q5_0 || *fmt == wf::q5_1)) {
          models::random_model_spec spec;
          spec.config = cfg;
          spec.format = *fmt;
          if (auto r = models::write_random_gguf(path, spec); !r) {
            std::fprintf(stderr, "%s\n", r.error().message.c_str());
            return 1;
          }
          return 0;
        }
        // A llama.cpp ftype: its quantizer makes it from the F16 file.
        if (int rc = write("f16"); rc != 0) return rc;
        if (!lcpp.quantize(model_path("f16"), path, f)) {
          std::fprintf(stderr, "%s: llama.cpp's quantizer could not write it (%s)\n", path.c_str(),
                       lcpp.why_not.empty() ? "unknown ftype?" : lcpp.why_not.c_str());
          return 2;
        }
        return 0;
      };
      const std::string path = model_path(fname);
      if (int rc = write(fname); rc != 0) return rc;
      const double file_bytes = file_bytes_per_token(path);
      std::vector<double> prefill_tps, decode_tps, limits, frac, pf_u8s8, l_dec, l_pf, r_dec, r_pf;
      double bytes_tok = 0;
      for (int r = 0; r < opt.rounds; ++r) {
        {
          // troupe's model is resident only for its own part of the round.
          auto model = models::llama_model::load(path, *dev);
          if (!model) {
            std::fprintf(stderr, "%s\n", model.error().message.c_str());
            return 1;
          }
          const auto& m = **model;
          bytes_tok = double(m.bytes_per_token());
          auto cache = m.make_cache(
              dev->memory(),
              models::kv_options{.block_size = 16, .capacity_tokens = opt.prompt + opt.gen + 16});
          if (!cache) return 1;
          const auto s = cache->add_sequence();
          const auto prompt =
              random_tokens(opt.prompt, static_cast<std::uint32_t>(r + 1), cfg.vocab_size);
          double t0 = now_s();
          auto logits =
              m.forward(*dev, *cache, std::vector<models::step_input>{{s, prompt, false}});
          if (!logits) {
            std::fprintf(stderr, "%s\n", logits.error().message.c_str());
            return 1;
          }
          const double pf = opt.prompt / (now_s() - t0);
          const double u8s8 = onednn_u8s8_gops(ctx, opt.quick ? 1 : 3);
          const auto limit = bandwidth_best(ctx, bw.data(), bw.bytes);
          ++winners[limit.kernel];
          std::int32_t tok = 300;
          t0 = now_s();
          for (int g = 0; g < opt.gen; ++g) {
            std::vector<std::int32_t> one{tok};
            auto l = m.forward(*dev, *cache, std::vector<models::step_input>{{s, one, false}});
            if (!l) return 1;
            tok = static_cast<std::int32_t>(259 + (g * 7919) % 30000);
          }
          const double dec = opt.gen / (now_s() - t0);
          const double gops =
              (pf * layer_flops_per_token(cfg) + pf / opt.prompt * lm_head_flops(cfg)) / 1e9;
          prefill_tps.push_back(pf);
          decode_tps.push_back(dec);
          limits.push_back(limit.gbps * 1e9 / (file_bytes > 0 ? file_bytes : bytes_tok));
          frac.push_back(dec / limits.back());
          u8s8_all.push_back(u8s8);
          if (u8s8 > 0) pf_u8s8.push_back(gops / u8s8);
        }
        if (auto l = lcpp.run(path, threads, opt.prompt, opt.gen)) {
          l_pf.push_back(l->first);
          l_dec.push_back(l->second);
          r_pf.push_back(prefill_tps.back() / l->first);
          r_dec.push_back(decode_tps.back() / l->second);
        }
      }
      char ld[16] = "-", lp[16] = "-";
      if (!l_dec.empty()) {
        std::snprintf(ld, sizeof ld, "%.1f", median(l_dec));
        std::snprintf(lp, sizeof lp, "%.1f", median(l_pf));
      }
      std::printf("%-6s %-3d %8.3f %8.3f %8.2f %8.2f %-18s | %8.1f %-18s | %7s %7s %-18s %-18s\n",
                  fname.c_str(), threads, (file_bytes > 0 ? file_bytes : bytes_tok) / 1e9,
                  bytes_tok / 1e9, median(decode_tps), median(limits), spread(frac).c_str(),
                  median(prefill_tps), spread(pf_u8s8).c_str(), ld, lp, spread(r_dec).c_str(),
                  spread(r_pf).c_str());
      std::fflush(stdout);
    }
    std::string w;
    for (const auto& [name, n] : winners)
      w += (w.empty() ? "" : ", ") + name + " x" + std::to_string(n);
    std::printf(
        "(%d threads: oneDNN u8s8 GEMM 512x2048x5632 = %s GOP/s; the limit's read loop: %s)\n",
        threads, spread(u8s8_all, "%.1f").c_str(), w.c_str());
  }
  return 0;
}
