#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kernels/tensor.hpp"
#include "models/mapped_file.hpp"

namespace troupe::models {

/// One tensor of a safetensors checkpoint.
struct safetensors_tensor {
  std::string name;
  kernels::dtype type = kernels::dtype::f32;
  kernels::shape_t shape;
  std::uint64_t offset = 0;  ///< absolute offset in its file
  std::uint64_t bytes = 0;
  std::size_t file = 0;  ///< index into files()
};

/// Limits applied while parsing untrusted headers.
struct safetensors_limits {
  std::uint64_t max_header_bytes = 100u << 20;
  std::size_t max_tensors = 1 << 20;
};

/// A safetensors checkpoint: one file, or the shards named by a
/// `model.safetensors.index.json`, memory-mapped. Every header is validated
/// before use: header length against the file size, JSON well-formed,
/// known dtypes (F32, F16, BF16), shapes non-negative and overflow-free,
/// byte ranges equal to dtype × shape, inside the data section and not
/// overlapping, unique names, and every index entry present in its shard.
class safetensors_model {
 public:
  /// `path`: a .safetensors file, an index .json, or a directory holding
  /// model.safetensors.index.json or model.safetensors.
  static result<safetensors_model> open(const std::string& path,
                                        const safetensors_limits& limits = {});

  const std::vector<safetensors_tensor>& tensors() const { return tensors_; }
  /// Parses one in-memory or mapped file (no index).
  static result<safetensors_model> parse(std::shared_ptr<mapped_file> file,
                                         const safetensors_limits& limits = {});

  const safetensors_tensor* find(const std::string& name) const;
  /// Zero-copy view into the map.
  result<kernels::tensor> view(const safetensors_tensor& t) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::vector<std::shared_ptr<mapped_file>>& files() const { return files_; }

 private:
  result<void> add_file(std::shared_ptr<mapped_file> file, const safetensors_limits& limits,
                        const std::map<std::string, std::string>* expected_owner);
  std::vector<std::shared_ptr<mapped_file>> files_;
  std::vector<safetensors_tensor> tensors_;
  std::map<std::string, std::size_t> index_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace troupe::models
