#include "torch/manager/param_storage.h"

#include <ATen/ops/empty.h>

#include "core/errors.h"
#include "torch/dtype_map.h"

#include <c10/util/strides.h>

namespace gx::torch_layer {
namespace {

// Lifting a storage's access error. torch 2.13 has clear_data_ptr_access_error_msg_(); older
// versions (2.11) set the error (release_data_and_set_meta_custom_data_ptr_error_msg_) but have
// no public way to clear it, so there the flag and its cached check are reached through an
// explicit instantiation, which C++ exempts from access checks ([temp.spec.general]). Both
// members exist in every torch this builds against; a rename would fail to compile, not misbehave.
template <typename Tag, typename Tag::type Member>
struct PrivateMember {
  friend typename Tag::type private_member(Tag) { return Member; }
};
struct ThrowOnDataPtr {
  using type = bool c10::StorageImpl::*;
  friend type private_member(ThrowOnDataPtr);
};
struct RefreshDataPtrCheck {
  using type = void (c10::StorageImpl::*)();
  friend type private_member(RefreshDataPtrCheck);
};
template struct PrivateMember<ThrowOnDataPtr, &c10::StorageImpl::throw_on_immutable_data_ptr_>;
template struct PrivateMember<RefreshDataPtrCheck, &c10::StorageImpl::refresh_has_data_ptr_check>;

template <typename Impl>
auto clear_access_error(Impl& impl, int) -> decltype(impl.clear_data_ptr_access_error_msg_()) {
  impl.clear_data_ptr_access_error_msg_();
}

template <typename Impl>
void clear_access_error(Impl& impl, long) {
  impl.*private_member(ThrowOnDataPtr{}) = false;
  (impl.*private_member(RefreshDataPtrCheck{}))();
}

// Lifts the access error of a storage and gives it `data`.
void lift_access_error(c10::StorageImpl& impl, at::DataPtr&& data) {
  clear_access_error(impl, 0);
  impl.set_data_ptr_noswap(std::move(data));
}

}  // namespace

ParamStorages::ParamStorages(ChunkManager& mgr, at::Device device) : mgr_(mgr), device_(device) {}

ParamStorages::~ParamStorages() { unbind_all(); }

ParamStorages::Entry& ParamStorages::entry(ChunkId id) {
  auto it = storages_.find(id);
  if (it == storages_.end()) {
    const Chunk& c = mgr_.chunk(id);
    Entry e;
    e.impl = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), c.chunk_bytes(),
                                                   at::DataPtr(nullptr, device_), /*allocator=*/nullptr,
                                                   /*resizable=*/false);
    it = storages_.emplace(id, std::move(e)).first;
    rebind(id, it->second);
  }
  return it->second;
}

at::Tensor ParamStorages::view(ChunkId id, size_t slot_index) {
  const Chunk& c = mgr_.chunk(id);
  const TensorSlot& s = c.slot(slot_index);
  Entry& e = entry(id);
  auto options = at::TensorOptions().dtype(to_scalar_type(c.dtype())).device(device_);
  at::Tensor t = at::empty({0}, options);
  // The storage always has the chunk's size; set_ reads its data pointer, which a refusing
  // storage does not give out, so the refusal is lifted for the call and set again after.
  const bool refusing = e.binding == StorageBinding::kNone;
  if (refusing) lift_access_error(*e.impl, at::DataPtr(nullptr, device_));
  t.set_(c10::Storage(e.impl), s.offset_numel, s.shape, c10::contiguous_strides(s.shape));
  if (refusing) rebind(id, e);
  return t;
}

StorageBinding ParamStorages::binding(ChunkId id) const {
  auto it = storages_.find(id);
  return it == storages_.end() ? StorageBinding::kNone : it->second.binding;
}

void ParamStorages::on_residency_change(ChunkId id) {
  auto it = storages_.find(id);
  if (it == storages_.end()) return;  // not a parameter chunk (grads, masters, states)
  rebind(id, it->second);
}

namespace {
const char* const kGatheredFix =
    "Inside `with engine.gathered([params], writable=...):` parameters are whole and current on every rank; "
    "engine.state_dict() / model.state_dict() read every value.";
}  // namespace

void ParamStorages::set_stepping(ChunkId id, bool stepping) {
  auto it = storages_.find(id);
  if (it == storages_.end() || it->second.stepping == stepping) return;
  it->second.stepping = stepping;
  rebind(id, it->second);
}

void ParamStorages::rebind(ChunkId id, Entry& e) {
  const Chunk& c = mgr_.chunk(id);
  if (e.stepping) {
    return refuse(e, id, "is being stepped by the CPU optimizer, which optimizer.step() left running "
                         "(overlap_optimizer)",
                  "Call engine.synchronize() after optimizer.step() before touching parameters (the next forward, "
                  "engine.state_dict() and engine.gathered() wait by themselves), or set overlap_optimizer=False.");
  }
  if (mgr_.sharded()) {
    if (void* ptr = c.gathered_ptr()) return bind(e, id, ptr, StorageBinding::kDevice);
    return refuse(e, id,
                  "is sharded over " + std::to_string(mgr_.world_size()) +
                      " ranks and not gathered on this one outside the engine's hooks",
                  kGatheredFix);
  }
  if (void* ptr = c.shard_ptr(Tier::kDevice)) return bind(e, id, ptr, StorageBinding::kDevice);
  for (Tier tier : {Tier::kPinnedHost, Tier::kPageableHost}) {
    void* host = c.shard_ptr(tier);
    if (host == nullptr) continue;
    if (void* ptr = mgr_.backend().device_address_of_host(host)) return bind(e, id, ptr, StorageBinding::kHost);
    return refuse(e, id, "is in pageable host memory (pin_memory=False), which the device cannot read",
                  kGatheredFix);
  }
  refuse(e, id, "has no copy this rank can read", kGatheredFix);
}

void ParamStorages::bind(Entry& e, ChunkId id, void* ptr, StorageBinding binding) {
  c10::StorageImpl& impl = *e.impl;
  impl.set_nbytes(mgr_.chunk(id).chunk_bytes());
  if (e.binding == StorageBinding::kNone) {
    lift_access_error(impl, at::DataPtr(ptr, device_));
  } else {
    impl.set_data_ptr_noswap(at::DataPtr(ptr, device_));
  }
  e.binding = binding;
}

void ParamStorages::refuse(Entry& e, ChunkId id, const std::string& why, const std::string& fix) {
  e.impl->set_data_ptr_noswap(at::DataPtr(nullptr, device_));
  e.impl->release_data_and_set_meta_custom_data_ptr_error_msg_(
      "gemini_ext: the value of " + parameter_names(id) + " cannot be read or written here: its chunk (" +
      std::to_string(id) + ") " + why + ". " + fix);
  e.binding = StorageBinding::kNone;
}

std::string ParamStorages::parameter_names(ChunkId id) const {
  const Chunk& c = mgr_.chunk(id);
  const size_t shown = std::min<size_t>(c.num_slots(), 3);
  std::string out = c.num_slots() == 1 ? "parameter " : "a parameter among ";
  for (size_t i = 0; i < shown; ++i) out += (i ? ", '" : "'") + c.slot(i).name + "'";
  if (c.num_slots() > shown) out += " and " + std::to_string(c.num_slots() - shown) + " more";
  return out;
}

void ParamStorages::unbind_all() {
  for (auto& [id, e] : storages_) {
    e.impl->set_data_ptr_noswap(at::DataPtr(nullptr, device_));
    e.impl->release_data_and_set_meta_custom_data_ptr_error_msg_(
        "gemini_ext: this tensor is a view of a chunk of a closed engine (a tensor autograd saved, or a "
        "parameter's old .data); its memory is gone. Parameters themselves hold their values after close().");
    e.binding = StorageBinding::kNone;
  }
}

}  // namespace gx::torch_layer
