// Adaptors over a MemoryResource: statistics and a byte limit.
//
// Design note. Each adaptor wraps an upstream it does not own and adds exactly one behaviour.
//  * StatisticsAdaptor counts the bytes that went through it in a Stat (current, peak,
//    allocated, freed) and the number of live allocations; thread-safe.
//  * LimitingAdaptor refuses any allocation that would take the bytes it has handed out past
//    `limit_bytes`, with an OutOfMemoryError that names the tier, the request, what is in use,
//    the limit and the knob to turn. The `sim` device is a host resource under such a limit.
#pragma once

#include <mutex>
#include <string>

#include "memory_resource.h"
#include "stat.h"

namespace gx {

class StatisticsAdaptor final : public MemoryResource {
 public:
  explicit StatisticsAdaptor(MemoryResource& upstream) : upstream_(upstream) {}
  std::string name() const override { return upstream_.name(); }
  Stat bytes() const;
  int64_t live_allocations() const;

 protected:
  void* do_allocate(size_t bytes) override;
  void do_deallocate(void* ptr, size_t bytes) override;

 private:
  MemoryResource& upstream_;
  mutable std::mutex mutex_;
  Stat bytes_;
  int64_t live_allocations_ = 0;
};

class LimitingAdaptor final : public MemoryResource {
 public:
  // `knob` tells the user what to change when the limit is hit (e.g. "sim_capacity").
  LimitingAdaptor(MemoryResource& upstream, size_t limit_bytes, std::string knob);
  std::string name() const override { return upstream_.name(); }
  size_t limit_bytes() const { return limit_bytes_; }
  size_t used_bytes() const;

 protected:
  void* do_allocate(size_t bytes) override;
  void do_deallocate(void* ptr, size_t bytes) override;

 private:
  MemoryResource& upstream_;
  size_t limit_bytes_;
  std::string knob_;
  mutable std::mutex mutex_;
  size_t used_bytes_ = 0;
};

}  // namespace gx
