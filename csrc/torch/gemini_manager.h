// GeminiManager: the per-process runtime behind the engine's hooks. It decides nothing about
// placement (the static placement and the eviction policy do); it carries their decisions out
// on the ChunkManager, moves gradients into chunks, and keeps the books the optimizer needs.
//
// Design note.
//  * Chunk sets. Every parameter chunk P (the compute dtype: bf16, fp16 or fp32) of trainable
//    parameters comes with companions of the same layout: G (gradients, compute dtype), M (fp32
//    master; absent when P itself is fp32), A and S (Adam's exp_avg and exp_avg_sq, fp32).
//    Frozen parameters live in chunks of their own with no companions. Per set: where the
//    optimizer state lives (host: CPU Adam; device: fused GPU Adam) and P's home tier.
//  * Coherence. Every copy a chunk has holds the same bytes. For a set whose optimizer state is
//    on the host, P's host copy is permanent and always current (CPU Adam writes it); its device
//    copy is a cache, dropped for free on eviction. Otherwise P's device copy is the truth, and
//    eviction moves it to the host. Whoever writes a copy refreshes or drops the others.
//  * Lifecycle of a parameter tensor (TensorState in P): pre-forward HOLD -> COMPUTE, post-
//    forward COMPUTE -> HOLD (reference counted, so a parameter used by two modules at once
//    stays in COMPUTE until both are done); pre-backward -> COMPUTE (claimed for that backward:
//    a forward re-run by activation checkpointing leaves it there); post-backward (the
//    module's inputs got their gradient) COMPUTE -> HOLD_AFTER_BWD; its gradient accumulated ->
//    READY_FOR_REDUCE. When every tensor of P is READY_FOR_REDUCE the chunk is reduced (nothing
//    to communicate with one rank) and G goes to the optimizer's tier asynchronously. At the end
//    of backward, tensors still in COMPUTE go to HOLD_AFTER_BWD, chunks whose tensors got no
//    gradient are flushed (reduced with the gradients they have), and everything returns to HOLD.
//    Under no_sync() gradients accumulate in G on the device and nothing is reduced.
//  * Home on the host (offload_param_frac): such a chunk's device copy is dropped (or moved
//    back) when the access stream fetches a different chunk and it is idle, so each use phase
//    (forward, backward) fetches it about once.
//  * Device budget. Fetching a chunk or a gradient chunk that does not fit first waits for
//    gradient moves in flight (their device slots come back), then evicts the least recently
//    used evictable chunk and retries: a parameter chunk with no tensor in COMPUTE, or a
//    gradient chunk no backward still writes into (it waits for the step on the host), unless
//    its set's state is on the device because the host has no room (grad_stays_on_device). When
//    nothing can be evicted the OutOfMemoryError names the budget, what is resident and the knobs.
//  * Gradients never stay on the parameter: post-accumulate-grad copies (or adds) p.grad into
//    its G slot and resets p.grad, so `p.grad` is None after backward; the optimizer reads G.
//  * Sharded (the ChunkManager has a communicator; see core/communicator.h). Every copy of every
//    chunk holds this rank's shard. Compute accesses all-gather P into a gathered buffer (the
//    parameter storages point there) and release drops it again (ZeRO-3), unless the set is
//    `keep_gathered` (shard_param_frac), whose buffer stays until its gradients are reduced or
//    backward ends. Gradients go into a gathered G buffer; a complete chunk is pre-divided by
//    the world size and reduce-scattered into G's device shard, which then goes to the
//    optimizer's tier like an unsharded G. The optimizer steps shards. Only decisions that lead
//    to collectives must be equal on all ranks: which chunk is gathered or reduced, in which
//    order. They follow the hook sequence (the same on every rank for the same graph); eviction
//    and prefetch move this rank's shard only and never drop a gathered buffer. Reading values
//    (read, read_grad) all-gathers the chunk: every rank must make the same reads.
//  * Threads. Hook bodies run with the GIL released, on the autograd engine's threads too; one
//    mutex serialises every entry point.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "core/access_trace.h"
#include "core/chunk_manager.h"
#include "core/lru_eviction.h"
#include "core/owned_mutex.h"
#include "core/serial_executor.h"
#include "torch/chunk_views.h"
#include "torch/param_storage.h"

namespace gx::torch_layer {

struct ChunkSetSpec {
  ChunkId param = -1;
  ChunkId grad = -1;
  ChunkId master = -1;  // -1: P is the fp32 master itself (precision fp32)
  ChunkId exp_avg = -1;
  ChunkId exp_avg_sq = -1;
  bool optim_on_host = true;
  bool param_home_on_host = false;
  bool keep_gathered = false;  // sharded: P stays gathered after forward, until its gradients are reduced
  // The optimizer state is on the device because the host cannot hold it (the auto policy's
  // host-bound sets): the host has no room for G either, so eviction never moves G there.
  bool grad_stays_on_device = false;
};

struct ParamSpec {
  ChunkId chunk = -1;  // its P chunk
  size_t slot = 0;
  bool trainable = true;
};

enum class GradPlace { kNone, kDevice, kHost };

struct ChunkSet {
  ChunkSetSpec spec;
  bool trainable = false;
  std::vector<int> params;           // parameter index per slot of P
  std::vector<uint8_t> has_grad;     // per slot: a gradient is in G
  std::vector<int64_t> step;         // per slot: optimizer steps taken
  GradPlace grad_place = GradPlace::kNone;  // sharded: where the reduced shard is
  bool grad_collecting = false;              // sharded: this backward's gradients are in a gathered G buffer
  bool reduced = false;              // gradients of this backward reduced and sent to the optimizer's tier
  // Sum of squares of G's (shard's) gradients, fp32 on the device, taken when G left for the host;
  // undefined once G changes there (a later backward adds into the host copy) or is cleared.
  at::Tensor grad_sq;
};

struct EngineCounters {
  int64_t sync_fetch_waits = 0;
  double wait_seconds = 0.0;  // host time spent in synchronous fetches and evictions
  int64_t evictions = 0;
  int64_t evicted_bytes = 0;
  int64_t fetches = 0;
  int64_t grad_chunks_offloaded = 0;
  int64_t flushed_chunks = 0;
  int64_t backward_passes = 0;
  int64_t reclaims = 0;          // memory-pressure calls served (process allocator, tests)
  int64_t reclaimed_bytes = 0;   // chunk bytes they evicted from the device
  double optimizer_wait_seconds = 0.0;  // host time blocked on CPU optimizer steps still running
  int64_t optimizer_waits = 0;          // settles that had to wait for one
};

// One scheduling event, for memory_timeline(): kind is 'F' (fetch for compute), 'P' (prefetch
// started), 'E' (eviction), 'S' (iteration end).
struct TimelineEvent {
  double seconds = 0.0;  // since the manager was created
  char kind = 'F';
  ChunkId chunk = -1;
  int64_t device_bytes = 0;  // chunk bytes on the device after the event
};

class GeminiManager {
 public:
  GeminiManager(std::shared_ptr<DeviceContext> ctx, ChunkManager& mgr, std::vector<ChunkSetSpec> sets,
                std::vector<ParamSpec> params, std::string policy_name);
  ~GeminiManager();

  // Setup.
  std::vector<at::Tensor> param_views();  // one storage-backed view per parameter, in index order
  // Where parameter `param`'s storage points now: "device", "host" (a host copy the device
  // reads) or "none" (access raises); see param_storage.h.
  std::string param_binding(int param);
  void apply_placement();                 // initial moves after the host copies were filled
  int register_module(const std::vector<int>& params);

  // Writes made to parameters outside the hooks: the manager remembers each parameter's version
  // counter (torch bumps it at every in-place change); written_params() lists those that moved
  // since note_param_versions().
  void watch_params(std::vector<at::Tensor> params);
  std::vector<int> written_params() const;
  void note_param_versions();

  // Hook bodies.
  void pre_forward(int module);
  void post_forward(int module);
  void pre_backward(int module);
  void post_backward(int module);
  void post_accumulate_grad(int param, at::Tensor& p);
  void end_backward();
  void set_no_sync(bool no_sync);
  bool no_sync() const { return no_sync_; }
  bool in_backward() const { return in_backward_; }

  // Gradients and optimizer support (see hybrid_adam.h for the step).
  void zero_grad();
  // Sends gradients still on the device (accumulated under no_sync) to the optimizer's tier.
  void flush_grads();
  void wait_grads();
  void set_async_reduce(bool async) { async_reduce_ = async; }
  void set_max_prefetch(int max_prefetch) { max_prefetch_ = max_prefetch; }
  // The device bytes chunks may hold (0: the backend's capacity); lowering it evicts now.
  void set_device_budget(int64_t bytes);
  int64_t device_budget() const;
  // Moves one set's optimizer state (master, m, v) between the host (CPU Adam) and the device
  // (fused GPU Adam), between steps. The policy decides; this carries it out.
  void set_optim_on_host(int set_index, bool on_host);
  // Ends a training iteration (the optimizer step): closes the access trace (re-recorded if the
  // order changed). Returns true when the iteration repeated the recorded order.
  bool end_iteration();
  const AccessTrace& trace() const { return trace_; }
  std::vector<TimelineEvent> timeline() const;  // every G move finished
  std::vector<ChunkSet>& sets() { return sets_; }
  const std::vector<ParamSpec>& params() const { return params_; }
  ChunkManager& chunks() { return mgr_; }
  DeviceContext& context() { return *ctx_; }
  OwnedMutex& mutex() { return mutex_; }
  // Memory pressure (the process-wide allocator, or a test): evicts chunks no tensor computes
  // on, then gives the device tier's free slots and extents back, until `bytes` were released.
  // Declines (returns 0) when this thread is inside the manager already, or another thread is.
  size_t reclaim_device_bytes(size_t bytes);
  void stop_reclaiming();  // no longer asked under memory pressure (the engine closed); idempotent
  void ensure_on_device_locked(ChunkId id);
  // Sharded: this rank's shard of id on the device (a fetch keeps the host copy); no gathering.
  void ensure_shard_on_device_locked(ChunkId id);
  bool sharded() const { return mgr_.sharded(); }
  // HSDP (extra_dp_size): the ranks holding the same shard in the other replicas. Reduced
  // gradient shards are summed over them; gradients are pre-divided by the whole world size.
  void set_replica_communicator(Communicator* replicas);
  // Sums a value over the ranks (sharded; itself otherwise): the global gradient norm.
  double all_reduce_sum(double local);
  // Chunks the optimizer is working on: never chosen for eviction while pinned.
  void pin_locked(ChunkId id) { pinned_.insert(id); }
  void unpin_all_locked() { pinned_.clear(); }
  void values_changed_locked() { drop_whole_cache_locked(); }
  // Frees the chunk whole_slot_locked gathered last (its device memory goes back at once).
  void drop_whole_cache_locked() {
    whole_cache_id_ = -1;
    whole_cache_ = at::Tensor();
  }
  // Sharded: frees every gathered parameter buffer kept from compute (before values change).
  void ungather_all_locked();
  void allocate_on_device_locked(ChunkId id);
  int set_of_chunk(ChunkId p_chunk) const;

  // The optimizer pipeline (gemini_pipeline.cpp). A host set's CPU optimizer step runs on a
  // background thread: `compute` there (raw host memory only, never the chunk books), then
  // `complete` here, under the mutex, by whichever thread settles the set first (P's device copy
  // refreshed or dropped). Until settled the set is pending: compute accesses, gradient moves
  // and value reads of its chunks settle it first (waiting for it), prefetch skips it while it
  // runs, eviction leaves its chunks alone. Every other entry point settles every set.
  // `eager`: whether a finished step may be settled before anyone needs the set (prefetch does
  // that); a speculative step is not, until step() confirmed it (settling drops it otherwise).
  void launch_host_step_locked(int set_index, std::function<void()> compute, std::function<void()> complete,
                               std::function<bool()> eager = nullptr);
  void settle_locked(int set_index);
  bool try_settle_locked(int set_index);  // settles a finished step; false while it runs
  void settle_all_locked();
  void settle_all();
  // After optimizer.step() returns with CPU steps still running: the parameters of those sets
  // refuse access (param_storage.h) until each is settled; before step() a speculative step
  // changes nothing a parameter shows, so they stay readable.
  void guard_stepping_params();
  bool pending_locked(int set_index) const { return pending_.count(set_index) != 0; }
  size_t pending_steps() const;
  std::vector<int> pending_sets_locked() const { return {pending_order_.begin(), pending_order_.end()}; }
  // Called (mutex held) when a host set's gradients were sent to the host during backward or a
  // flush: where a speculative optimizer step may start (HybridAdam installs it).
  void set_grads_offloaded_hook(std::function<void(int set_index)> hook) { grads_offloaded_hook_ = std::move(hook); }
  // Off: every step settles before it returns (the serial step, for comparison).
  void set_overlap_optimizer(bool overlap) { overlap_optimizer_ = overlap; }
  bool overlap_optimizer() const { return overlap_optimizer_; }
  // The sets in the order the recorded iteration first touches their P chunks (forward order);
  // sets it never touched follow in index order. Recomputed when an iteration ends.
  const std::vector<int>& sets_in_forward_order() const { return forward_order_; }
  // Tests: while held, CPU steps wait before they start (so a test sees them pending); a delay
  // makes each one take that much longer (a slow host, deterministically).
  void hold_optimizer_thread(bool hold);
  void set_optimizer_task_delay_us(int64_t delay_us);
  double host_step_seconds() const;  // CPU optimizer time of the settled steps since the last reset
  void reset_host_step_seconds();

  // Values (fp32 on the CPU), for state_dict, checkpoints and close.
  // kind: "param" (the master, or P for frozen / fp32), "exp_avg", "exp_avg_sq".
  at::Tensor read(const std::string& kind, int param);
  // The same value as a new tensor of `dtype` on `device`, copied there from where the chunk is
  // (close() restores parameters to the GPU without a round trip through pageable host memory).
  at::Tensor read_to(const std::string& kind, int param, at::Device device, at::ScalarType dtype);
  // Sharded reads keep the last gathered chunk on the compute device (a chunk's slots are read
  // one after another); readers release it when done so that it holds no device memory.
  void release_read_cache();
  void write(const std::string& kind, int param, const at::Tensor& value);
  at::Tensor read_grad(int param);
  // The part of the value that lies in this rank's shard: (begin, end) element offsets into the
  // flattened tensor and an fp32 CPU copy of those elements (all of it unsharded). Local: no
  // collective (sharded checkpoints).
  std::tuple<int64_t, int64_t, at::Tensor> read_local(const std::string& kind, int param);  // fp32 CPU copy of the gradient in its chunk (undefined if none)
  int64_t step_of(int param) const;
  void set_step(int param, int64_t step);
  void synchronize();

  const EngineCounters& counters() const { return counters_; }
  const std::string& policy_name() const { return policy_name_; }

 private:
  struct Module {
    std::vector<int> params;
    std::vector<ChunkId> chunks;
  };
  at::Tensor slot_view(ChunkId id, size_t slot, Tier tier);
  // Fetches a module's chunks and puts its tensors in COMPUTE (forward: counted references;
  // backward: claimed until their gradient or post-backward).
  void fetch_for_compute_locked(const Module& m, bool forward);
  Tier where_current(ChunkId id) const;  // a tier holding a current copy
  void evict_locked(ChunkId id);
  bool make_room_locked(ChunkId requester);  // frees device bytes once; false if nothing can go
  int64_t device_budget_locked() const;
  void prefetch_locked();
  void settle_finished_locked();
  void prefetch_gathers_locked();
  void note_locked(char kind, ChunkId id);
  std::vector<ChunkId> evictable_locked(ChunkId requester) const;
  // Runs fn (which allocates on the device for chunk id); on OutOfMemoryError evicts the least
  // recently used evictable parameter chunk and retries, until fn succeeds or nothing is left.
  // bytes: what fn adds to the device (-1: the shard, when it is not on the device yet).
  void with_room_locked(ChunkId id, const std::function<void()>& fn, int64_t bytes = -1);
  void release_if_idle_locked(ChunkId id);
  void reduce_locked(ChunkSet& set);
  void communicate_grads_locked(ChunkSet& set);  // sharded: G's gathered buffer -> reduced shard
  void ungather_kept_locked(ChunkSet& set);
  // Sharded: a view of slot `slot` of chunk id, whole: the chunk's shards on `tier` all-gathered
  // on the compute device (cached until the next change or release_read_cache, so reading a
  // chunk's tensors gathers it once).
  at::Tensor whole_slot_locked(ChunkId id, size_t slot, Tier tier);
  // A view of a slot's whole value for the readers: whole_slot_locked sharded, slot_view otherwise.
  at::Tensor value_view_locked(ChunkId id, size_t slot, Tier tier);
  // The chunk and slot holding `kind` ("param", "exp_avg", "exp_avg_sq") of a parameter, with
  // its moves finished and the compute stream current.
  TensorHandle value_handle_locked(const std::string& kind, int param);
  int64_t device_bytes_needed_locked(ChunkId id, bool gather) const;
  void offload_grads_locked(ChunkSet& set);
  [[noreturn]] void throw_budget_exceeded(ChunkId id, size_t bytes);
  void check_module(int module) const;
  void check_param(int param) const;

  std::shared_ptr<DeviceContext> ctx_;
  ChunkManager& mgr_;
  std::vector<ChunkSet> sets_;
  std::vector<ParamSpec> params_;
  std::vector<int> set_of_p_chunk_;  // indexed by chunk id, -1 for companion chunks
  std::vector<int> forward_refs_;    // per parameter
  std::vector<uint8_t> backward_claimed_;  // per parameter: in COMPUTE for a pending backward
  std::vector<Module> modules_;
  std::vector<at::Tensor> watched_;          // the parameters themselves, by index (watch_params)
  std::vector<int64_t> watched_versions_;
  std::unique_ptr<ParamStorages> storages_;
  LruEviction lru_;
  AccessTrace trace_;
  int max_prefetch_ = 0;
  int64_t budget_bytes_ = 0;
  ChunkId last_accessed_ = -1;
  std::set<ChunkId> pinned_;
  Communicator* replicas_ = nullptr;
  ChunkId whole_cache_id_ = -1;  // whole_slot_locked's last gathered chunk
  at::Tensor whole_cache_;       // on the compute device, in the chunk's dtype
  std::vector<TimelineEvent> timeline_;
  size_t timeline_next_ = 0;  // ring buffer position once full
  std::chrono::steady_clock::time_point created_ = std::chrono::steady_clock::now();
  std::string policy_name_;
  EngineCounters counters_;
  bool no_sync_ = false;
  bool async_reduce_ = true;
  bool in_backward_ = false;
  OwnedMutex mutex_;
  int reclaimer_id_ = -1;  // registration with MemoryPressure
  struct PendingStep {
    std::shared_future<void> done;
    std::function<void()> complete;
    std::shared_ptr<double> seconds;  // written by the task
    std::function<bool()> eager;
  };
  std::map<int, PendingStep> pending_;  // by set index
  std::deque<int> pending_order_;       // launch order (forward order)
  double host_step_seconds_ = 0.0;
  bool overlap_optimizer_ = true;
  std::function<void(int)> grads_offloaded_hook_;
  void refresh_forward_order_locked();
  std::vector<int> forward_order_;     // sets_in_forward_order()
  std::vector<int64_t> forward_rank_;  // per set: its position there (the optimizer thread's priority)
  struct Gate {
    std::mutex mutex;
    std::condition_variable opened;
    bool held = false;
    int64_t delay_us = 0;
  };
  std::shared_ptr<Gate> gate_ = std::make_shared<Gate>();
  std::unique_ptr<SerialExecutor> optimizer_worker_;  // last: joined first, before the chunks go
};

}  // namespace gx::torch_layer
