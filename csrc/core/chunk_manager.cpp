#include "chunk_manager.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>

#include "errors.h"
#include "thread_pool.h"

namespace gx {

ChunkManager::ChunkManager(DeviceBackend& backend, ChunkManagerConfig config)
    : backend_(backend),
      config_(config),
      host_tier_(config.pin_memory && backend.host_memory_is_pinned() ? Tier::kPinnedHost : Tier::kPageableHost),
      allocator_({&backend.device_memory(), backend.host_memory_is_pinned() ? &backend.host_memory() : nullptr,
                  &pageable_host_}) {
  GX_CHECK(config.world_size >= 1, "world_size: expected >= 1, got ", config.world_size, ".");
  GX_CHECK(config.rank >= 0 && config.rank < config.world_size, "rank: expected in [0, ", config.world_size,
           "), got ", config.rank, ".");
  GX_CHECK(config.alignment_bytes >= 1 && (config.alignment_bytes & (config.alignment_bytes - 1)) == 0,
           "alignment_bytes: expected a power of two, got ", config.alignment_bytes, ".");
}

ChunkManager::~ChunkManager() {
  // Every async copy must finish before the slots it reads or writes go back to the pools.
  try {
    backend_.synchronize_all();
    for (auto& c : chunks_) {
      if (sharded() && c->gathered()) drop_gathered(*c);
      for (int t = 0; t < kNumTiers; ++t) {
        if (c->shard_tiers().contains(static_cast<Tier>(t))) drop_copy(*c, static_cast<Tier>(t));
      }
    }
  } catch (...) {
    // A destructor must not throw; the pools free their memory anyway.
  }
}

void ChunkManager::create_group(const std::string& group, DType dtype, int64_t chunk_size_numel, Tier home_tier,
                                int64_t alignment_numel) {
  GX_CHECK(!finalized_, "create_group('", group, "'): the ChunkManager is finalized; create groups before finalize().");
  GX_CHECK(groups_.count(group) == 0, "create_group: group '", group, "' already exists; use another name.");
  GX_CHECK(chunk_size_numel > 0, "chunk_size_numel of group '", group, "': expected > 0, got ", chunk_size_numel, ".");
  GX_CHECK(allocator_.has_tier(home_tier), "home tier of group '", group, "': ", to_string(home_tier),
           " is not available on the ", backend_.name(), " backend; use ", to_string(host_tier_), ".");
  GX_CHECK(alignment_numel >= 0, "alignment_numel of group '", group, "': expected >= 0, got ", alignment_numel, ".");
  if (alignment_numel == 0)
    alignment_numel = std::max<int64_t>(1, static_cast<int64_t>(config_.alignment_bytes / element_size_bytes(dtype)));
  GroupInfo info;
  info.name = group;
  info.dtype = dtype;
  info.chunk_size_numel = chunk_size_numel;
  info.alignment_numel = alignment_numel;
  info.home_tier = home_tier;
  groups_[group] = info;
}

TensorHandle ChunkManager::register_tensor(const std::string& group, const std::string& name, int64_t numel,
                                           const std::vector<int64_t>& shape) {
  GX_CHECK(!finalized_, "register_tensor('", name, "'): the ChunkManager is finalized; register every tensor first.");
  auto it = groups_.find(group);
  GX_CHECK(it != groups_.end(), "register_tensor('", name, "'): unknown group '", group, "'; call create_group first.");
  GroupInfo& g = it->second;
  const int64_t alignment_numel = g.alignment_numel;

  if (g.open_chunk >= 0) {
    Chunk& open = *chunks_[static_cast<size_t>(g.open_chunk)];
    if (auto slot = open.try_append(name, numel, shape)) return TensorHandle{open.id(), *slot};
    if (numel <= g.chunk_size_numel) {  // the next regular chunk replaces the full one
      open.close();
      g.open_chunk = -1;
    }
  }
  const ChunkId id = static_cast<ChunkId>(chunks_.size());
  const int64_t capacity = std::max(numel, g.chunk_size_numel);
  chunks_.push_back(std::make_unique<Chunk>(id, group, g.dtype, capacity, alignment_numel, config_.world_size));
  g.chunk_ids.push_back(id);
  auto slot = chunks_.back()->try_append(name, numel, shape);
  GX_INTERNAL_ASSERT(slot.has_value(), "a fresh chunk of ", capacity, " elements refused a tensor of ", numel);
  if (capacity > g.chunk_size_numel) {
    chunks_.back()->close();  // an oversized tensor's own chunk; the open chunk stays open
  } else {
    g.open_chunk = id;
  }
  return TensorHandle{id, *slot};
}

void ChunkManager::close_chunks() {
  for (auto& c : chunks_) c->close();
}

void ChunkManager::finalize(const std::vector<ChunkId>& device_first, const std::vector<ChunkId>& without_copy) {
  GX_CHECK(!finalized_, "finalize(): already finalized.");
  close_chunks();
  std::vector<std::optional<Tier>> first_tier(chunks_.size());
  for (const auto& c : chunks_) first_tier[static_cast<size_t>(c->id())] = groups_.at(c->group()).home_tier;
  auto check_id = [&](ChunkId id, const char* list) {
    GX_CHECK(id >= 0 && static_cast<size_t>(id) < chunks_.size(), "finalize(", list, "): chunk ", id,
             " does not exist (", chunks_.size(), " chunks).");
  };
  for (ChunkId id : device_first) {
    check_id(id, "device_first");
    GX_CHECK(allocator_.has_tier(Tier::kDevice), "finalize(device_first): the ", backend_.name(),
             " backend has no device tier.");
    first_tier[static_cast<size_t>(id)] = Tier::kDevice;
  }
  for (ChunkId id : without_copy) {
    check_id(id, "without_copy");
    first_tier[static_cast<size_t>(id)] = std::nullopt;
  }
  // Each group's first copies on a tier come from one reservation of that tier's arena (one
  // upstream allocation per group and tier, not one per chunk), carved right after it is taken
  // so that the extent holds that group alone (slot sizes are shared between groups: the fp32
  // master and moments would otherwise interleave first-fit). A group that later leaves the tier
  // entirely (the optimizer state dropped at close) leaves a wholly free extent that trim() gives back.
  for (const auto& [name, g] : groups_) {
    std::array<size_t, kNumTiers> bytes{};
    for (ChunkId id : g.chunk_ids) {
      const auto& tier = first_tier[static_cast<size_t>(id)];
      if (tier)
        bytes[static_cast<size_t>(*tier)] +=
            round_up(chunks_[static_cast<size_t>(id)]->shard_bytes(), kResourceAlignmentBytes);
    }
    for (int t = 0; t < kNumTiers; ++t) {
      if (bytes[static_cast<size_t>(t)] == 0) continue;
      allocator_.reserve_arena(static_cast<Tier>(t), bytes[static_cast<size_t>(t)]);
      for (ChunkId id : g.chunk_ids) {
        const auto& tier = first_tier[static_cast<size_t>(id)];
        if (tier && static_cast<int>(*tier) == t) add_copy(mutable_chunk(id), *tier);
      }
    }
  }
  for (auto& c : chunks_) {
    if (!first_tier[static_cast<size_t>(c->id())]) continue;
    const Tier first = *first_tier[static_cast<size_t>(c->id())];
    // Zero the shard so padding never holds garbage. The slot is fresh, nothing else uses it.
    if (first == Tier::kDevice) {
      backend_.zero_async(c->shard_ptr(first), c->shard_bytes(), StreamKind::kHostToDevice);
    } else {
      // On every core: a model that fills the host zeroes about 100 GB here.
      auto* bytes = static_cast<uint8_t*>(c->shard_ptr(first));
      constexpr int64_t kGrainBytes = int64_t{1} << 24;
      ThreadPool::global().parallel_for(static_cast<int64_t>(c->shard_bytes()), kGrainBytes, [&](int64_t b, int64_t e) {
        std::memset(bytes + b, 0, static_cast<size_t>(e - b));
      });
    }
  }
  backend_.synchronize(StreamKind::kHostToDevice);  // the device shards are zero before anyone uses them
  finalized_ = true;
}

void ChunkManager::set_communicator(Communicator* communicator) {
  GX_CHECK(!finalized_, "set_communicator: the ChunkManager is finalized; attach the communicator before finalize().");
  GX_CHECK(communicator != nullptr, "set_communicator: expected a communicator, got null.");
  GX_CHECK(communicator->world_size() == config_.world_size && communicator->rank() == config_.rank,
           "set_communicator: the communicator is rank ", communicator->rank(), " of ", communicator->world_size(),
           " but the ChunkManager was configured as rank ", config_.rank, " of ", config_.world_size,
           "; build the ChunkManager with the communicator's world size and rank.");
  communicator_ = communicator;
}

void ChunkManager::check_can_communicate(const char* what, ChunkId id) const {
  GX_CHECK(config_.world_size == 1 || sharded(), what, " of chunk ", id, ": the chunks are split over ",
           config_.world_size, " ranks, which needs a communicator; call set_communicator() before finalize().");
}

void ChunkManager::check_finalized(const char* what) const {
  GX_CHECK(finalized_, what, ": the ChunkManager is not finalized; call finalize() after registering tensors.");
}

Chunk& ChunkManager::mutable_chunk(ChunkId id) {
  GX_CHECK(id >= 0 && static_cast<size_t>(id) < chunks_.size(), "chunk id: expected in [0, ", chunks_.size(),
           "), got ", id, ".");
  return *chunks_[static_cast<size_t>(id)];
}

const Chunk& ChunkManager::chunk(ChunkId id) const { return const_cast<ChunkManager*>(this)->mutable_chunk(id); }

const GroupInfo& ChunkManager::group(const std::string& name) const {
  auto it = groups_.find(name);
  GX_CHECK(it != groups_.end(), "unknown group '", name, "'.");
  return it->second;
}

std::vector<std::string> ChunkManager::group_names() const {
  std::vector<std::string> names;
  for (const auto& [name, g] : groups_) names.push_back(name);
  return names;
}

void* ChunkManager::tensor_ptr(const TensorHandle& handle, Tier tier) const {
  check_finalized("tensor_ptr");
  const Chunk& c = chunk(handle.chunk_id);
  GX_CHECK(c.shard_tiers().contains(tier), "tensor '", c.slot(handle.slot_index).name, "' of chunk ", c.id(),
           ": no copy on tier ", to_string(tier), " (the shard is on ", c.shard_tiers().to_string(),
           "); move or access the chunk first.");
  GX_CHECK(c.world_size() == 1, "tensor_ptr on a sharded chunk (world size ", c.world_size(),
           "): a tensor may span shards; use gathered_tensor_ptr after access().");
  const size_t offset_bytes =
      static_cast<size_t>(c.slot(handle.slot_index).offset_numel) * element_size_bytes(c.dtype());
  return static_cast<uint8_t*>(c.shard_ptr(tier)) + offset_bytes;
}

void* ChunkManager::gathered_tensor_ptr(const TensorHandle& handle) const {
  check_finalized("gathered_tensor_ptr");
  const Chunk& c = chunk(handle.chunk_id);
  GX_CHECK(c.gathered(), "tensor '", c.slot(handle.slot_index).name, "' of chunk ", c.id(),
           " is not gathered on the device; call access(", c.id(), ") first.");
  const size_t offset_bytes =
      static_cast<size_t>(c.slot(handle.slot_index).offset_numel) * element_size_bytes(c.dtype());
  return static_cast<uint8_t*>(c.gathered_ptr()) + offset_bytes;
}

void ChunkManager::transition(const TensorHandle& handle, TensorState to) {
  mutable_chunk(handle.chunk_id).transition(handle.slot_index, to);
}

TensorState ChunkManager::state(const TensorHandle& handle) const {
  return chunk(handle.chunk_id).slot(handle.slot_index).state;
}

void ChunkManager::add_copy(Chunk& c, Tier tier) {
  GX_INTERNAL_ASSERT(c.shard_ptr(tier) == nullptr, "chunk ", c.id(), " already has a copy on ", to_string(tier));
  void* ptr = allocate_slot(tier, c.shard_bytes());
  c.set_shard_ptr(tier, ptr);
  c.shard_tiers().add(tier);
  tier_bytes_[static_cast<int>(tier)].increase(static_cast<int64_t>(c.shard_bytes()));
  if (listener_ != nullptr) listener_->on_residency_change(c.id());
}

void ChunkManager::add_gathered(Chunk& c) {
  GX_INTERNAL_ASSERT(sharded() && !c.gathered(), "add_gathered of chunk ", c.id(), " (sharded ", sharded(),
                     ", gathered ", c.gathered(), ")");
  void* ptr = allocate_slot(Tier::kDevice, c.chunk_bytes());  // OutOfMemoryError: nothing changed
  c.set_gathered_ptr(ptr);
  tier_bytes_[static_cast<int>(Tier::kDevice)].increase(static_cast<int64_t>(c.chunk_bytes()));
  gathered_bytes_.increase(static_cast<int64_t>(c.chunk_bytes()));
  if (listener_ != nullptr) listener_->on_residency_change(c.id());
}

void ChunkManager::drop_gathered(Chunk& c) {
  GX_INTERNAL_ASSERT(sharded() && c.gathered(), "drop_gathered of chunk ", c.id(), ", which is not gathered");
  auto flying = gathers_in_flight_.find(c.id());
  if (flying != gathers_in_flight_.end()) {
    // A prefetched gather never used: later writers of the slot (compute-stream collectives and
    // kernels, copies that wait on compute) must come after it.
    backend_.stream_wait_event(StreamKind::kCompute, flying->second);
    gathers_in_flight_.erase(flying);
  }
  // Queued compute may still read the buffer: every later writer of the slot is ordered after it
  // (collectives and compute are stream-ordered after compute, copies wait on a compute event).
  allocator_.deallocate_after(Tier::kDevice, c.gathered_ptr(), c.chunk_bytes(), last_use_events(Tier::kDevice));
  c.set_gathered_ptr(nullptr);
  tier_bytes_[static_cast<int>(Tier::kDevice)].decrease(static_cast<int64_t>(c.chunk_bytes()));
  gathered_bytes_.decrease(static_cast<int64_t>(c.chunk_bytes()));
  if (listener_ != nullptr) listener_->on_residency_change(c.id());
}

std::shared_ptr<Event> ChunkManager::copy_event(ChunkId id) const {
  auto it = in_flight_.find(id);
  return it == in_flight_.end() ? nullptr : it->second.event;
}

void* ChunkManager::allocate_spare(ChunkId id, Tier tier) {
  GX_INTERNAL_ASSERT(tier != Tier::kDevice, "allocate_spare on the device tier: spares are host double buffers");
  return allocator_.allocate(tier, chunk(id).shard_bytes());
}

void ChunkManager::release_spare(ChunkId id, Tier tier, void* ptr) {
  if (ptr != nullptr) allocator_.deallocate(tier, ptr, chunk(id).shard_bytes());
}

void* ChunkManager::exchange_copy(ChunkId id, Tier tier, void* spare) {
  GX_INTERNAL_ASSERT(tier != Tier::kDevice, "exchange_copy on the device tier: spares are host double buffers");
  Chunk& c = mutable_chunk(id);
  GX_INTERNAL_ASSERT(c.shard_tiers().contains(tier) && spare != nullptr, "exchange_copy of chunk ", id, " on ",
                     to_string(tier), ": no copy there or no spare");
  GX_INTERNAL_ASSERT(!in_flight(id), "exchange_copy of chunk ", id, " while a copy of it is in flight");
  void* old = c.shard_ptr(tier);
  c.set_shard_ptr(tier, spare);
  if (listener_ != nullptr) listener_->on_residency_change(c.id());
  return old;
}

void ChunkManager::drop_copy(Chunk& c, Tier tier) {
  GX_INTERNAL_ASSERT(c.shard_ptr(tier) != nullptr, "chunk ", c.id(), " has no copy on ", to_string(tier), " to drop");
  if (tier == Tier::kDevice) {
    if (prefetched_.erase(c.id()) != 0) traffic_.prefetch_wasted += 1;  // evicted before any use
    auto gathering = gathers_in_flight_.find(c.id());
    if (gathering != gathers_in_flight_.end()) {
      // A prefetched gather still reads this shard on the copy stream: whatever reuses the slot
      // (ordered after compute) must come after it.
      backend_.stream_wait_event(StreamKind::kCompute, gathering->second);
    }
    if (!sharded() && c.gathered_ptr() == c.shard_ptr(tier)) c.set_gathered_ptr(nullptr);
  }
  allocator_.deallocate_after(tier, c.shard_ptr(tier), c.shard_bytes(), last_use_events(tier));
  c.set_shard_ptr(tier, nullptr);
  c.shard_tiers().remove(tier);
  tier_bytes_[static_cast<int>(tier)].decrease(static_cast<int64_t>(c.shard_bytes()));
  if (listener_ != nullptr) listener_->on_residency_change(c.id());
}

std::vector<std::shared_ptr<Event>> ChunkManager::last_use_events(Tier tier) {
  // The streams that may still read or write a slot of the tier when it is freed: compute and
  // both copy streams for a device slot, the copy streams for a host slot (the CPU optimizer
  // touches host slots from the calling thread, synchronously).
  std::vector<std::shared_ptr<Event>> events;
  if (tier == Tier::kDevice) events.push_back(backend_.record_event(StreamKind::kCompute));
  events.push_back(backend_.record_event(StreamKind::kHostToDevice));
  events.push_back(backend_.record_event(StreamKind::kDeviceToHost));
  return events;
}

void* ChunkManager::allocate_slot(Tier tier, size_t bytes) {
  if (tier != Tier::kDevice) return allocator_.allocate(tier, bytes);  // first written by the CPU or a copy
  // A device slot is first written by a copy (H2D stream) or on the compute stream (gathers,
  // gradient buffers): both are ordered after the last uses of a reused slot, without blocking.
  FixedSizePool::Ordered slot = allocator_.allocate_ordered(tier, bytes);
  for (const auto& e : slot.wait_for) {
    backend_.stream_wait_event(StreamKind::kHostToDevice, e);
    backend_.stream_wait_event(StreamKind::kCompute, e);
  }
  return slot.ptr;
}

StreamKind ChunkManager::stream_for(Tier from, Tier to) const {
  if (to == Tier::kDevice) return StreamKind::kHostToDevice;
  if (from == Tier::kDevice) return StreamKind::kDeviceToHost;
  return StreamKind::kCompute;  // host to host: a plain copy on the caller's stream
}

void ChunkManager::count_traffic(Tier from, Tier to, size_t bytes) {
  const auto b = static_cast<int64_t>(bytes);
  if (to == Tier::kDevice) traffic_.h2d_bytes += b;
  else if (from == Tier::kDevice) traffic_.d2h_bytes += b;
  else traffic_.h2h_bytes += b;
}

void ChunkManager::move(ChunkId id, Tier to, bool async) {
  check_finalized("move");
  Chunk& c = mutable_chunk(id);
  complete_move(id, /*block=*/true);  // at most one move in flight per chunk
  GX_INTERNAL_ASSERT(c.can_move(), "move of chunk ", id, " while ", c.count_in(TensorState::kCompute),
                     " of its tensors are in COMPUTE");
  GX_CHECK(sharded() || !c.gathered() || to == Tier::kDevice, "move of chunk ", id, " to ", to_string(to),
           " while it is gathered for compute; release it first.");
  if (c.shard_tiers().contains(to)) {
    // Already there: drop the other copies.
    for (int t = 0; t < kNumTiers; ++t) {
      if (static_cast<Tier>(t) != to && c.shard_tiers().contains(static_cast<Tier>(t)))
        drop_copy(c, static_cast<Tier>(t));
    }
    return;
  }
  GX_CHECK(!c.shard_tiers().empty(), "move of chunk ", id, ": it holds no data on any tier.");
  // Source: the device if present (fastest), else the first host tier holding it.
  const Tier from = c.shard_tiers().contains(Tier::kDevice) ? Tier::kDevice
              : c.shard_tiers().contains(Tier::kPinnedHost) ? Tier::kPinnedHost : Tier::kPageableHost;
  add_copy(c, to);
  start_copy("move", c, from, to, /*drop_source=*/true, async);
}

void ChunkManager::start_copy(const char* what, Chunk& c, Tier from, Tier to, bool drop_source, bool async,
                              bool compute_waits) {
  const StreamKind stream = stream_for(from, to);
  std::shared_ptr<void> range;
  if (ranges_->active()) range = ranges_->open(detail::concat("gx.", what, " chunk ", c.id(), " to ", to_string(to)));
  // The side stream must see everything compute did to the source (e.g. an optimizer update)
  // and must not overwrite the destination while compute still reads it.
  if (stream != StreamKind::kCompute) backend_.stream_wait_event(stream, backend_.record_event(StreamKind::kCompute));
  backend_.copy_async(c.shard_ptr(to), c.shard_ptr(from), c.shard_bytes(), stream);
  count_traffic(from, to, c.shard_bytes());
  traffic_.moves += 1;
  compute_waits = compute_waits && to == Tier::kDevice;
  in_flight_[c.id()] = InFlight{backend_.record_event(stream), from, to, drop_source, compute_waits};
  if (compute_waits) {
    // Compute that uses the destination must wait for the copy (an event wait, not a host wait).
    backend_.stream_wait_event(StreamKind::kCompute, in_flight_[c.id()].event);
  }
  if (!async) complete_move(c.id(), /*block=*/true);
}

void ChunkManager::prefetch(ChunkId id) {
  check_finalized("prefetch");
  Chunk& c = mutable_chunk(id);
  if (c.shard_tiers().contains(Tier::kDevice) || in_flight_.count(id) != 0) return;
  const Tier from = c.shard_tiers().contains(Tier::kPinnedHost) ? Tier::kPinnedHost : Tier::kPageableHost;
  GX_INTERNAL_ASSERT(c.shard_tiers().contains(from), "prefetch of chunk ", id, ", which holds no data on any tier");
  add_copy(c, Tier::kDevice);  // throws OutOfMemoryError before changing anything
  traffic_.prefetches += 1;
  prefetched_.insert(id);
  start_copy("prefetch", c, from, Tier::kDevice, /*drop_source=*/false, /*async=*/true, /*compute_waits=*/false);
}

void ChunkManager::allocate_copy(ChunkId id, Tier tier) {
  check_finalized("allocate_copy");
  Chunk& c = mutable_chunk(id);
  complete_move(id, /*block=*/true);
  GX_CHECK(!c.shard_tiers().contains(tier), "allocate_copy of chunk ", id, ": it already has a copy on ",
           to_string(tier), ".");
  add_copy(c, tier);
}

void ChunkManager::transfer(ChunkId id, Tier from, Tier to, bool async) {
  check_finalized("transfer");
  Chunk& c = mutable_chunk(id);
  complete_move(id, /*block=*/true);
  GX_CHECK(from != to, "transfer of chunk ", id, ": source and destination are both ", to_string(from), ".");
  GX_CHECK(c.shard_tiers().contains(from) && c.shard_tiers().contains(to), "transfer of chunk ", id, " from ",
           to_string(from), " to ", to_string(to), ": both copies must exist, the chunk is on ",
           c.shard_tiers().to_string(), "; use move() or allocate_copy() first.");
  GX_INTERNAL_ASSERT(to != Tier::kDevice || c.can_move(), "transfer into the device copy of chunk ", id, " while ",
                     c.count_in(TensorState::kCompute), " of its tensors are in COMPUTE");
  start_copy("copy", c, from, to, /*drop_source=*/false, async);
}

void ChunkManager::discard_copy(ChunkId id, Tier tier) {
  check_finalized("discard_copy");
  Chunk& c = mutable_chunk(id);
  complete_move(id, /*block=*/true);
  GX_CHECK(c.shard_tiers().contains(tier), "discard_copy of chunk ", id, ": no copy on ", to_string(tier),
           " (it is on ", c.shard_tiers().to_string(), ").");
  GX_INTERNAL_ASSERT(tier != Tier::kDevice || c.can_move(), "discard of the device copy of chunk ", id, " while ",
                     c.count_in(TensorState::kCompute), " of its tensors are in COMPUTE");
  // Kernels queued on the compute stream may still read a device copy. Its slot can go back to
  // the pool at once: every later writer of a device slot is ordered after them (copies wait on
  // a compute event before they start; compute-stream writers are in stream order).
  drop_copy(c, tier);
}

void ChunkManager::complete_move(ChunkId id, bool block) {
  auto it = in_flight_.find(id);
  if (it == in_flight_.end()) return;
  if (!block && !it->second.event->query()) return;
  {
    std::shared_ptr<void> range = ranges_->active() && !it->second.event->query()
                                      ? ranges_->open(detail::concat("gx.wait chunk ", id)) : nullptr;
    it->second.event->synchronize();
  }
  Chunk& c = mutable_chunk(id);
  const Tier from = it->second.from;
  const bool drop_source = it->second.drop_source;
  in_flight_.erase(it);
  if (drop_source) drop_copy(c, from);
}

void ChunkManager::wait(ChunkId id) {
  check_finalized("wait");
  complete_move(id, /*block=*/true);
}

void ChunkManager::compute_waits_for(const std::shared_ptr<Event>& copy_done, std::shared_ptr<Event> compute_reached) {
  if (!compute_reached) compute_reached = backend_.record_event(StreamKind::kCompute);
  pending_waits_.push_back(PendingWait{std::move(compute_reached), copy_done});
  backend_.stream_wait_event(StreamKind::kCompute, copy_done);
}

void ChunkManager::collect_waits() {
  std::vector<PendingWait> still;
  for (auto& w : pending_waits_) {
    if (!w.compute_reached->query() || !w.copy_done->query()) {
      still.push_back(std::move(w));
      continue;
    }
    const double s = w.copy_done->seconds_after(*w.compute_reached);
    if (s > 0) {
      traffic_.copy_wait_seconds += s;
      traffic_.copy_waits += 1;
    }
  }
  pending_waits_.swap(still);
}

void ChunkManager::poll() {
  collect_waits();
  std::vector<ChunkId> ids;
  for (const auto& [id, f] : in_flight_) ids.push_back(id);
  for (ChunkId id : ids) complete_move(id, /*block=*/false);
}

int64_t ChunkManager::wasted_bytes() const {
  int64_t total = 0;
  for (const auto& c : chunks_) {
    if (c->closed()) total += c->wasted_numel() * static_cast<int64_t>(element_size_bytes(c->dtype()));
  }
  return total;
}

}  // namespace gx
