#include "models/image_processor.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <optional>

#include "models/llama_config.hpp"

namespace troupe::models {

using json = nlohmann::json;

namespace {

constexpr std::int64_t max_config_side = 1 << 16;

// A JSON value for a message, shortened.
std::string shown(const json& v) {
  std::string s = v.dump();
  return s.size() > 80 ? s.substr(0, 77) + "..." : s;
}

error config_error(const std::string& src, const std::string& key, const std::string& what) {
  return error{errc::corrupt_data, src + ": " + key + " " + what};
}

result<std::optional<bool>> get_bool(const json& j, const char* key, const std::string& src) {
  auto it = j.find(key);
  if (it == j.end()) {
    return std::nullopt;
  }
  if (!it->is_boolean()) {
    return std::unexpected(config_error(src, key, "must be true or false, got " + shown(*it)));
  }
  return it->get<bool>();
}

result<std::int64_t> side(const json& v, const std::string& src, const std::string& key) {
  if (!v.is_number_integer()) {
    return std::unexpected(config_error(src, key, "must be an integer, got " + shown(v)));
  }
  const auto n = v.get<std::int64_t>();
  if (n < 1 || n > max_config_side) {
    return std::unexpected(config_error(
        src, key,
        "= " + std::to_string(n) + " is outside [1, " + std::to_string(max_config_side) + "]"));
  }
  return n;
}

// transformers' size dicts: an int, [height, width], or one of the key sets
// {height, width}, {shortest_edge}, {shortest_edge, longest_edge},
// {longest_edge}, {max_height, max_width}.
struct size_spec {
  std::int64_t shortest_edge = 0;  // > 0: shortest-edge form
  std::int64_t height = 0;
  std::int64_t width = 0;
};

result<size_spec> parse_size(const json& v, bool int_is_square, const std::string& src,
                             const char* key) {
  size_spec out;
  if (v.is_number_integer()) {
    auto n = side(v, src, key);
    if (!n) {
      return std::unexpected(n.error());
    }
    if (int_is_square) {
      out.height = out.width = *n;
    } else {
      out.shortest_edge = *n;
    }
    return out;
  }
  if (v.is_array()) {
    if (v.size() != 2) {
      return std::unexpected(config_error(src, key, "must be [height, width], got " + shown(v)));
    }
    auto h = side(v[0], src, std::string(key) + "[0]");
    auto w = side(v[1], src, std::string(key) + "[1]");
    if (!h || !w) {
      return std::unexpected(!h ? h.error() : w.error());
    }
    out.height = *h;
    out.width = *w;
    return out;
  }
  if (!v.is_object()) {
    return std::unexpected(
        config_error(src, key, "must be an integer, a list or an object, got " + shown(v)));
  }
  auto has = [&](const char* k) { return v.contains(k); };
  const std::size_t n = v.size();
  const bool hw = n == 2 && has("height") && has("width");
  const bool se =
      (n == 1 && has("shortest_edge")) || (n == 2 && has("shortest_edge") && has("longest_edge"));
  const bool other =
      (n == 1 && has("longest_edge")) || (n == 2 && has("max_height") && has("max_width"));
  if (!hw && !se && !other) {
    return std::unexpected(config_error(src, key,
                                        "must have the keys {height, width}, {shortest_edge} or "
                                        "{shortest_edge, longest_edge}, got " +
                                            shown(v)));
  }
  for (const auto& [k, value] : v.items()) {
    auto s = side(value, src, std::string(key) + "." + k);
    if (!s) {
      return std::unexpected(s.error());
    }
  }
  if (other) {
    return std::unexpected(
        config_error(src, key, "form " + shown(v) + " is not supported by CLIPImageProcessor"));
  }
  if (se) {
    // CLIPImageProcessor resizes by shortest_edge alone (longest_edge unused).
    out.shortest_edge = v["shortest_edge"].get<std::int64_t>();
  } else {
    out.height = v["height"].get<std::int64_t>();
    out.width = v["width"].get<std::int64_t>();
  }
  return out;
}

result<std::array<double, 3>> parse_triple(const json& v, const std::string& src, const char* key,
                                           bool positive) {
  std::array<double, 3> out{};
  auto one = [&](const json& e, double& d) -> result<void> {
    if (!e.is_number()) {
      return std::unexpected(config_error(src, key, "must hold numbers, got " + shown(v)));
    }
    d = e.get<double>();
    if (!std::isfinite(d) || (positive && d <= 0)) {
      return std::unexpected(config_error(src, key,
                                          positive ? "must hold finite numbers > 0, got " + shown(v)
                                                   : "must hold finite numbers, got " + shown(v)));
    }
    return {};
  };
  if (v.is_array()) {
    if (v.size() != 3) {
      return std::unexpected(
          config_error(src, key, "must have 3 values (one per RGB channel), got " + shown(v)));
    }
    for (std::size_t i = 0; i < 3; ++i) {
      if (auto r = one(v[i], out[i]); !r) {
        return std::unexpected(r.error());
      }
    }
    return out;
  }
  if (auto r = one(v, out[0]); !r) {
    return std::unexpected(r.error());
  }
  out[1] = out[2] = out[0];
  return out;
}

// PIL's filters (Resample.c), support in input pixels at scale 1.
double bicubic(double x) {
  constexpr double a = -0.5;
  x = std::abs(x);
  if (x < 1.0) {
    return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
  }
  if (x < 2.0) {
    return (((x - 5) * x + 8) * x - 4) * a;
  }
  return 0.0;
}

double bilinear(double x) {
  x = std::abs(x);
  return x < 1.0 ? 1.0 - x : 0.0;
}

constexpr int precision_bits = 32 - 8 - 2;

// PIL's precompute_coeffs + normalize_coeffs_8bpc: for each output index,
// the first input index, the tap count and ksize fixed-point weights.
struct coeffs {
  int ksize = 0;
  std::vector<int> first, count;
  std::vector<std::int32_t> weights;
};

coeffs precompute(int in_size, int out_size, resample_filter filter) {
  const double support_1 = filter == resample_filter::bicubic ? 2.0 : 1.0;
  // PIL's box is float; in1 - in0 = in_size exactly for sizes < 2^24.
  const double scale = static_cast<double>(static_cast<float>(in_size)) / out_size;
  const double filterscale = std::max(scale, 1.0);
  const double support = support_1 * filterscale;
  coeffs c;
  c.ksize = static_cast<int>(std::ceil(support)) * 2 + 1;
  c.first.resize(static_cast<std::size_t>(out_size));
  c.count.resize(static_cast<std::size_t>(out_size));
  c.weights.assign(static_cast<std::size_t>(out_size) * static_cast<std::size_t>(c.ksize), 0);
  std::vector<double> k(static_cast<std::size_t>(c.ksize));
  for (int xx = 0; xx < out_size; ++xx) {
    const double center = (xx + 0.5) * scale;
    const double ss = 1.0 / filterscale;
    int xmin = static_cast<int>(center - support + 0.5);
    xmin = std::max(xmin, 0);
    int xmax = static_cast<int>(center + support + 0.5);
    xmax = std::min(xmax, in_size) - xmin;
    xmax = std::min(xmax, c.ksize);
    double ww = 0.0;
    for (int x = 0; x < xmax; ++x) {
      const double arg = (x + xmin - center + 0.5) * ss;
      const double w = filter == resample_filter::bicubic ? bicubic(arg) : bilinear(arg);
      k[static_cast<std::size_t>(x)] = w;
      ww += w;
    }
    std::int32_t* out =
        c.weights.data() + static_cast<std::size_t>(xx) * static_cast<std::size_t>(c.ksize);
    for (int x = 0; x < xmax; ++x) {
      double w = k[static_cast<std::size_t>(x)];
      if (ww != 0.0) {
        w /= ww;
      }
      const double fixed = w * (1 << precision_bits);
      out[x] = static_cast<std::int32_t>(w < 0 ? -0.5 + fixed : 0.5 + fixed);
    }
    c.first[static_cast<std::size_t>(xx)] = xmin;
    c.count[static_cast<std::size_t>(xx)] = std::max(xmax, 0);
  }
  return c;
}

std::uint8_t clip8(std::int64_t ss) {
  return static_cast<std::uint8_t>(std::clamp<std::int64_t>(ss >> precision_bits, 0, 255));
}

result<void> check_pixels(std::int64_t w, std::int64_t h, std::int64_t max_pixels,
                          const char* what) {
  const std::string size = std::to_string(w) + "x" + std::to_string(h);
  if (w < 1 || h < 1) {
    return make_error(errc::invalid_argument, std::string(what) + ": invalid size " + size);
  }
  if (w > (std::int64_t{1} << 30) || h > (std::int64_t{1} << 30) || w * h > max_pixels) {
    return make_error(errc::invalid_argument, std::string(what) + ": a " + size +
                                                  " result exceeds the limit of " +
                                                  std::to_string(max_pixels) + " pixels");
  }
  return {};
}

result<void> check_image(const image& in) {
  if (in.width < 1 || in.height < 1 ||
      in.rgb.size() !=
          static_cast<std::size_t>(in.width) * static_cast<std::size_t>(in.height) * 3) {
    return make_error(errc::invalid_argument,
                      "image: " + std::to_string(in.width) + "x" + std::to_string(in.height) +
                          " with " + std::to_string(in.rgb.size()) + " bytes is not RGB8");
  }
  return {};
}

}  // namespace

result<kernels::tensor> pixel_values::view() {
  if (data.size() != static_cast<std::size_t>(3 * height * width)) {
    return make_error(errc::shape_mismatch, "pixel_values: size does not match 3 x height x width");
  }
  return kernels::tensor::view(data.data(), kernels::dtype::f32, {3, height, width});
}

result<image_processor_config> parse_image_processor_config(std::string_view text,
                                                            const std::string& src) {
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded()) {
    return make_error(errc::corrupt_data, src + ": not valid JSON");
  }
  if (!j.is_object()) {
    return make_error(errc::corrupt_data, src + ": must be a JSON object");
  }
  image_processor_config c;
  std::string type = "CLIPImageProcessor";
  for (const char* key : {"image_processor_type", "feature_extractor_type"}) {
    auto it = j.find(key);
    if (it == j.end()) {
      continue;
    }
    if (!it->is_string()) {
      return std::unexpected(config_error(src, key, "must be a string, got " + shown(*it)));
    }
    type = it->get<std::string>();
    if (type == "CLIPFeatureExtractor") {
      type = "CLIPImageProcessor";
    }
    break;  // image_processor_type wins over the older feature_extractor_type
  }
  if (type != "CLIPImageProcessor" && type != "LlavaImageProcessor" &&
      type != "SiglipImageProcessor") {
    return make_error(errc::unsupported_op, src + ": image processor '" + type +
                                                "' is not supported (CLIPImageProcessor, "
                                                "LlavaImageProcessor, SiglipImageProcessor)");
  }
  if (type == "SiglipImageProcessor") {
    // SiglipImageProcessor's defaults: a plain 224 x 224 resize, no crop,
    // mean and std 0.5.
    c.shortest_edge = 0;
    c.resize_height = c.resize_width = 224;
    c.do_center_crop = false;
    c.image_mean = {0.5, 0.5, 0.5};
    c.image_std = {0.5, 0.5, 0.5};
  }
  struct flag {
    const char* key;
    bool* out;
  };
  bool do_pad = false;
  bool use_square_size = false;
  for (const flag& f : {flag{"do_resize", &c.do_resize}, flag{"do_center_crop", &c.do_center_crop},
                        flag{"do_rescale", &c.do_rescale}, flag{"do_normalize", &c.do_normalize},
                        flag{"do_convert_rgb", &c.do_convert_rgb}, flag{"do_pad", &do_pad},
                        flag{"use_square_size", &use_square_size}}) {
    auto v = get_bool(j, f.key, src);
    if (!v) {
      return std::unexpected(v.error());
    }
    if (*v) {
      *f.out = **v;
    }
  }
  if (auto it = j.find("size"); it != j.end()) {
    auto s = parse_size(*it, false, src, "size");
    if (!s) {
      return std::unexpected(s.error());
    }
    c.shortest_edge = s->shortest_edge;
    c.resize_height = s->height;
    c.resize_width = s->width;
  }
  if (use_square_size && c.shortest_edge > 0) {
    c.resize_height = c.resize_width = c.shortest_edge;
    c.shortest_edge = 0;
  }
  if (auto it = j.find("crop_size"); it != j.end()) {
    auto s = parse_size(*it, true, src, "crop_size");
    if (!s) {
      return std::unexpected(s.error());
    }
    if (s->shortest_edge > 0) {
      return std::unexpected(
          config_error(src, "crop_size", "must give height and width, got " + shown(*it)));
    }
    c.crop_height = s->height;
    c.crop_width = s->width;
  }
  if (auto it = j.find("resample"); it != j.end()) {
    if (!it->is_number_integer()) {
      return std::unexpected(
          config_error(src, "resample", "must be an integer PIL filter code, got " + shown(*it)));
    }
    const auto r = it->get<std::int64_t>();
    static const char* const names[] = {"nearest", "lanczos", "bilinear",
                                        "bicubic", "box",     "hamming"};
    if (r == 2 || r == 3) {
      c.resample = static_cast<resample_filter>(r);
    } else if (r >= 0 && r <= 5) {
      return make_error(errc::unsupported_op,
                        src + ": resample " + std::to_string(r) + " (" + names[r] +
                            ") is not supported; supported: 2 (bilinear), 3 (bicubic)");
    } else {
      return std::unexpected(
          config_error(src, "resample", "= " + std::to_string(r) + " is not a PIL filter code"));
    }
  }
  if (auto it = j.find("rescale_factor"); it != j.end()) {
    if (!it->is_number() || !std::isfinite(it->get<double>()) || it->get<double>() <= 0) {
      return std::unexpected(
          config_error(src, "rescale_factor", "must be a finite number > 0, got " + shown(*it)));
    }
    c.rescale_factor = it->get<double>();
  }
  if (auto it = j.find("image_mean"); it != j.end()) {
    auto m = parse_triple(*it, src, "image_mean", false);
    if (!m) {
      return std::unexpected(m.error());
    }
    c.image_mean = *m;
  }
  if (auto it = j.find("image_std"); it != j.end()) {
    auto s = parse_triple(*it, src, "image_std", true);
    if (!s) {
      return std::unexpected(s.error());
    }
    c.image_std = *s;
  }
  // LLaVA's own key; transformers' LlavaImageProcessor uses do_pad (for
  // CLIPImageProcessor do_pad means nothing, as in transformers).
  if (auto it = j.find("image_aspect_ratio"); it != j.end()) {
    const std::string v = it->is_string() ? it->get<std::string>() : "";
    if (v == "pad") {
      c.pad_to_square = true;
    } else if (v == "square" || v == "resize") {
      c.pad_to_square = false;
    } else {
      return std::unexpected(config_error(
          src, "image_aspect_ratio",
          "must be \"pad\" or \"square\" (\"anyres\" is not supported), got " + shown(*it)));
    }
  }
  if (type == "LlavaImageProcessor" && do_pad) {
    c.pad_to_square = true;
  }
  if (c.pad_to_square) {
    for (double m : c.image_mean) {
      if (m < 0 || m > 1) {
        return std::unexpected(
            config_error(src, "image_mean", "must lie in [0, 1] to pad with the mean color"));
      }
    }
  }
  return c;
}

result<image_processor_config> load_image_processor_config(const std::string& path) {
  struct stat st {};
  std::string file = path;
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    file = path + "/preprocessor_config.json";
  }
  auto text = read_text_file(file, 1 << 20);
  if (!text) {
    return std::unexpected(text.error());
  }
  return parse_image_processor_config(*text, file);
}

std::array<std::int64_t, 2> resize_output_size(const image_processor_config& c, std::int64_t height,
                                               std::int64_t width) {
  if (c.shortest_edge <= 0) {
    return {c.resize_height, c.resize_width};
  }
  const std::int64_t short_side = std::min(height, width);
  const std::int64_t long_side = std::max(height, width);
  // Python: int(size * long / short), a true (double) division, truncated.
  const auto new_long = static_cast<std::int64_t>(static_cast<double>(c.shortest_edge * long_side) /
                                                  static_cast<double>(short_side));
  if (width <= height) {
    return {new_long, c.shortest_edge};
  }
  return {c.shortest_edge, new_long};
}

result<image> resize_image(const image& in, int width, int height, resample_filter filter,
                           std::int64_t max_pixels) {
  if (auto ok = check_image(in); !ok) {
    return std::unexpected(ok.error());
  }
  if (auto ok = check_pixels(width, height, max_pixels, "resize"); !ok) {
    return std::unexpected(ok.error());
  }
  if (width == in.width && height == in.height) {
    return in;  // PIL returns a copy
  }
  const coeffs vert = precompute(in.height, height, filter);
  // Rows of the input the vertical pass reads.
  const int y_first = vert.first.front();
  const int y_last = vert.first.back() + vert.count.back();
  const int rows = in.width == width ? in.height : y_last - y_first;
  if (auto ok = check_pixels(width, std::max(rows, 1), max_pixels, "resize intermediate"); !ok) {
    return std::unexpected(ok.error());
  }
  // Horizontal pass over the used rows (PIL skips it when the width stays).
  image tmp;
  const image* src = &in;
  int src_row0 = 0;
  if (width != in.width) {
    const coeffs hor = precompute(in.width, width, filter);
    tmp.width = width;
    tmp.height = rows;
    tmp.rgb.resize(static_cast<std::size_t>(width) * static_cast<std::size_t>(rows) * 3);
    for (int y = 0; y < rows; ++y) {
      const std::uint8_t* row =
          in.rgb.data() + static_cast<std::size_t>(y + y_first) * in.width * 3;
      std::uint8_t* out = tmp.rgb.data() + static_cast<std::size_t>(y) * width * 3;
      for (int xx = 0; xx < width; ++xx) {
        const std::int32_t* k = hor.weights.data() + static_cast<std::size_t>(xx) * hor.ksize;
        const std::uint8_t* p =
            row + static_cast<std::size_t>(hor.first[static_cast<std::size_t>(xx)]) * 3;
        std::int64_t s0 = 1 << (precision_bits - 1), s1 = s0, s2 = s0;
        for (int x = 0; x < hor.count[static_cast<std::size_t>(xx)]; ++x, p += 3) {
          s0 += p[0] * k[x];
          s1 += p[1] * k[x];
          s2 += p[2] * k[x];
        }
        out[xx * 3 + 0] = clip8(s0);
        out[xx * 3 + 1] = clip8(s1);
        out[xx * 3 + 2] = clip8(s2);
      }
    }
    src = &tmp;
    src_row0 = y_first;
  }
  if (height == in.height) {
    return tmp;  // only the horizontal pass (it covered every row)
  }
  image out;
  out.width = width;
  out.height = height;
  out.rgb.resize(static_cast<std::size_t>(width) * static_cast<std::size_t>(height) * 3);
  const std::size_t stride = static_cast<std::size_t>(width) * 3;
  for (int yy = 0; yy < height; ++yy) {
    const std::int32_t* k = vert.weights.data() + static_cast<std::size_t>(yy) * vert.ksize;
    const int y0 = vert.first[static_cast<std::size_t>(yy)] - src_row0;
    const int n = vert.count[static_cast<std::size_t>(yy)];
    std::uint8_t* o = out.rgb.data() + static_cast<std::size_t>(yy) * stride;
    for (std::size_t x = 0; x < stride; ++x) {
      std::int64_t s = 1 << (precision_bits - 1);
      const std::uint8_t* p = src->rgb.data() + static_cast<std::size_t>(y0) * stride + x;
      for (int y = 0; y < n; ++y, p += stride) {
        s += *p * k[y];
      }
      o[x] = clip8(s);
    }
  }
  return out;
}

result<image> pad_to_square(const image& in, std::array<std::uint8_t, 3> color,
                            std::int64_t max_pixels) {
  if (auto ok = check_image(in); !ok) {
    return std::unexpected(ok.error());
  }
  if (in.width == in.height) {
    return in;
  }
  const int side_px = std::max(in.width, in.height);
  if (auto ok = check_pixels(side_px, side_px, max_pixels, "pad to square"); !ok) {
    return std::unexpected(ok.error());
  }
  image out;
  out.width = out.height = side_px;
  out.rgb.resize(static_cast<std::size_t>(side_px) * static_cast<std::size_t>(side_px) * 3);
  for (std::size_t i = 0; i < out.rgb.size(); i += 3) {
    out.rgb[i] = color[0];
    out.rgb[i + 1] = color[1];
    out.rgb[i + 2] = color[2];
  }
  const int top = (side_px - in.height) / 2;
  const int left = (side_px - in.width) / 2;
  const std::size_t row = static_cast<std::size_t>(in.width) * 3;
  for (int y = 0; y < in.height; ++y) {
    std::copy_n(in.rgb.data() + static_cast<std::size_t>(y) * row, row,
                out.rgb.data() + (static_cast<std::size_t>(y + top) * side_px + left) * 3);
  }
  return out;
}

result<image> center_crop(const image& in, std::int64_t height, std::int64_t width,
                          std::int64_t max_pixels) {
  if (auto ok = check_image(in); !ok) {
    return std::unexpected(ok.error());
  }
  if (auto ok = check_pixels(width, height, max_pixels, "center crop"); !ok) {
    return std::unexpected(ok.error());
  }
  // Python floor division: negative when the crop is larger (zero padding).
  auto floor_half = [](std::int64_t d) { return d >= 0 ? d / 2 : -((-d + 1) / 2); };
  const std::int64_t top = floor_half(in.height - height);
  const std::int64_t left = floor_half(in.width - width);
  image out;
  out.width = static_cast<int>(width);
  out.height = static_cast<int>(height);
  out.rgb.assign(static_cast<std::size_t>(width * height * 3), 0);
  for (std::int64_t y = 0; y < height; ++y) {
    const std::int64_t sy = y + top;
    if (sy < 0 || sy >= in.height) {
      continue;
    }
    const std::int64_t x0 = std::max<std::int64_t>(0, -left);
    const std::int64_t x1 = std::min<std::int64_t>(width, in.width - left);
    if (x1 <= x0) {
      continue;
    }
    std::copy_n(in.rgb.data() + static_cast<std::size_t>((sy * in.width + x0 + left) * 3),
                static_cast<std::size_t>((x1 - x0) * 3),
                out.rgb.data() + static_cast<std::size_t>((y * width + x0) * 3));
  }
  return out;
}

result<pixel_values> preprocess_image(const image& in, const image_processor_config& c) {
  if (auto ok = check_image(in); !ok) {
    return std::unexpected(ok.error());
  }
  const image* cur = &in;
  image padded, resized, cropped;
  if (c.pad_to_square) {
    std::array<std::uint8_t, 3> color{};
    for (int i = 0; i < 3; ++i) {
      // Python int(x * 255): truncation (mean is checked to lie in [0, 1]).
      color[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(
          std::clamp(c.image_mean[static_cast<std::size_t>(i)] * 255.0, 0.0, 255.0));
    }
    auto r = pad_to_square(*cur, color, c.max_step_pixels);
    if (!r) {
      return std::unexpected(r.error());
    }
    padded = std::move(*r);
    cur = &padded;
  }
  if (c.do_resize) {
    const auto [h, w] = resize_output_size(c, cur->height, cur->width);
    if (auto ok = check_pixels(w, h, c.max_step_pixels, "resize"); !ok) {
      return std::unexpected(ok.error());
    }
    auto r =
        resize_image(*cur, static_cast<int>(w), static_cast<int>(h), c.resample, c.max_step_pixels);
    if (!r) {
      return std::unexpected(r.error());
    }
    resized = std::move(*r);
    cur = &resized;
  }
  if (c.do_center_crop) {
    auto r = center_crop(*cur, c.crop_height, c.crop_width, c.max_step_pixels);
    if (!r) {
      return std::unexpected(r.error());
    }
    cropped = std::move(*r);
    cur = &cropped;
  }
  pixel_values out;
  out.height = cur->height;
  out.width = cur->width;
  const std::size_t plane =
      static_cast<std::size_t>(cur->width) * static_cast<std::size_t>(cur->height);
  out.data.resize(plane * 3);
  for (std::size_t ch = 0; ch < 3; ++ch) {
    // numpy: rescale in f64 then cast to f32; normalize in f32.
    const auto mean = static_cast<float>(c.image_mean[ch]);
    const auto stdev = static_cast<float>(c.image_std[ch]);
    float* o = out.data.data() + ch * plane;
    for (std::size_t i = 0; i < plane; ++i) {
      const std::uint8_t v = cur->rgb[i * 3 + ch];
      float x = c.do_rescale ? static_cast<float>(static_cast<double>(v) * c.rescale_factor)
                             : static_cast<float>(v);
      if (c.do_normalize) {
        x = (x - mean) / stdev;
      }
      o[i] = x;
    }
  }
  return out;
}

}  // namespace troupe::models
