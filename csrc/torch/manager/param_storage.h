// ParamStorages: one torch storage per parameter chunk, bound to wherever the chunk's whole value
// can be read from the compute device.
//
// Design note (the storage-resize idiom, as FSDP2 uses it). Every parameter managed by the engine
// stays the same Python object; its `.data` becomes, once, a view into a StorageImpl that this
// class owns for the parameter's chunk. The parameter and every tensor autograd saved from it
// share that StorageImpl, so they all follow the chunk, at whatever address the pool gives it;
// nothing changes a parameter's dtype or device behind autograd's back. The data pointers are not
// owned: the ChunkManager's pool owns the memory and tells this listener after every change.
//
// Where a storage points (rebind), first match:
//   kDevice  the chunk's device copy (unsharded) or its gathered buffer (sharded): the hooks'
//            state while a module computes, and a resident chunk's between steps.
//   kHost    unsharded, no device copy: the chunk's host copy, at the address the device reads
//            it under (sim: the same memory; cuda: mapped page-locked memory, read over PCIe).
//            A parameter touched between steps is served its current value instead of nothing.
//   kNone    an optimizer step of the chunk still running on the CPU after step() returned
//            (overlap_optimizer: no copy holds the new value yet, and the old one is stale),
//            sharded and not gathered (this rank holds a shard only), pageable host memory on
//            cuda, or the engine closed: the storage keeps its size and any access to its data
//            raises a RuntimeError naming the chunk's parameters and the fix (torch's
//            data-pointer access check), never a read of stale, freed or foreign memory.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/StorageImpl.h>

#include <map>
#include <string>
#include <vector>

#include "core/chunk_manager.h"

namespace gx::torch_layer {

enum class StorageBinding { kDevice, kHost, kNone };

class ParamStorages final : public ResidencyListener {
 public:
  ParamStorages(ChunkManager& mgr, at::Device device);
  ~ParamStorages() override;

  // Creates the storage of chunk `id` (once) and returns a view of the tensor in `slot_index`.
  at::Tensor view(ChunkId id, size_t slot_index);
  StorageBinding binding(ChunkId id) const;  // kNone for a chunk without a storage
  void on_residency_change(ChunkId id) override;
  // The chunk's values are being replaced by a CPU optimizer step (pending) or are settled.
  void set_stepping(ChunkId id, bool stepping);
  void unbind_all();  // every storage raises on access from now on (the engine is closing)

 private:
  struct Entry {
    c10::intrusive_ptr<c10::StorageImpl> impl;
    StorageBinding binding = StorageBinding::kNone;
    bool stepping = false;
  };
  Entry& entry(ChunkId id);
  void rebind(ChunkId id, Entry& e);
  void bind(Entry& e, ChunkId id, void* ptr, StorageBinding binding);
  void refuse(Entry& e, ChunkId id, const std::string& why, const std::string& fix);
  std::string parameter_names(ChunkId id) const;

  ChunkManager& mgr_;
  at::Device device_;
  std::map<ChunkId, Entry> storages_;
};

}  // namespace gx::torch_layer
