// ThreadCommunicator: the Communicator of N ranks that are threads of one process, for tests.
//
// Every rank's buffers are host memory (sim's device tier), so a collective is a rendezvous:
// each rank posts its pointers, waits until all ranks have, computes its own result from the
// others' buffers, and waits again so that no rank reuses a buffer another still reads. Calls
// are collective and must match in order and size, as with NCCL or gloo; a mismatch in kind or
// size throws instead of hanging silently on the next call.
#pragma once

#include <algorithm>
#include <barrier>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/communicator.h"
#include "core/kernels/half_convert.h"

namespace gx::testing {

class ThreadGroup {
 public:
  explicit ThreadGroup(int world_size) : world_size_(world_size), sync_(world_size), posts_(world_size) {}
  int world_size() const { return world_size_; }

  struct Post {
    std::string kind;
    const void* src = nullptr;
    int64_t numel = 0;
  };
  // Posts this rank's input, waits for every rank; returns every rank's post.
  const std::vector<Post>& exchange(int rank, Post post) {
    posts_[static_cast<size_t>(rank)] = std::move(post);
    sync_.arrive_and_wait();
    for (const auto& p : posts_) {
      if (p.kind != posts_[0].kind || p.numel != posts_[0].numel)
        throw std::runtime_error("ThreadCommunicator: mismatched collectives: rank 0 called " + posts_[0].kind +
                                 " of " + std::to_string(posts_[0].numel) + ", another " + p.kind + " of " +
                                 std::to_string(p.numel));
    }
    return posts_;
  }
  void done() { sync_.arrive_and_wait(); }
  int64_t calls = 0;  // written by rank 0 only

 private:
  int world_size_;
  std::barrier<> sync_;
  std::vector<Post> posts_;
};

class ThreadCommunicator final : public Communicator {
 public:
  // backend: when given, a call on a side stream first waits for that stream's queued work (the
  // stream order of the Communicator contract; sim streams are worker threads).
  ThreadCommunicator(std::shared_ptr<ThreadGroup> group, int rank, DeviceBackend* backend = nullptr)
      : group_(std::move(group)), rank_(rank), backend_(backend) {}
  int world_size() const override { return group_->world_size(); }
  int rank() const override { return rank_; }
  std::string name() const override { return "threads"; }

  void all_gather(const void* shard, void* full, int64_t shard_numel, DType dtype, StreamKind stream) override {
    order_after(stream);
    const size_t bytes = static_cast<size_t>(shard_numel) * element_size_bytes(dtype);
    const auto& posts = group_->exchange(rank_, {"all_gather", shard, shard_numel});
    for (int r = 0; r < world_size(); ++r)
      std::memcpy(static_cast<uint8_t*>(full) + static_cast<size_t>(r) * bytes, posts[static_cast<size_t>(r)].src,
                  bytes);
    finish();
  }

  void reduce_scatter(const void* full, void* shard, int64_t shard_numel, DType dtype, ReduceOp op,
                      StreamKind stream) override {
    order_after(stream);
    const auto& posts = group_->exchange(rank_, {"reduce_scatter", full, shard_numel});
    const int64_t begin = rank_ * shard_numel;
    reduce_into(posts, begin, shard, shard_numel, dtype, op);
    finish();
  }

  void all_reduce(void* data, int64_t numel, DType dtype, ReduceOp op, StreamKind stream) override {
    order_after(stream);
    std::vector<uint8_t> result(static_cast<size_t>(numel) * element_size_bytes(dtype));
    const auto& posts = group_->exchange(rank_, {"all_reduce", data, numel});
    reduce_into(posts, 0, result.data(), numel, dtype, op);
    group_->done();  // everyone has read every input before anyone overwrites its own
    std::memcpy(data, result.data(), result.size());
    finish();
  }

 private:
  void order_after(StreamKind stream) {
    if (backend_ != nullptr && stream != StreamKind::kCompute) backend_->synchronize(stream);
  }
  void finish() {
    if (rank_ == 0) group_->calls += 1;
    group_->done();
  }
  static void reduce_into(const std::vector<ThreadGroup::Post>& posts, int64_t begin, void* out, int64_t numel,
                          DType dtype, ReduceOp op) {
    for (int64_t i = 0; i < numel; ++i) {
      float acc = 0.0f;
      for (size_t r = 0; r < posts.size(); ++r) {
        const float v = load(posts[r].src, begin + i, dtype);
        acc = (r == 0) ? v : (op == ReduceOp::kSum ? acc + v : std::max(acc, v));
      }
      store(out, i, dtype, acc);
    }
  }
  static float load(const void* p, int64_t i, DType dtype) {
    if (dtype == DType::kFloat32) return static_cast<const float*>(p)[i];
    if (dtype == DType::kBFloat16) return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    throw std::runtime_error("ThreadCommunicator: dtype " + std::string(to_string(dtype)) + " not supported");
  }
  static void store(void* p, int64_t i, DType dtype, float v) {
    if (dtype == DType::kFloat32) static_cast<float*>(p)[i] = v;
    else static_cast<uint16_t*>(p)[i] = float_to_bf16(v);
  }

  std::shared_ptr<ThreadGroup> group_;
  int rank_;
  DeviceBackend* backend_;
};

}  // namespace gx::testing
