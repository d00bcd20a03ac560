#include "models/gguf.hpp"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>
#include <utility>

namespace troupe::models {

using kernels::dtype;

namespace {

constexpr std::uint32_t gguf_magic = 0x46554747;  // "GGUF" little endian
constexpr std::uint32_t max_dims = 4;

// ggml_type ids (ggml.h)
constexpr std::uint32_t ggml_f32 = 0, ggml_f16 = 1, ggml_q4_0 = 2, ggml_q4_1 = 3, ggml_q5_0 = 6,
                        ggml_q5_1 = 7, ggml_q8_0 = 8, ggml_q2_k = 10, ggml_q3_k = 11,
                        ggml_q4_k = 12, ggml_q5_k = 13, ggml_q6_k = 14, ggml_iq4_nl = 20,
                        ggml_iq4_xs = 23, ggml_bf16 = 30;

// ggml type id <-> dtype, for every type troupe reads.
constexpr std::pair<std::uint32_t, dtype> ggml_types[] = {
    {ggml_f32, dtype::f32},   {ggml_f16, dtype::f16},       {ggml_bf16, dtype::bf16},
    {ggml_q8_0, dtype::q8_0}, {ggml_q4_0, dtype::q4_0},     {ggml_q4_1, dtype::q4_1},
    {ggml_q5_0, dtype::q5_0}, {ggml_q5_1, dtype::q5_1},     {ggml_q2_k, dtype::q2_k},
    {ggml_q3_k, dtype::q3_k}, {ggml_q4_k, dtype::q4_k},     {ggml_q5_k, dtype::q5_k},
    {ggml_q6_k, dtype::q6_k}, {ggml_iq4_nl, dtype::iq4_nl}, {ggml_iq4_xs, dtype::iq4_xs}};

std::string fail_at(const std::string& path, std::size_t off, const std::string& what) {
  return path + ": offset " + std::to_string(off) + ": " + what;
}

bool known_type(std::uint32_t t) {
  return t <= static_cast<std::uint32_t>(gguf_type::f64);
}

std::size_t scalar_size(gguf_type t) {
  switch (t) {
    case gguf_type::u8:
    case gguf_type::i8:
    case gguf_type::boolean:
      return 1;
    case gguf_type::u16:
    case gguf_type::i16:
      return 2;
    case gguf_type::u32:
    case gguf_type::i32:
    case gguf_type::f32:
      return 4;
    case gguf_type::u64:
    case gguf_type::i64:
    case gguf_type::f64:
      return 8;
    default:
      return 0;
  }
}

// Parser state: reader + path + limits, every failure a message.
struct parser {
  byte_reader r;
  const std::string& path;
  const gguf_limits& lim;

  result<std::string> str(const char* what) {
    const std::size_t at = r.offset();
    std::uint64_t n = 0;
    if (!r.read_value(n))
      return make_error(errc::corrupt_data,
                        fail_at(path, at, std::string(what) + ": truncated string length"));
    if (n > lim.max_string_bytes)
      return make_error(errc::corrupt_data,
                        fail_at(path, at,
                                std::string(what) + ": string of " + std::to_string(n) +
                                    " bytes exceeds the limit"));
    if (n > r.remaining())
      return make_error(
          errc::corrupt_data,
          fail_at(path, at, std::string(what) + ": string runs past the end of the file"));
    std::string s(n, '\0');
    r.read(s.data(), n);
    return s;
  }

  result<gguf_value> scalar(gguf_type t, const std::string& key) {
    gguf_value v;
    v.type = t;
    const std::size_t at = r.offset();
    auto trunc = [&] {
      return make_error(errc::corrupt_data, fail_at(path, at, "value of '" + key + "' truncated"));
    };
    switch (t) {
      case gguf_type::u8: {
        std::uint8_t x;
        if (!r.read_value(x)) return trunc();
        v.value = std::int64_t(x);
        break;
      }
      case gguf_type::i8: {
        std::int8_t x;
        if (!r.read_value(x)) return trunc();
        v.value = std::int64_t(x);
        break;
      }
      case gguf_type::u16: {
        std::uint16_t x;
        if (!r.read_value(x)) return trunc();
        v.value = std::int64_t(x);
        break;
      }
      case gguf_type::i16: {
        std::int16_t x;
        if (!r.read_value(x)) return trunc();
        v.value = std::int64_t(x);
        break;
      }
      case gguf_type::u32: {
        std::uint32_t x;
        if (!r.read_value(x)) return trunc();
        v.value = std::int64_t(x);
        break;
      }
      case gguf_type::i32: {
        std::int32_t x;
        if (!r.read_value(x)) return trunc();
        v.value = std::int64_t(x);
        break;
      }
      case gguf_type::u64: {
        std::uint64_t x;
        if (!r.read_value(x)) return trunc();
        v.value = x;
        break;
      }
      case gguf_type::i64: {
        std::int64_t x;
        if (!r.read_value(x)) return trunc();
        v.value = x;
        break;
      }
      case gguf_type::f32: {
        float x;
        if (!r.read_value(x)) return trunc();
        v.value = double(x);
        break;
      }
      case gguf_type::f64: {
        double x;
        if (!r.read_value(x)) return trunc();
        v.value = x;
        break;
      }
      case gguf_type::boolean: {
        std::uint8_t x;
        if (!r.read_value(x)) return trunc();
        if (x > 1)
          return make_error(
              errc::corrupt_data,
              fail_at(path, at, "bool value of '" + key + "' is " + std::to_string(x)));
        v.value = x == 1;
        break;
      }
      case gguf_type::string: {
        auto s = str(key.c_str());
        if (!s) return std::unexpected(s.error());
        v.value = std::move(*s);
        break;
      }
      case gguf_type::array:
        return make_error(errc::corrupt_data, fail_at(path, at, "nested array in '" + key + "'"));
    }
    return v;
  }

  result<gguf_value> value(gguf_type t, const std::string& key) {
    if (t != gguf_type::array) return scalar(t, key);
    const std::size_t at = r.offset();
    std::uint32_t et = 0;
    std::uint64_t n = 0;
    if (!r.read_value(et) || !r.read_value(n))
      return make_error(errc::corrupt_data,
                        fail_at(path, at, "array header of '" + key + "' truncated"));
    if (!known_type(et) || static_cast<gguf_type>(et) == gguf_type::array)
      return make_error(
          errc::corrupt_data,
          fail_at(path, at, "array '" + key + "' has unknown element type " + std::to_string(et)));
    if (n > lim.max_array_elems)
      return make_error(errc::corrupt_data, fail_at(path, at,
                                                    "array '" + key + "' has " + std::to_string(n) +
                                                        " elements, over the limit"));
    const auto etype = static_cast<gguf_type>(et);
    // Each element needs at least its fixed size (8 for a string length):
    // reject impossible counts before allocating.
    const std::size_t min_elem = etype == gguf_type::string ? 8 : scalar_size(etype);
    if (n > r.remaining() / min_elem)
      return make_error(errc::corrupt_data,
                        fail_at(path, at, "array '" + key + "' runs past the end of the file"));
    gguf_array arr;
    arr.type = etype;
    for (std::uint64_t i = 0; i < n; ++i) {
      auto e = scalar(etype, key);
      if (!e) return std::unexpected(e.error());
      if (auto* s = std::get_if<std::string>(&e->value))
        arr.strings.push_back(std::move(*s));
      else if (auto* d = std::get_if<double>(&e->value))
        arr.floats.push_back(*d);
      else if (auto* u = std::get_if<std::uint64_t>(&e->value))
        arr.u64s.push_back(*u);
      else if (auto* b = std::get_if<bool>(&e->value))
        arr.ints.push_back(*b ? 1 : 0);
      else
        arr.ints.push_back(std::get<std::int64_t>(e->value));
    }
    gguf_value v;
    v.type = gguf_type::array;
    v.value = std::move(arr);
    return v;
  }
};

}  // namespace

std::size_t gguf_array::size() const {
  return ints.size() + u64s.size() + floats.size() + strings.size();
}

std::optional<std::int64_t> gguf_value::as_int() const {
  if (auto* i = std::get_if<std::int64_t>(&value)) return *i;
  if (auto* u = std::get_if<std::uint64_t>(&value);
      u && *u <= std::uint64_t(std::numeric_limits<std::int64_t>::max()))
    return static_cast<std::int64_t>(*u);
  if (auto* b = std::get_if<bool>(&value)) return *b ? 1 : 0;
  return std::nullopt;
}

std::optional<double> gguf_value::as_float() const {
  if (auto* d = std::get_if<double>(&value)) return *d;
  if (auto i = as_int()) return static_cast<double>(*i);
  return std::nullopt;
}

const std::string* gguf_value::as_string() const {
  return std::get_if<std::string>(&value);
}
const gguf_array* gguf_value::as_array() const {
  return std::get_if<gguf_array>(&value);
}

kernels::shape_t gguf_tensor_info::shape() const {
  kernels::shape_t s;
  s.ndim = static_cast<int>(ne.size());
  for (std::size_t i = 0; i < ne.size(); ++i) s.dims[i] = ne[ne.size() - 1 - i];
  return s;
}

std::optional<dtype> dtype_from_ggml(std::uint32_t t) {
  for (const auto& [id, dt] : ggml_types)
    if (id == t) return dt;
  return std::nullopt;
}

std::optional<std::uint32_t> ggml_from_dtype(dtype t) {
  for (const auto& [id, dt] : ggml_types)
    if (dt == t) return id;
  return std::nullopt;
}

result<gguf_file> gguf_file::open(const std::string& path, const gguf_limits& limits) {
  auto f = mapped_file::open(path);
  if (!f) return std::unexpected(f.error());
  return parse(std::move(*f), limits);
}

result<gguf_file> gguf_file::parse(std::shared_ptr<mapped_file> file, const gguf_limits& limits) {
  const std::string& path = file->path();
  parser p{byte_reader(file->bytes()), path, limits};
  gguf_file out;
  out.file_ = file;
  std::uint32_t magic = 0;
  if (!p.r.read_value(magic) || magic != gguf_magic)
    return make_error(errc::corrupt_data, path + ": not a GGUF file (bad magic)");
  if (!p.r.read_value(out.version_))
    return make_error(errc::corrupt_data, path + ": truncated header");
  if (out.version_ != 2 && out.version_ != 3)
    return make_error(errc::corrupt_data, path + ": unsupported GGUF version " +
                                              std::to_string(out.version_) + " (2 and 3 are read)");
  std::uint64_t n_tensors = 0, n_kv = 0;
  if (!p.r.read_value(n_tensors) || !p.r.read_value(n_kv))
    return make_error(errc::corrupt_data, path + ": truncated header");
  if (n_tensors > limits.max_tensors)
    return make_error(errc::corrupt_data, path + ": header claims " + std::to_string(n_tensors) +
                                              " tensors (limit " +
                                              std::to_string(limits.max_tensors) + ")");
  if (n_kv > limits.max_kv)
    return make_error(errc::corrupt_data, path + ": header claims " + std::to_string(n_kv) +
                                              " metadata entries (limit " +
                                              std::to_string(limits.max_kv) + ")");

  for (std::uint64_t i = 0; i < n_kv; ++i) {
    const std::size_t at = p.r.offset();
    auto key = p.str("metadata key");
    if (!key) return std::unexpected(key.error());
    if (key->empty())
      return make_error(errc::corrupt_data, fail_at(path, at, "empty metadata key"));
    std::uint32_t t = 0;
    if (!p.r.read_value(t))
      return make_error(errc::corrupt_data, fail_at(path, at, "type of '" + *key + "' truncated"));
    if (!known_type(t))
      return make_error(
          errc::corrupt_data,
          fail_at(path, at, "'" + *key + "' has unknown value type " + std::to_string(t)));
    auto v = p.value(static_cast<gguf_type>(t), *key);
    if (!v) return std::unexpected(v.error());
    if (out.kv_.count(*key))
      return make_error(errc::corrupt_data,
                        fail_at(path, at, "duplicate metadata key '" + *key + "'"));
    out.kv_.emplace(std::move(*key), std::move(*v));
  }
  if (auto* a = out.find("general.alignment")) {
    auto v = a->as_int();
    if (!v || *v <= 0 || *v > (1 << 20) || (*v & (*v - 1)) != 0)
      return make_error(errc::corrupt_data,
                        path + ": general.alignment must be a power of two up to 1 MiB");
    out.alignment_ = static_cast<std::uint64_t>(*v);
  }

  for (std::uint64_t i = 0; i < n_tensors; ++i) {
    const std::size_t at = p.r.offset();
    gguf_tensor_info ti;
    auto name = p.str("tensor name");
    if (!name) return std::unexpected(name.error());
    ti.name = std::move(*name);
    if (ti.name.empty())
      return make_error(errc::corrupt_data, fail_at(path, at, "empty tensor name"));
    std::uint32_t nd = 0;
    if (!p.r.read_value(nd))
      return make_error(errc::corrupt_data,
                        fail_at(path, at, "tensor '" + ti.name + "' truncated"));
    if (nd == 0 || nd > max_dims)
      return make_error(errc::corrupt_data, fail_at(path, at,
                                                    "tensor '" + ti.name + "' has " +
                                                        std::to_string(nd) + " dimensions (1..4)"));
    std::uint64_t numel = 1;
    for (std::uint32_t d = 0; d < nd; ++d) {
      std::int64_t e = 0;
      if (!p.r.read_value(e))
        return make_error(errc::corrupt_data,
                          fail_at(path, at, "tensor '" + ti.name + "' truncated"));
      if (e <= 0 || e > (std::int64_t{1} << 40))
        return make_error(
            errc::corrupt_data,
            fail_at(path, at, "tensor '" + ti.name + "' has extent " + std::to_string(e)));
      if (numel > std::uint64_t(std::numeric_limits<std::int64_t>::max()) / std::uint64_t(e))
        return make_error(errc::corrupt_data,
                          fail_at(path, at, "tensor '" + ti.name + "' element count overflows"));
      numel *= std::uint64_t(e);
      ti.ne.push_back(e);
    }
    if (!p.r.read_value(ti.ggml_type) || !p.r.read_value(ti.offset))
      return make_error(errc::corrupt_data,
                        fail_at(path, at, "tensor '" + ti.name + "' truncated"));
    auto dt = dtype_from_ggml(ti.ggml_type);
    if (!dt)
      return make_error(
          errc::unsupported_dtype,
          fail_at(path, at,
                  "tensor '" + ti.name + "' has ggml type " + std::to_string(ti.ggml_type) +
                      ", which troupe does not read (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, "
                      "Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS)"));
    ti.type = *dt;
    auto rb = kernels::row_bytes(ti.type, ti.ne[0]);
    if (!rb)
      return make_error(errc::corrupt_data,
                        fail_at(path, at, "tensor '" + ti.name + "': " + rb.error().message));
    const std::uint64_t rows = numel / std::uint64_t(ti.ne[0]);
    if (rows > std::numeric_limits<std::uint64_t>::max() / *rb)
      return make_error(errc::corrupt_data,
                        fail_at(path, at, "tensor '" + ti.name + "' byte size overflows"));
    ti.bytes = rows * *rb;
    if (out.tensor_index_.count(ti.name))
      return make_error(errc::corrupt_data,
                        fail_at(path, at, "duplicate tensor name '" + ti.name + "'"));
    out.tensor_index_.emplace(ti.name, out.tensors_.size());
    out.tensors_.push_back(std::move(ti));
  }

  const std::uint64_t header_end = p.r.offset();
  out.data_offset_ = (header_end + out.alignment_ - 1) / out.alignment_ * out.alignment_;
  if (out.data_offset_ > file->size() && !out.tensors_.empty())
    return make_error(errc::corrupt_data, path + ": data section starts past the end of the file");
  const std::uint64_t data_size =
      file->size() > out.data_offset_ ? file->size() - out.data_offset_ : 0;
  // Bounds, alignment and overlap of every tensor.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> spans;
  for (const auto& t : out.tensors_) {
    if (t.offset % out.alignment_ != 0)
      return make_error(errc::corrupt_data, path + ": tensor '" + t.name + "' offset " +
                                                std::to_string(t.offset) + " is not aligned to " +
                                                std::to_string(out.alignment_));
    if (t.offset > data_size || t.bytes > data_size - t.offset)
      return make_error(errc::corrupt_data, path + ": tensor '" + t.name + "' (" +
                                                std::to_string(t.bytes) + " bytes at " +
                                                std::to_string(t.offset) +
                                                ") lies outside the file's data section of " +
                                                std::to_string(data_size) + " bytes");
    spans.emplace_back(t.offset, t.offset + t.bytes);
  }
  std::sort(spans.begin(), spans.end());
  for (std::size_t i = 1; i < spans.size(); ++i)
    if (spans[i].first < spans[i - 1].second)
      return make_error(errc::corrupt_data, path + ": tensors overlap at data offset " +
                                                std::to_string(spans[i].first));
  return out;
}

const gguf_value* gguf_file::find(const std::string& key) const {
  auto it = kv_.find(key);
  return it == kv_.end() ? nullptr : &it->second;
}

const gguf_tensor_info* gguf_file::find_tensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

result<kernels::tensor> gguf_file::view(const gguf_tensor_info& info) const {
  const auto* base = file_->bytes().data() + data_offset_ + info.offset;
  return kernels::tensor::view(const_cast<std::byte*>(base), info.type, info.shape());
}

// ----------------------------------------------------------------- writer

void gguf_writer::set(const std::string& key, gguf_value value) {
  for (auto& [k, v] : kv_)
    if (k == key) {
      v = std::move(value);
      return;
    }
  kv_.emplace_back(key, std::move(value));
}

void gguf_writer::set_u32(const std::string& k, std::uint32_t v) {
  set(k, {gguf_type::u32, std::int64_t(v)});
}
void gguf_writer::set_i32(const std::string& k, std::int32_t v) {
  set(k, {gguf_type::i32, std::int64_t(v)});
}
void gguf_writer::set_u64(const std::string& k, std::uint64_t v) {
  set(k, {gguf_type::u64, v});
}
void gguf_writer::set_f32(const std::string& k, float v) {
  set(k, {gguf_type::f32, double(v)});
}
void gguf_writer::set_bool(const std::string& k, bool v) {
  set(k, {gguf_type::boolean, v});
}
void gguf_writer::set_string(const std::string& k, std::string v) {
  set(k, {gguf_type::string, std::move(v)});
}
void gguf_writer::set_strings(const std::string& k, std::vector<std::string> v) {
  gguf_array a;
  a.type = gguf_type::string;
  a.strings = std::move(v);
  set(k, {gguf_type::array, std::move(a)});
}
void gguf_writer::set_i32s(const std::string& k, const std::vector<std::int32_t>& v) {
  gguf_array a;
  a.type = gguf_type::i32;
  a.ints.assign(v.begin(), v.end());
  set(k, {gguf_type::array, std::move(a)});
}
void gguf_writer::set_f32s(const std::string& k, const std::vector<float>& v) {
  gguf_array a;
  a.type = gguf_type::f32;
  a.floats.assign(v.begin(), v.end());
  set(k, {gguf_type::array, std::move(a)});
}

result<void> gguf_writer::add_tensor(const std::string& name, dtype type,
                                     const kernels::shape_t& shape,
                                     std::span<const std::byte> data) {
  if (!ggml_from_dtype(type))
    return make_error(errc::unsupported_dtype,
                      "GGUF cannot store dtype " + std::string(kernels::to_string(type)));
  if (shape.ndim < 1)
    return make_error(errc::invalid_argument,
                      "GGUF tensor '" + name + "' needs at least one dimension");
  for (const auto& t : tensors_)
    if (t.name == name)
      return make_error(errc::invalid_argument, "duplicate tensor '" + name + "'");
  auto rb = kernels::row_bytes(type, shape.inner());
  if (!rb) return std::unexpected(rb.error());
  if (static_cast<std::uint64_t>(shape.outer()) * *rb != data.size())
    return make_error(errc::shape_mismatch, "tensor '" + name +
                                                "': " + std::to_string(data.size()) +
                                                " bytes given for shape " + shape.to_string());
  pending p{name, type, {}, data};
  for (int i = shape.ndim - 1; i >= 0; --i) p.ne.push_back(shape[i]);
  tensors_.push_back(std::move(p));
  return {};
}

namespace {

struct out_buf {
  std::ofstream& f;
  std::uint64_t pos = 0;
  void raw(const void* p, std::size_t n) {
    f.write(static_cast<const char*>(p), static_cast<std::streamsize>(n));
    pos += n;
  }
  template <class T>
  void val(T v) {
    raw(&v, sizeof v);
  }
  void str(const std::string& s) {
    val<std::uint64_t>(s.size());
    raw(s.data(), s.size());
  }
  void scalar(gguf_type t, const gguf_value& v);
};

void out_buf::scalar(gguf_type t, const gguf_value& v) {
  const auto i = v.as_int().value_or(0);
  const auto d = v.as_float().value_or(0);
  switch (t) {
    case gguf_type::u8:
      val<std::uint8_t>(std::uint8_t(i));
      break;
    case gguf_type::i8:
      val<std::int8_t>(std::int8_t(i));
      break;
    case gguf_type::u16:
      val<std::uint16_t>(std::uint16_t(i));
      break;
    case gguf_type::i16:
      val<std::int16_t>(std::int16_t(i));
      break;
    case gguf_type::u32:
      val<std::uint32_t>(std::uint32_t(i));
      break;
    case gguf_type::i32:
      val<std::int32_t>(std::int32_t(i));
      break;
    case gguf_type::u64: {
      auto* u = std::get_if<std::uint64_t>(&v.value);
      val<std::uint64_t>(u ? *u : std::uint64_t(i));
      break;
    }
    case gguf_type::i64:
      val<std::int64_t>(i);
      break;
    case gguf_type::f32:
      val<float>(float(d));
      break;
    case gguf_type::f64:
      val<double>(d);
      break;
    case gguf_type::boolean:
      val<std::uint8_t>(i ? 1 : 0);
      break;
    case gguf_type::string:
      str(v.as_string() ? *v.as_string() : std::string());
      break;
    case gguf_type::array:
      break;
  }
}

}  // namespace

result<void> gguf_writer::write(const std::string& path) const {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return make_error(errc::io_error, path + ": cannot create");
  out_buf o{f};
  constexpr std::uint64_t align = 32;
  o.val<std::uint32_t>(gguf_magic);
  o.val<std::uint32_t>(3);
  o.val<std::uint64_t>(tensors_.size());
  o.val<std::uint64_t>(kv_.size());
  for (const auto& [k, v] : kv_) {
    o.str(k);
    o.val<std::uint32_t>(static_cast<std::uint32_t>(v.type));
    if (v.type != gguf_type::array) {
      o.scalar(v.type, v);
      continue;
    }
    const auto& a = *v.as_array();
    o.val<std::uint32_t>(static_cast<std::uint32_t>(a.type));
    o.val<std::uint64_t>(a.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      gguf_value e;
      e.type = a.type;
      if (a.type == gguf_type::string)
        e.value = a.strings[i];
      else if (a.type == gguf_type::f32 || a.type == gguf_type::f64)
        e.value = a.floats[i];
      else if (a.type == gguf_type::u64)
        e.value = a.u64s[i];
      else
        e.value = a.ints[i];
      o.scalar(a.type, e);
    }
  }
  std::uint64_t off = 0;
  std::vector<std::uint64_t> offsets;
  for (const auto& t : tensors_) {
    o.str(t.name);
    o.val<std::uint32_t>(static_cast<std::uint32_t>(t.ne.size()));
    for (auto e : t.ne) o.val<std::int64_t>(e);
    o.val<std::uint32_t>(*ggml_from_dtype(t.type));
    o.val<std::uint64_t>(off);
    offsets.push_back(off);
    off = (off + t.data.size() + align - 1) / align * align;
  }
  static const char zeros[align] = {};
  o.raw(zeros, (align - o.pos % align) % align);
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    o.raw(tensors_[i].data.data(), tensors_[i].data.size());
    o.raw(zeros, (align - tensors_[i].data.size() % align) % align);
  }
  f.flush();
  if (!f) return make_error(errc::io_error, path + ": write failed");
  return {};
}

}  // namespace troupe::models
