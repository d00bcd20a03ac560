#include "models/safetensors.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

namespace troupe::models {

using kernels::dtype;
using json = nlohmann::json;

namespace {

bool is_dir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}
bool exists(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0;
}
std::string dir_of(const std::string& p) {
  const auto s = p.rfind('/');
  return s == std::string::npos ? "." : p.substr(0, s);
}

result<dtype> st_dtype(const std::string& s, const std::string& where) {
  if (s == "F32") return dtype::f32;
  if (s == "F16") return dtype::f16;
  if (s == "BF16") return dtype::bf16;
  return make_error(errc::unsupported_dtype,
                    where + ": dtype " + s + " is not supported (F32, F16, BF16)");
}

result<json> parse_json(std::string_view text, const std::string& where) {
  json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return make_error(errc::corrupt_data, where + ": malformed JSON");
  return j;
}

}  // namespace

result<void> safetensors_model::add_file(std::shared_ptr<mapped_file> file,
                                         const safetensors_limits& limits,
                                         const std::map<std::string, std::string>* expected_owner) {
  const std::string& path = file->path();
  byte_reader r(file->bytes());
  std::uint64_t header_len = 0;
  if (!r.read_value(header_len))
    return make_error(errc::corrupt_data, path + ": shorter than the 8-byte header length");
  if (header_len > limits.max_header_bytes)
    return make_error(errc::corrupt_data, path + ": header length " + std::to_string(header_len) +
                                              " exceeds the limit");
  if (header_len > r.remaining())
    return make_error(errc::corrupt_data, path + ": header length " + std::to_string(header_len) +
                                              " runs past the end of the file (" +
                                              std::to_string(file->size()) + " bytes)");
  const auto* hdr = reinterpret_cast<const char*>(file->bytes().data() + 8);
  auto j = parse_json({hdr, header_len}, path + " header");
  if (!j) return std::unexpected(j.error());
  if (!j->is_object())
    return make_error(errc::corrupt_data, path + ": header is not a JSON object");
  const std::uint64_t data_begin = 8 + header_len;
  const std::uint64_t data_size = file->size() - data_begin;
  const std::size_t file_index = files_.size();
  std::vector<std::pair<std::uint64_t, std::uint64_t>> spans;
  for (const auto& [name, desc] : j->items()) {
    const std::string where = path + ": tensor '" + name + "'";
    if (name == "__metadata__") {
      if (!desc.is_object())
        return make_error(errc::corrupt_data, path + ": __metadata__ is not an object");
      for (const auto& [k, v] : desc.items()) {
        if (!v.is_string())
          return make_error(errc::corrupt_data, path + ": __metadata__." + k + " is not a string");
        metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    if (tensors_.size() >= limits.max_tensors)
      return make_error(errc::corrupt_data, path + ": too many tensors");
    if (!desc.is_object()) return make_error(errc::corrupt_data, where + " is not an object");
    auto dt_it = desc.find("dtype");
    auto sh_it = desc.find("shape");
    auto off_it = desc.find("data_offsets");
    if (dt_it == desc.end() || !dt_it->is_string())
      return make_error(errc::corrupt_data, where + ": missing dtype");
    if (sh_it == desc.end() || !sh_it->is_array())
      return make_error(errc::corrupt_data, where + ": missing shape");
    if (off_it == desc.end() || !off_it->is_array() || off_it->size() != 2)
      return make_error(errc::corrupt_data, where + ": data_offsets must be [begin, end]");
    safetensors_tensor t;
    t.name = name;
    t.file = file_index;
    auto dt = st_dtype(dt_it->get<std::string>(), where);
    if (!dt) return std::unexpected(dt.error());
    t.type = *dt;
    if (sh_it->size() > static_cast<std::size_t>(kernels::max_dims))
      return make_error(errc::corrupt_data,
                        where + ": rank " + std::to_string(sh_it->size()) + " above 4");
    std::uint64_t numel = 1;
    t.shape.ndim = static_cast<int>(sh_it->size());
    for (std::size_t i = 0; i < sh_it->size(); ++i) {
      const auto& e = (*sh_it)[i];
      if (!e.is_number_unsigned())
        return make_error(errc::corrupt_data,
                          where + ": shape entries must be non-negative integers");
      const auto v = e.get<std::uint64_t>();
      if (v > (std::uint64_t{1} << 40) || (v != 0 && numel > (std::uint64_t{1} << 50) / v))
        return make_error(errc::corrupt_data, where + ": shape overflows");
      numel *= v;
      t.shape.dims[i] = static_cast<std::int64_t>(v);
    }
    const auto& b = (*off_it)[0];
    const auto& e = (*off_it)[1];
    if (!b.is_number_unsigned() || !e.is_number_unsigned())
      return make_error(errc::corrupt_data, where + ": data_offsets must be non-negative integers");
    const auto begin = b.get<std::uint64_t>(), end = e.get<std::uint64_t>();
    if (end < begin || end > data_size)
      return make_error(errc::corrupt_data, where + ": bytes [" + std::to_string(begin) + ", " +
                                                std::to_string(end) +
                                                ") outside the data section of " +
                                                std::to_string(data_size) + " bytes");
    const std::uint64_t want = numel * kernels::block_bytes(t.type);
    if (end - begin != want)
      return make_error(errc::corrupt_data, where + ": " + std::to_string(end - begin) +
                                                " bytes for " + t.shape.to_string() + " " +
                                                std::string(kernels::to_string(t.type)) +
                                                " (expected " + std::to_string(want) + ")");
    t.offset = data_begin + begin;
    t.bytes = want;
    if (index_.count(name))
      return make_error(errc::corrupt_data, where + ": appears twice in the checkpoint");
    if (expected_owner) {
      auto it = expected_owner->find(name);
      if (it == expected_owner->end() || it->second != path)
        return make_error(errc::corrupt_data, where + ": not listed for this shard in the index");
    }
    spans.emplace_back(begin, end);
    index_.emplace(name, tensors_.size());
    tensors_.push_back(std::move(t));
  }
  std::sort(spans.begin(), spans.end());
  for (std::size_t i = 1; i < spans.size(); ++i)
    if (spans[i].first < spans[i - 1].second && spans[i].second > spans[i].first)
      return make_error(errc::corrupt_data, path + ": tensors overlap at data offset " +
                                                std::to_string(spans[i].first));
  files_.push_back(file);
  return {};
}

result<safetensors_model> safetensors_model::open(const std::string& path,
                                                  const safetensors_limits& limits) {
  std::string p = path;
  if (is_dir(p)) {
    if (exists(p + "/model.safetensors.index.json"))
      p += "/model.safetensors.index.json";
    else if (exists(p + "/model.safetensors"))
      p += "/model.safetensors";
    else
      return make_error(errc::not_found,
                        path + ": no model.safetensors or model.safetensors.index.json");
  }
  safetensors_model m;
  if (p.size() >= 5 && p.substr(p.size() - 5) == ".json") {
    std::ifstream in(p);
    if (!in) return make_error(errc::io_error, p + ": cannot open");
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string text = ss.str();
    if (text.size() > limits.max_header_bytes)
      return make_error(errc::corrupt_data, p + ": index too large");
    auto j = parse_json(text, p);
    if (!j) return std::unexpected(j.error());
    auto wm = j->find("weight_map");
    if (!j->is_object() || wm == j->end() || !wm->is_object())
      return make_error(errc::corrupt_data, p + ": missing weight_map object");
    std::map<std::string, std::string> owner;
    std::set<std::string> shards;
    for (const auto& [tensor_name, file] : wm->items()) {
      if (!file.is_string())
        return make_error(errc::corrupt_data,
                          p + ": weight_map['" + tensor_name + "'] is not a string");
      const auto f = file.get<std::string>();
      if (f.empty() || f.find('/') != std::string::npos || f.find("..") != std::string::npos)
        return make_error(errc::corrupt_data, p + ": weight_map['" + tensor_name + "'] names '" +
                                                  f + "', which is not a file beside the index");
      const std::string full = dir_of(p) + "/" + f;
      owner[tensor_name] = full;
      shards.insert(full);
    }
    for (const auto& s : shards) {
      auto f = mapped_file::open(s);
      if (!f) return std::unexpected(f.error());
      if (auto r = m.add_file(*f, limits, &owner); !r) return std::unexpected(r.error());
    }
    for (const auto& [name, file] : owner)
      if (!m.index_.count(name))
        return make_error(errc::corrupt_data, p + ": tensor '" + name + "' is listed for " + file +
                                                  " but not stored there");
    return m;
  }
  auto f = mapped_file::open(p);
  if (!f) return std::unexpected(f.error());
  if (auto r = m.add_file(*f, limits, nullptr); !r) return std::unexpected(r.error());
  return m;
}

result<safetensors_model> safetensors_model::parse(std::shared_ptr<mapped_file> file,
                                                   const safetensors_limits& limits) {
  safetensors_model m;
  if (auto r = m.add_file(std::move(file), limits, nullptr); !r) return std::unexpected(r.error());
  return m;
}

const safetensors_tensor* safetensors_model::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

result<kernels::tensor> safetensors_model::view(const safetensors_tensor& t) const {
  if (t.file >= files_.size())
    return make_error(errc::invalid_argument, "tensor from another checkpoint");
  const auto* base = files_[t.file]->bytes().data() + t.offset;
  return kernels::tensor::view(const_cast<std::byte*>(base), t.type, t.shape);
}

}  // namespace troupe::models
