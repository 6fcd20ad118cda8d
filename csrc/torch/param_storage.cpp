#include "torch/param_storage.h"

#include "core/errors.h"
#include "torch/dtype_map.h"

#include <c10/util/strides.h>

namespace gx::torch_layer {

ParamStorages::ParamStorages(ChunkManager& mgr, at::Device device) : mgr_(mgr), device_(device) {}

ParamStorages::~ParamStorages() { unbind_all(); }

c10::StorageImpl& ParamStorages::storage(ChunkId id) {
  auto it = storages_.find(id);
  if (it == storages_.end()) {
    const Chunk& c = mgr_.chunk(id);
    auto impl = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), 0,
                                                      at::DataPtr(nullptr, device_), /*allocator=*/nullptr,
                                                      /*resizable=*/false);
    it = storages_.emplace(id, impl).first;
    // The whole chunk's device memory: the device copy, or sharded the gathered buffer.
    if (void* ptr = mgr_.sharded() ? c.gathered_ptr() : c.shard_ptr(Tier::kDevice)) on_device_copy(id, ptr);
  }
  return *it->second;
}

at::Tensor ParamStorages::view(ChunkId id, size_t slot_index) {
  const Chunk& c = mgr_.chunk(id);
  const TensorSlot& s = c.slot(slot_index);
  c10::StorageImpl& impl = storage(id);
  auto options = at::TensorOptions().dtype(to_scalar_type(c.dtype())).device(device_);
  at::Tensor t = at::empty({0}, options);
  // set_ checks the view against the storage's size: give it the full size for the call.
  const size_t saved_nbytes = impl.nbytes();
  impl.set_nbytes(c.chunk_bytes());
  t.set_(c10::Storage(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(&impl)), s.offset_numel, s.shape,
         c10::contiguous_strides(s.shape));
  impl.set_nbytes(saved_nbytes);
  return t;
}

bool ParamStorages::bound(ChunkId id) const {
  auto it = storages_.find(id);
  return it != storages_.end() && it->second->data() != nullptr;
}

void ParamStorages::on_device_copy(ChunkId id, void* ptr) {
  auto it = storages_.find(id);
  if (it == storages_.end()) return;  // not a parameter chunk (grads, masters, states)
  c10::StorageImpl& impl = *it->second;
  if (ptr != nullptr) {
    impl.set_data_ptr_noswap(at::DataPtr(ptr, device_));
    impl.set_nbytes(mgr_.chunk(id).chunk_bytes());
  } else {
    impl.set_data_ptr_noswap(at::DataPtr(nullptr, device_));
    impl.set_nbytes(0);
  }
}

void ParamStorages::unbind_all() {
  for (auto& [id, impl] : storages_) {
    impl->set_data_ptr_noswap(at::DataPtr(nullptr, device_));
    impl->set_nbytes(0);
  }
}

}  // namespace gx::torch_layer
