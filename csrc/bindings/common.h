// The helpers of the areas that bind tensors and chunks: tier names, statistics as dicts, the
// Python-side ChunkManager, and the one conversion helper for plain structs (fields listed once).
#pragma once

#include <torch/csrc/utils/pybind.h>  // pybind11 with the casters of at::Tensor, dtype and device

#include <memory>
#include <string>
#include <utility>

#include "core/chunk_manager.h"
#include "core/errors.h"
#include "bindings/areas.h"
#include "torch/chunk_views.h"

// Hidden like pybind11's own types (the module is built with hidden visibility for them).
namespace gx {
namespace bindings __attribute__((visibility("hidden"))) {

namespace py = pybind11;

Tier parse_tier(const std::string& name);
py::dict stat_dict(const Stat& s);

// A ChunkManager together with the DeviceContext it runs on (the context must outlive it).
struct PyChunkManager {
  std::shared_ptr<torch_layer::DeviceContext> ctx;
  std::shared_ptr<Communicator> comm;  // declared before mgr: outlives it
  std::unique_ptr<ChunkManager> mgr;
};

// A struct as a dict: as_dict(s, field("name", &S::name), ...).
template <class S, class T>
std::pair<const char*, T S::*> field(const char* name, T S::* member) {
  return {name, member};
}
template <class S, class... T>
py::dict as_dict(const S& s, std::pair<const char*, T S::*>... fields) {
  py::dict d;
  ((d[fields.first] = s.*(fields.second)), ...);
  return d;
}

}  // namespace bindings
}  // namespace gx
