#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "kernels/dtype.hpp"
#include "kernels/tensor.hpp"
#include "models/mapped_file.hpp"

namespace troupe::models {

/// GGUF metadata value types (gguf.h's gguf_type).
enum class gguf_type : std::uint32_t {
  u8 = 0,
  i8 = 1,
  u16 = 2,
  i16 = 3,
  u32 = 4,
  i32 = 5,
  f32 = 6,
  boolean = 7,
  string = 8,
  array = 9,
  u64 = 10,
  i64 = 11,
  f64 = 12,
};

/// An array value: element type plus the elements (numbers widened).
struct gguf_array {
  gguf_type type = gguf_type::u8;
  std::vector<std::int64_t> ints;    ///< integer and bool element types
  std::vector<std::uint64_t> u64s;   ///< u64 elements (exact)
  std::vector<double> floats;        ///< f32 and f64 element types
  std::vector<std::string> strings;  ///< string elements
  std::size_t size() const;
};

/// One metadata value.
struct gguf_value {
  gguf_type type = gguf_type::u8;
  std::variant<std::int64_t, std::uint64_t, double, bool, std::string, gguf_array> value;

  std::optional<std::int64_t> as_int() const;
  std::optional<double> as_float() const;
  const std::string* as_string() const;
  const gguf_array* as_array() const;
};

/// A tensor described in the file's header.
struct gguf_tensor_info {
  std::string name;
  kernels::dtype type = kernels::dtype::f32;
  std::uint32_t ggml_type = 0;
  /// Extents as GGUF stores them: innermost first (ggml's ne[]).
  std::vector<std::int64_t> ne;
  std::uint64_t offset = 0;  ///< from the start of the data section
  std::uint64_t bytes = 0;
  /// Shape outermost first (PyTorch order), as kernels::shape_t wants.
  kernels::shape_t shape() const;
};

/// Limits applied while parsing untrusted files.
struct gguf_limits {
  std::uint64_t max_tensors = 65536;
  std::uint64_t max_kv = 65536;
  std::uint64_t max_string_bytes = 1 << 20;
  std::uint64_t max_array_elems = 1 << 24;
};

/// A parsed, validated GGUF file (v2 or v3), memory-mapped. Construction
/// validates everything before any tensor is used: header against file size,
/// counts against limits, strings and arrays in bounds, known value and
/// tensor types, overflow-safe sizes, tensors inside the data section, aligned
/// and non-overlapping, no duplicate names or keys.
class gguf_file {
 public:
  static result<gguf_file> open(const std::string& path, const gguf_limits& limits = {});
  static result<gguf_file> parse(std::shared_ptr<mapped_file> file, const gguf_limits& limits = {});

  std::uint32_t version() const { return version_; }
  std::uint64_t alignment() const { return alignment_; }
  const std::map<std::string, gguf_value>& metadata() const { return kv_; }
  const std::vector<gguf_tensor_info>& tensors() const { return tensors_; }
  const gguf_value* find(const std::string& key) const;
  const gguf_tensor_info* find_tensor(const std::string& name) const;
  /// A zero-copy view of a tensor's bytes in the map (valid while this
  /// object or the returned tensor's source map lives).
  result<kernels::tensor> view(const gguf_tensor_info& info) const;
  const std::string& path() const { return file_->path(); }

 private:
  std::shared_ptr<mapped_file> file_;
  std::uint32_t version_ = 0;
  std::uint64_t alignment_ = 32;
  std::uint64_t data_offset_ = 0;
  std::map<std::string, gguf_value> kv_;
  std::vector<gguf_tensor_info> tensors_;
  std::map<std::string, std::size_t> tensor_index_;
};

/// Writes GGUF v3 files (metadata, then tensors, 32-byte aligned).
class gguf_writer {
 public:
  void set(const std::string& key, gguf_value value);
  void set_u32(const std::string& key, std::uint32_t v);
  void set_i32(const std::string& key, std::int32_t v);
  void set_u64(const std::string& key, std::uint64_t v);
  void set_f32(const std::string& key, float v);
  void set_bool(const std::string& key, bool v);
  void set_string(const std::string& key, std::string v);
  void set_strings(const std::string& key, std::vector<std::string> v);
  void set_i32s(const std::string& key, const std::vector<std::int32_t>& v);
  void set_f32s(const std::string& key, const std::vector<float>& v);
  /// Adds a tensor; `shape` outermost first; `data` must hold exactly the
  /// tensor's bytes and stay alive until write().
  result<void> add_tensor(const std::string& name, kernels::dtype type,
                          const kernels::shape_t& shape, std::span<const std::byte> data);
  result<void> write(const std::string& path) const;

 private:
  struct pending {
    std::string name;
    kernels::dtype type;
    std::vector<std::int64_t> ne;
    std::span<const std::byte> data;
  };
  std::vector<std::pair<std::string, gguf_value>> kv_;
  std::vector<pending> tensors_;
};

/// ggml type id <-> kernels dtype (F32, F16, BF16, Q8_0, Q4_0).
std::optional<kernels::dtype> dtype_from_ggml(std::uint32_t ggml_type);
std::optional<std::uint32_t> ggml_from_dtype(kernels::dtype t);

}  // namespace troupe::models
