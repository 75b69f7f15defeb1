// Writing safetensors files (format in core/io/safetensors.h). The JSON header is padded with
// spaces so the data section starts 8-byte aligned, and tensors are laid out largest element
// size first, then by name (Python's safetensors orders them the same way for the same reason):
// every tensor then starts aligned to its element size, and the bytes are deterministic.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/base/tensor.h"

namespace moetrain {

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

}  // namespace moetrain
