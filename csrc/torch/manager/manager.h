// GeminiManager: the per-process runtime behind the engine's hooks. It decides nothing about
// placement (the policies do, in Python, and the eviction policy of csrc/core); it carries their
// decisions out on the ChunkManager, moves gradients into chunks, and keeps the books the
// optimizer needs.
//
// Rooms. One class owns the lock and every entry point; its files are named after their part:
//  * manager.cpp: construction, parameter views, the initial placement, the iteration end;
//  * manager_hooks.cpp: the hook bodies and the hook phase (core/hook_phase.h);
//  * manager_grads.cpp: gradient arrival, reduction (replicas included), offload, zero_grad;
//  * manager_values.cpp: reading and writing values (state dicts, checkpoints, close);
//  * manager_placement.cpp: the budget, memory-pressure reclaim, moving optimizer state, the
//    placements (the work is core/residency.h's);
//  * manager_optimizer.cpp: attaching the optimizer, its step and the optimizer pipeline
//    (core/optimizer_pipeline.h; the step itself is torch/optim/hybrid_optimizer.h).
// Residency, the optimizer and the pipeline are components: each receives what it works on at
// construction, has no lock of its own and is reached only through this class's entry points,
// which hold the lock while they call it (with_optimizer for the optimizer's own queries).
//
// Design note.
//  * Chunk sets (chunk_set.h): P with G, M and the optimizer rule's state chunks. Per set: where
//    the optimizer state lives (host: the CPU kernel; device: the device kernel) and P's home.
//  * Coherence. Every copy a chunk has holds the same bytes. For a set whose optimizer state is
//    on the host, P's host copy is permanent and always current (the CPU step writes it); its device
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
//  * Device budget, eviction, prefetch and parameter chunks homed on the host: core/residency.h.
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
//    mutex, private to this class, serialises every entry point. A memory-pressure callback
//    that arrives while this thread holds it declines (reclaim_device_bytes).
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/access_trace.h"
#include "core/chunk_manager.h"
#include "core/hook_phase.h"
#include "core/optimizer_pipeline.h"
#include "core/owned_mutex.h"
#include "core/residency.h"
#include "core/timeline.h"
#include "core/chunk_set.h"
#include "torch/chunk_views.h"
#include "torch/manager/param_storage.h"
#include "torch/optim/hybrid_optimizer.h"
#include "torch/optim/optimizer_rule.h"

namespace gx::torch_layer {

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

// What an iteration end reports (end_iteration): whether the iteration repeated the recorded
// access order, the counters so far, the highest chunk bytes on the device during the iteration
// and how often the trace was re-recorded. One call gives the tracer and the placer their figures.
struct IterationEnd {
  bool repeated = false;
  EngineCounters counters;
  int64_t device_bytes_peak = 0;
  int64_t trace_rerecordings = 0;
};

// What placement decided for a chunk set, as the manager carries it now.
struct SetPlacement {
  ChunkId param_chunk = -1;
  bool trainable = false;
  bool optim_on_host = false;
  bool param_home_on_host = false;
  bool keep_gathered = false;
  bool grad_stays_on_device = false;
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
  // since note_param_versions(). rebound_params() lists those whose `.data` no longer views the
  // storage it viewed when watched (model.half(), .to(dtype or device) replace it with a copy).
  void watch_params(std::vector<at::Tensor> params);
  std::vector<int> written_params() const;
  std::vector<int> rebound_params() const;
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
  bool in_backward() const { return phase_ == HookPhase::kBackward; }

  // Gradients.
  void zero_grad();
  // Sends gradients still on the device (accumulated under no_sync) to the optimizer's tier
  // (grad_norm_sq and optimizer_step do it first themselves).
  void flush_grads();
  void set_async_reduce(bool async) { async_reduce_ = async; }
  bool has_grad(int param);
  // HSDP (extra_dp_size): the ranks holding the same shard in the other replicas. Reduced
  // gradient shards are summed over them; gradients are pre-divided by the whole world size.
  void set_replica_communicator(Communicator* replicas);

  // Residency and placement.
  void set_max_prefetch(int max_prefetch) { residency_.set_max_prefetch(max_prefetch); }
  // The device bytes chunks may hold (0: the backend's capacity); lowering it evicts now.
  void set_device_budget(int64_t bytes);
  // Starts the copies of the chunks the next forward computes with first, as many as the budget
  // holds (Residency::prefetch_next_forward); returns how many started.
  int prefetch_next_forward();
  // engine.generating() where every parameter chunk fits: they stay on the device while the
  // module hooks are off (Residency::hold_params); false where one is not there (nothing held).
  bool hold_params_on_device();
  void release_params_on_device();
  int64_t device_budget() const;
  // Moves one set's optimizer state (master and states) between the host (CPU kernel) and the
  // device (device kernel), between steps. The policy decides; this carries it out.
  void set_optim_on_host(int set_index, bool on_host);
  // Whether a set's parameter chunk goes back to its host copy once the access stream moves on
  // (engine.generating() streams the sets that do not fit). Home on the host needs P's permanent
  // host copy (a set stepped on the host has one): without it, an InternalError.
  void set_param_home_on_host(int set_index, bool on_host);
  std::vector<SetPlacement> set_placements();
  // Memory pressure (the process-wide allocator, or a test): evicts chunks no tensor computes
  // on, then gives the device tier's free slots and extents back, until `bytes` were released.
  // Declines (returns 0) when this thread is inside the manager already, or another thread is.
  size_t reclaim_device_bytes(size_t bytes);
  void stop_reclaiming();  // no longer asked under memory pressure (the engine closed); idempotent

  // The iteration boundary (the optimizer step): closes the access trace (re-recorded if the
  // order changed) and reports the iteration's figures.
  IterationEnd end_iteration();
  // Generation (engine.generating()): forward-only passes keep an access trace of their own, each
  // pass an iteration, so that prefetch and eviction follow one pass's order and not training's;
  // training's trace is set aside untouched and comes back at the end.
  void begin_generation_trace();
  void end_generation_pass();  // a pass ends (the next one starts): closes its iteration
  void end_generation_trace();
  std::tuple<std::vector<ChunkId>, int64_t, int64_t, bool> trace_info();  // recorded, iterations, rerecordings, usable
  bool trace_diverged();  // this iteration left the recorded order: its end re-records it
  std::vector<TimelineEvent> timeline();
  EngineCounters counters();

  // The optimizer (hybrid_optimizer.h): one per manager, stepping with `rule`. Each trainable
  // set's state chunks of the rule's kinds (`state_chunks`, per set, in the rule's order; laid
  // out by the engine without memory) get their memory now, zeroed, where the set's optimizer
  // state lives. On failure nothing stays allocated and no optimizer is attached.
  void attach_optimizer(std::unique_ptr<OptimizerRule> rule, std::vector<int> group_of_param,
                        const std::vector<std::vector<ChunkId>>& state_chunks);
  // Of every gradient in the G chunks, over every rank when sharded; gradients still on the
  // device are flushed first.
  double grad_norm_sq();
  // Flushes gradients, then steps every set. When it returns with CPU steps still running, the
  // parameters of those sets refuse access (param_storage.h) until each is settled; before it a
  // speculative step changes nothing a parameter shows.
  void optimizer_step(const std::vector<HyperValues>& groups, double grad_multiplier);
  // The attached optimizer for one call under the lock: `fn(HybridOptimizer&)` (its speculation,
  // spares and last step's figures). UsageError when no optimizer is attached.
  template <class Fn>
  auto with_optimizer(Fn&& fn) {
    std::lock_guard<OwnedMutex> lock(mutex_);
    return fn(optimizer_locked());
  }

  // The optimizer pipeline (manager_optimizer.cpp).
  size_t pending_steps();
  void settle_all();
  // Off: every step settles before it returns (the serial step, for comparison).
  void set_overlap_optimizer(bool overlap) { pipeline_.set_overlap(overlap); }
  // Tests: while held, CPU steps wait before they start (so a test sees them pending); a delay
  // makes each one take that much longer (a slow host, deterministically).
  void hold_optimizer_thread(bool hold);
  void set_optimizer_task_delay_us(int64_t delay_us);

  // Values (fp32 on the CPU), for state_dict, checkpoints and close: the parameter's fp32 value
  // (kParam: the master, or P for frozen / fp32) or an optimizer state.
  at::Tensor read(StateKind kind, int param);
  // The same value as a new tensor of `dtype` on `device`, copied there from where the chunk is
  // (close() restores parameters to the GPU without a round trip through pageable host memory).
  at::Tensor read_to(StateKind kind, int param, at::Device device, at::ScalarType dtype);
  // The parameter's compute-dtype copy (its P chunk, not the fp32 master), from where P is current:
  // the values the forward computes with, without reading the master from host memory.
  at::Tensor read_compute_param_to(int param, at::Device device, at::ScalarType dtype);
  // Sharded reads keep the last gathered chunk on the compute device (a chunk's slots are read
  // one after another); readers release it when done so that it holds no device memory.
  void release_read_cache();
  // True once: the first time a read was served from values recomputed below an unjudged guess
  // (see [Note: reading a guessed set]); the bindings warn then.
  bool take_read_before_guess_note();
  void write(StateKind kind, int param, const at::Tensor& value);
  at::Tensor read_grad(int param);  // fp32 CPU copy of the gradient in its chunk (undefined if none)
  // The part of the value that lies in this rank's shard: (begin, end) element offsets into the
  // flattened tensor and an fp32 CPU copy of those elements (all of it unsharded). Local: no
  // collective (sharded checkpoints).
  std::tuple<int64_t, int64_t, at::Tensor> read_local(StateKind kind, int param);
  int64_t step_of(int param);
  void set_step(int param, int64_t step);
  void synchronize();

 private:
  struct Module {
    std::vector<int> params;
    std::vector<ChunkId> chunks;
  };
  bool sharded() const { return mgr_.sharded(); }
  int set_of_chunk(ChunkId p_chunk) const;

  at::Tensor slot_view(ChunkId id, size_t slot, Tier tier);
  void move_phase(HookEvent event) { phase_ = next_hook_phase(phase_, event); }
  // Fetches a module's chunks and puts its tensors in COMPUTE (forward: counted references;
  // backward: claimed until their gradient or post-backward).
  void fetch_for_compute_locked(const Module& m, bool forward);

  void note_locked(char kind, ChunkId id) { residency_.note(kind, id); }

  // Gradients (manager_grads.cpp).
  void reduce_locked(ChunkSet& set);
  void communicate_grads_locked(ChunkSet& set);  // sharded: G's gathered buffer -> reduced shard
  void offload_grads_locked(ChunkSet& set);
  void flush_grads_locked();

  // Values (manager_values.cpp).
  // Frees the chunk whole_slot_locked gathered last (its device memory goes back at once).
  void drop_whole_cache_locked() {
    whole_cache_id_ = -1;
    whole_cache_ = at::Tensor();
  }
  // Sharded: a view of slot `slot` of chunk id, whole: the chunk's shards on `tier` all-gathered
  // on the compute device (cached until the next change or release_read_cache, so reading a
  // chunk's tensors gathers it once).
  at::Tensor whole_slot_locked(ChunkId id, size_t slot, Tier tier);
  // A view of a slot's whole value for the readers: whole_slot_locked sharded, slot_view otherwise.
  at::Tensor value_view_locked(ChunkId id, size_t slot, Tier tier);
  // The chunk and slot holding `kind` of a parameter, with its moves finished and the compute
  // stream current; every pending step settled except the guesses kept for reads.
  TensorHandle value_handle_locked(StateKind kind, int param);
  // A reader's copy of slot `h` read from `tier`: the values before the guess where an unjudged
  // guess of its set wrote them (see [Note: reading a guessed set]).
  at::Tensor before_guess_locked(int param, const TensorHandle& h, Tier tier, at::Tensor copy);

  // The optimizer pipeline (manager_optimizer.cpp).
  void settle_locked(int set_index) { pipeline_.settle(set_index); }
  void settle_all_locked() { pipeline_.settle_all(); }
  void refresh_forward_order_locked();
  HybridOptimizer& optimizer_locked();
  void check_companion_layout(ChunkId param, ChunkId companion) const;  // InternalError if not P's layout
  void allocate_state_chunks_locked(const std::vector<StateKind>& kinds,
                                    const std::vector<std::vector<ChunkId>>& state_chunks);

  EngineCounters counters_locked() const;  // with the pipeline's waits
  void check_module(int module) const;
  void check_param(int param) const;
  void check_set(int set_index) const;

  std::shared_ptr<DeviceContext> ctx_;
  ChunkManager& mgr_;
  std::vector<ChunkSet> sets_;
  // Per set: the sum of squares of G's (shard's) gradients, fp32 on the device, taken when G left
  // for the host; undefined once G changes there (a later backward adds into the host copy) or is
  // cleared. The optimizer reads it for the norm.
  std::vector<at::Tensor> grad_sq_;
  std::vector<ParamSpec> params_;
  std::vector<int> set_of_p_chunk_;  // indexed by chunk id, -1 for companion chunks
  std::vector<int> forward_refs_;    // per parameter
  std::vector<uint8_t> backward_claimed_;  // per parameter: in COMPUTE for a pending backward
  std::vector<Module> modules_;
  std::vector<at::Tensor> watched_;          // the parameters themselves, by index (watch_params)
  std::vector<int64_t> watched_versions_;
  std::vector<const c10::StorageImpl*> watched_storages_;  // what each watched parameter viewed
  std::unique_ptr<ParamStorages> storages_;
  AccessTrace trace_;
  AccessTrace set_aside_trace_;  // training's while generating, generation's otherwise
  bool generating_ = false;
  Communicator* replicas_ = nullptr;
  ChunkId whole_cache_id_ = -1;  // whole_slot_locked's last gathered chunk
  at::Tensor whole_cache_;       // on the compute device, in the chunk's dtype
  Timeline timeline_;
  std::string policy_name_;  // for out-of-memory messages
  EngineCounters counters_;
  HookPhase phase_ = HookPhase::kIdle;
  bool no_sync_ = false;
  bool read_before_guess_noted_ = false;
  bool async_reduce_ = true;
  OwnedMutex mutex_;
  int reclaimer_id_ = -1;  // registration with MemoryPressure
  ForwardOrder forward_order_;  // recomputed when an iteration ends; the optimizer reads it
  // Last: destroyed first (the optimizer settles its speculative steps, then the pipeline lets
  // every CPU step finish), before the chunks go.
  OptimizerPipeline pipeline_;
  Residency residency_;
  std::unique_ptr<HybridOptimizer> optimizer_;
};

}  // namespace gx::torch_layer
