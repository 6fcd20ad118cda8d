#include "resource_adaptors.h"

#include "errors.h"

namespace gx {

Stat StatisticsAdaptor::bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return bytes_;
}

int64_t StatisticsAdaptor::live_allocations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return live_allocations_;
}

void* StatisticsAdaptor::do_allocate(size_t bytes) {
  void* ptr = upstream_.allocate(bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  bytes_.increase(static_cast<int64_t>(bytes));
  live_allocations_ += 1;
  return ptr;
}

void StatisticsAdaptor::do_deallocate(void* ptr, size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    GX_INTERNAL_ASSERT(live_allocations_ > 0, "deallocate without a live allocation on ", upstream_.name());
    bytes_.decrease(static_cast<int64_t>(bytes));
    live_allocations_ -= 1;
  }
  upstream_.deallocate(ptr, bytes);
}

LimitingAdaptor::LimitingAdaptor(MemoryResource& upstream, size_t limit_bytes, std::string knob)
    : upstream_(upstream), limit_bytes_(limit_bytes), knob_(std::move(knob)) {}

size_t LimitingAdaptor::used_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return used_bytes_;
}

void* LimitingAdaptor::do_allocate(size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (used_bytes_ + bytes > limit_bytes_) {
      throw OutOfMemoryError(detail::concat(
          upstream_.name(), " out of memory: tried to allocate ", bytes, " bytes with ", used_bytes_,
          " bytes in use of a limit of ", limit_bytes_, " bytes (", limit_bytes_ - used_bytes_,
          " free). Raise ", knob_, " or keep fewer chunks on this tier."));
    }
    used_bytes_ += bytes;
  }
  try {
    return upstream_.allocate(bytes);
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    used_bytes_ -= bytes;
    throw;
  }
}

void LimitingAdaptor::do_deallocate(void* ptr, size_t bytes) {
  upstream_.deallocate(ptr, bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  GX_INTERNAL_ASSERT(bytes <= used_bytes_, "LimitingAdaptor on ", upstream_.name(), " freed ", bytes,
                     " bytes with only ", used_bytes_, " in use");
  used_bytes_ -= bytes;
}

}  // namespace gx
