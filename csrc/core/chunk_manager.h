// ChunkManager: owns every chunk and its memory, executes moves; never decides placement.
//
// Design note.
//  * Registration. Tensors are registered into named groups (one dtype and chunk size per
//    group) in the order they will be used. A group appends to its open chunk until a tensor
//    does not fit, then opens the next one; a tensor larger than the chunk size gets a chunk of
//    its own. `close_chunks()` freezes the layouts (shard sizes are known from then on, so a
//    policy can plan before any memory is taken); `finalize()` closes every chunk and gives each
//    shard a pool slot, zero-filled so padding never holds garbage, on its group's home tier or,
//    for the chunks the caller names, directly on the device (state planned to live on the
//    device never passes through host memory: a model whose state exceeds the host's needs
//    that) or nowhere yet (content that is born later). Slots start FREE; whoever fills a tensor's payload moves it to
//    HOLD.
//  * Operations (each validates the chunk's predicates and the tensor states):
//      access(c)   make c gathered on the device for compute; fetches if its shard is not on the
//                  device; a prefetch in flight is waited for by the compute stream, not the host.
//      prefetch(c) start the host-to-device copy of c now, on the copy stream; access(c) later.
//      release(c)  drop the gathered view after compute (sharded: can_release must hold; unsharded:
//                  can_move, since the view is all it drops).
//      move(c, t)  give c's shard exactly tier t (can_move must hold). The copy runs on the side
//                  stream of its direction; with `async` the call returns at once and the source
//                  slot is freed when the copy is known complete (wait(c), access(c), poll()).
//      reduce(c)   all tensors READY_FOR_REDUCE -> HOLD (can_reduce must hold): the bookkeeping of
//                  a reduction. Unsharded there is nothing to communicate.
//      reduce_scatter(g)  sharded: sums g's gathered buffer over ranks into the device copy of
//                  this rank's shard and drops the buffer (the gradient chunk's communication).
//      allocate_copy(c, t)      give c a slot on t without copying (the caller fills it).
//      transfer(c, from, to)    copy between two existing copies (refresh a stale one).
//      discard_copy(c, t)       drop t's copy without copying it anywhere (a clean cache copy, or
//                               content nobody needs any more).
//    Coherence is the caller's contract: every copy in shard_tiers is meant to hold the same
//    bytes; whoever writes one copy refreshes or discards the others.
//  * Sharded mode (set_communicator, see communicator.h). Every tier's copy holds this rank's
//    shard only; access(c) brings the shard to the device as above and then all-gathers it
//    into a gathered buffer of the whole chunk (device tier, counted in its bytes and in
//    gathered_bytes()); release(c, reshard) or ungather(c) frees it. allocate_gathered(c) gives
//    a gathered buffer without gathering (gradients are written there, then reduce(c)).
//    Unsharded (no communicator), the gathered view is the device copy itself.
//  * Residency listener. The torch layer binds parameter storages to the whole chunk's memory
//    (the device copy unsharded, the gathered buffer sharded, else a host copy the device can
//    reach); the manager tells it after any copy of a chunk appears, goes away or changes
//    address, and the listener reads the chunk's new residency.
//  * Accounting. One Stat per tier counts the shard bytes chunks hold there, updated only in
//    add_copy/drop_copy; traffic counters count bytes moved per direction. Stats never go
//    negative (Stat asserts it). Policies read these numbers; they never call move themselves.
#pragma once

#include <array>
#include <map>
#include <set>
#include <memory>
#include <string>
#include <vector>

#include "chunk.h"
#include "chunk_allocator.h"
#include "communicator.h"
#include "device_backend.h"
#include "stat.h"
#include "trace_ranges.h"

namespace gx {

struct ChunkManagerConfig {
  int world_size = 1;
  int rank = 0;
  size_t alignment_bytes = 64;  // each tensor slot starts at a multiple of this many bytes
  bool pin_memory = true;       // host copies in pinned memory when the backend has it
};

// Told after a copy of a chunk (any tier, or its gathered buffer) was created, dropped or
// exchanged; the chunk's pointers already say where it lives now.
class ResidencyListener {
 public:
  virtual ~ResidencyListener() = default;
  virtual void on_residency_change(ChunkId id) = 0;
};

struct TensorHandle {
  ChunkId chunk_id = -1;
  size_t slot_index = 0;
};

struct GroupInfo {
  std::string name;
  DType dtype = DType::kFloat32;
  int64_t chunk_size_numel = 0;
  int64_t alignment_numel = 1;
  Tier home_tier = Tier::kDevice;
  std::vector<ChunkId> chunk_ids;
  ChunkId open_chunk = -1;  // the chunk new tensors go into; oversized tensors never open one
};

struct TrafficStats {
  int64_t h2d_bytes = 0;
  int64_t d2h_bytes = 0;
  int64_t h2h_bytes = 0;
  int64_t moves = 0;
  int64_t fetches = 0;  // accesses that had to bring the shard to the device
  int64_t accesses = 0;
  int64_t reductions = 0;
  int64_t all_gathers = 0;     // sharded: gathers of a chunk for compute (prefetched ones included)
  int64_t gather_prefetches = 0;  // sharded: gathers started ahead of their access
  int64_t reduce_scatters = 0;  // sharded: reductions that communicated
  int64_t prefetches = 0;     // prefetch copies started
  int64_t prefetch_hits = 0;  // accesses that found their chunk prefetched (landed or in flight)
  int64_t prefetch_wasted = 0;  // prefetched copies dropped before any access
  // Compute stalls on copies it needed (a fetch, or a prefetch not yet landed): per access, the
  // time from compute reaching it to the copy's completion, when positive. Measured with events
  // (device time on cuda), collected by poll().
  double copy_wait_seconds = 0.0;
  int64_t copy_waits = 0;  // accesses whose copy was still running when compute reached them
};

class ChunkManager {
 public:
  ChunkManager(DeviceBackend& backend, ChunkManagerConfig config);
  ~ChunkManager();
  ChunkManager(const ChunkManager&) = delete;
  ChunkManager& operator=(const ChunkManager&) = delete;

  // Registration.
  // alignment_numel 0: derived from ChunkManagerConfig::alignment_bytes and the dtype. Groups
  // that must share one layout (16-bit params and their fp32 masters) pass the same value.
  void create_group(const std::string& group, DType dtype, int64_t chunk_size_numel, Tier home_tier,
                    int64_t alignment_numel = 0);
  TensorHandle register_tensor(const std::string& group, const std::string& name, int64_t numel,
                               const std::vector<int64_t>& shape);
  void close_chunks();  // freezes every chunk's layout (idempotent; finalize() does it too)
  // `device_first`: chunks whose first copy goes to the device instead of their group's home;
  // `without_copy`: chunks that start with no copy at all (content born later, e.g. gradients
  // written on the device in backward; allocate_copy gives them their first one).
  void finalize(const std::vector<ChunkId>& device_first = {}, const std::vector<ChunkId>& without_copy = {});
  bool finalized() const { return finalized_; }
  // Makes the manager sharded (before finalize): its world size and rank must be the
  // config's. The communicator must outlive the manager.
  void set_communicator(Communicator* communicator);
  bool sharded() const { return communicator_ != nullptr; }
  Communicator* communicator() const { return communicator_; }

  // Payload access (valid once finalized).
  void* tensor_ptr(const TensorHandle& handle, Tier tier) const;  // pointer into the tier's copy
  void* gathered_tensor_ptr(const TensorHandle& handle) const;    // pointer into the gathered copy
  void transition(const TensorHandle& handle, TensorState to);
  TensorState state(const TensorHandle& handle) const;

  // Operations.
  void access(ChunkId id);
  // Compute is done with c for now. Sharded, `reshard` frees the gathered buffer (false keeps it
  // for a later access, e.g. through backward).
  void release(ChunkId id, bool reshard = true);
  // Sharded: frees c's gathered buffer if it has one (no tensor of c may be in COMPUTE).
  void ungather(ChunkId id);
  // Sharded: a gathered buffer for c without gathering (the caller fills it).
  void allocate_gathered(ChunkId id);
  // Sharded: gathers c ahead of its access on the host-to-device stream (after the shard's own
  // copy there, if it had to be fetched); access(c) makes compute wait for it then. Nothing to
  // do if c is gathered. OutOfMemoryError (nothing changed) if the device has no room.
  void prefetch_gather(ChunkId id);
  bool gather_in_flight(ChunkId id) const { return gathers_in_flight_.count(id) != 0; }
  void move(ChunkId id, Tier to, bool async = false);
  void wait(ChunkId id);
  void poll();  // completes finished async moves without blocking
  void reduce(ChunkId id);
  void reduce_scatter(ChunkId id);
  // Starts copying c's host copy to a new device copy and returns; compute does not wait for it
  // until access(c). Nothing to do if c is on the device or in flight. OutOfMemoryError (nothing
  // changed) if the device tier has no room.
  void prefetch(ChunkId id);
  void allocate_copy(ChunkId id, Tier tier);
  void transfer(ChunkId id, Tier from, Tier to, bool async = false);
  void discard_copy(ChunkId id, Tier tier);
  void set_listener(ResidencyListener* listener) { listener_ = listener; }
  // Copies started ("gx.fetch" for compute, "gx.prefetch", "gx.move" to a tier) and waits for one
  // ("gx.wait chunk N") open named ranges there (a profiler's timeline); `ranges` outlives the manager.
  void set_trace_ranges(TraceRanges& ranges) { ranges_ = &ranges; }
  bool in_flight(ChunkId id) const { return in_flight_.count(id) != 0; }
  // The completion event of the copy in flight for this chunk (nullptr if none): a thread that
  // reads the destination without the manager (the optimizer thread) waits on it.
  std::shared_ptr<Event> copy_event(ChunkId id) const;
  // Spare slots: the pool and size class of the chunk's shard copies on a host tier, for a
  // double buffer. exchange_copy puts a spare in place of the chunk's copy on that tier and
  // returns the copy's slot, which is then the spare; nothing may be reading or copying either
  // slot (the caller's guarantee: host tiers are written by the CPU only, and the copies that
  // read them are complete).
  void* allocate_spare(ChunkId id, Tier tier);
  void release_spare(ChunkId id, Tier tier, void* ptr);
  void* exchange_copy(ChunkId id, Tier tier, void* spare);
  bool prefetched(ChunkId id) const { return prefetched_.count(id) != 0; }  // and not accessed yet

  // Introspection.
  const Chunk& chunk(ChunkId id) const;
  size_t num_chunks() const { return chunks_.size(); }
  const GroupInfo& group(const std::string& name) const;
  std::vector<std::string> group_names() const;
  Stat tier_bytes(Tier tier) const { return tier_bytes_[static_cast<int>(tier)]; }
  Stat gathered_bytes() const { return gathered_bytes_; }  // part of the device tier's bytes
  const TrafficStats& traffic() const { return traffic_; }
  int64_t wasted_bytes() const;
  Tier host_tier() const { return host_tier_; }
  int world_size() const { return config_.world_size; }
  int rank() const { return config_.rank; }
  DeviceBackend& backend() { return backend_; }
  const ChunkAllocator& allocator() const { return allocator_; }
  // Gives the tier's free slots (after their last uses) and wholly free arena extents back to
  // the system; returns the bytes released.
  size_t trim(Tier tier) { return allocator_.trim(tier); }
  void reserve_arena(Tier tier, size_t bytes) { allocator_.reserve_arena(tier, bytes); }

 private:
  struct InFlight {
    std::shared_ptr<Event> event;
    Tier from;
    Tier to;
    bool drop_source;  // a move; a transfer keeps both copies
    bool compute_waits;  // the compute stream already waits for this copy
  };
  Chunk& mutable_chunk(ChunkId id);
  void bring_shard_to_device(Chunk& c);  // access's fetch (or wait for the prefetch)
  void add_gathered(Chunk& c);            // allocates the gathered buffer, accounts it
  void drop_gathered(Chunk& c);
  void add_copy(Chunk& c, Tier tier);   // allocates a slot, accounts it
  void drop_copy(Chunk& c, Tier tier);  // frees the slot, un-accounts it
  void complete_move(ChunkId id, bool block);
  StreamKind stream_for(Tier from, Tier to) const;
  std::vector<std::shared_ptr<Event>> last_use_events(Tier tier);  // recorded where a freed slot may be in use
  void* allocate_slot(Tier tier, size_t bytes);  // a chunk slot, its first use ordered after its last uses
  void count_traffic(Tier from, Tier to, size_t bytes);
  // `what` names its range: "move", "prefetch" or "copy"
  void start_copy(const char* what, Chunk& c, Tier from, Tier to, bool drop_source, bool async,
                  bool compute_waits = true);
  void check_finalized(const char* what) const;
  void check_can_communicate(const char* what, ChunkId id) const;

  DeviceBackend& backend_;
  ChunkManagerConfig config_;
  Tier host_tier_;
  HostMemoryResource pageable_host_;  // before allocator_: the allocator's pools free into it
  ChunkAllocator allocator_;
  std::vector<std::unique_ptr<Chunk>> chunks_;
  std::map<std::string, GroupInfo> groups_;
  std::map<ChunkId, InFlight> in_flight_;
  std::set<ChunkId> prefetched_;  // prefetched, not accessed yet
  std::map<ChunkId, std::shared_ptr<Event>> gathers_in_flight_;  // prefetched gathers, until accessed
  struct PendingWait {
    std::shared_ptr<Event> compute_reached;
    std::shared_ptr<Event> copy_done;
  };
  std::vector<PendingWait> pending_waits_;
  // Makes compute wait for `copy_done` and records the stall from `compute_reached` (recorded
  // now on the compute stream when null) to the copy's completion.
  void compute_waits_for(const std::shared_ptr<Event>& copy_done, std::shared_ptr<Event> compute_reached = nullptr);
  void collect_waits();
  std::array<Stat, kNumTiers> tier_bytes_;
  Stat gathered_bytes_;
  Communicator* communicator_ = nullptr;
  TrafficStats traffic_;
  ResidencyListener* listener_ = nullptr;
  TraceRanges* ranges_ = &TraceRanges::none();
  bool finalized_ = false;
};

}  // namespace gx
