// Writing safetensors files (format in core/io/safetensors.h). The JSON header is padded with
// spaces so the data section starts 8-byte aligned, and tensors are laid out largest element
// size first, then by name (Python's safetensors orders them the same way for the same reason):
// every tensor then starts aligned to its element size, and the bytes are deterministic.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/base/tensor.h"

namespace moetrain {

class OutputFile;

class SafetensorsWriter {
 public:
  // Adds a CPU tensor. Only the view is kept: its memory must stay valid until write().
  // Names must be unique and not "__metadata__" (both asserted: they are programming errors).
  void add(const std::string& name, const TensorView& tensor);
  // Adds or replaces one "__metadata__" entry.
  void set_metadata(const std::string& key, const std::string& value);
  size_t size() const { return tensors_.size(); }

  // Writes the file at `path`, replacing any file there. Errors (disk full, permissions) throw
  // Error(kBadCheckpoint) naming the path.
  void write(const std::string& path) const;
  // Writes `path`.tmp, fsyncs it, renames it to `path` and fsyncs the directory: a reader (or a
  // crash) sees either the previous file or the complete new one, never a partial one.
  void write_atomic(const std::string& path) const;

 private:
  void write_to(const std::string& path, bool sync) const;

  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// A safetensors file written tensor by tensor, for outputs larger than the host's memory (the
// merged export): the tensors' names, dtypes and shapes are declared up front, the header is
// written at once, then each tensor's bytes in file order (order()). The layout is
// SafetensorsWriter's, so the same tensors give the same bytes either way.
class SafetensorsStreamWriter {
 public:
  struct Declared {
    std::string name;
    DType dtype = DType::kF32;
    Shape shape;
  };
  // Creates (or truncates) `path` and writes the header. Errors as SafetensorsWriter::write.
  SafetensorsStreamWriter(const std::string& path, const std::vector<Declared>& tensors,
                          const std::map<std::string, std::string>& metadata);
  ~SafetensorsStreamWriter();
  // The names in the order write_next() takes them.
  const std::vector<std::string>& order() const { return order_; }
  // The next tensor's values: its name, dtype and shape must be the declared ones (asserted).
  void write_next(const std::string& name, const TensorView& value);
  // After the last tensor: fsync and close (Error(kBadCheckpoint) naming the path on failure).
  void finish();

 private:
  std::vector<std::string> order_;
  std::map<std::string, Declared> declared_;
  size_t next_ = 0;
  std::unique_ptr<OutputFile> out_;
};

}  // namespace moetrain
