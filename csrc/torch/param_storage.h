// ParamStorages: one torch storage per parameter chunk, bound to the chunk's device copy
// (sharded: to its gathered buffer, which holds the whole chunk).
//
// Design note (the storage-resize idiom, as FSDP2 uses it). Every parameter managed by the engine
// stays the same Python object; its `.data` becomes, once, a view into a StorageImpl that this
// class owns for the parameter's chunk. When the chunk's device copy appears (fetch) the storage
// is pointed at it with its full size; when the copy goes away (eviction) the storage is emptied
// (null data, 0 bytes). The parameter and every tensor autograd saved from it share that
// StorageImpl, so they all see the chunk again after the next fetch, at whatever address the
// pool gave it; nothing changes a parameter's dtype or device behind autograd's back. The data
// pointers are not owned: the ChunkManager's pool owns the memory, and tells this listener.
// Using a parameter whose chunk is evicted is a bug of the hooks that must fetch it; the empty
// storage makes such a use fail loudly in torch's checks rather than read stale memory where
// torch checks sizes.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>

#include <map>
#include <vector>

#include "core/chunk_manager.h"

namespace gx::torch_layer {

class ParamStorages final : public ResidencyListener {
 public:
  ParamStorages(ChunkManager& mgr, at::Device device);
  ~ParamStorages() override;

  // Creates the storage of chunk `id` (once) and returns a view of the tensor in `slot_index`.
  at::Tensor view(ChunkId id, size_t slot_index);
  bool bound(ChunkId id) const;
  void on_device_copy(ChunkId id, void* ptr) override;
  void unbind_all();  // empties every storage (before the pools go away)

 private:
  c10::StorageImpl& storage(ChunkId id);
  ChunkManager& mgr_;
  at::Device device_;
  std::map<ChunkId, c10::intrusive_ptr<c10::StorageImpl>> storages_;
};

}  // namespace gx::torch_layer
