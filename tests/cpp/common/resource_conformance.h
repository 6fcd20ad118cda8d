// One conformance suite for every MemoryResource (after RMM's mr tests): each resource of the
// project is instantiated with it, the cuda ones in tests/cpp/cuda.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "core/memory_resource.h"

namespace gx::testing {

struct ResourceFactory {
  std::string name;
  // Returns the resource to test; `keepalive` owns whatever it needs (upstreams).
  std::function<MemoryResource*(std::vector<std::shared_ptr<void>>& keepalive)> make;
  size_t max_bytes;  // largest request the resource accepts
};

class ResourceConformance : public ::testing::TestWithParam<ResourceFactory> {
 protected:
  // A factory returns null when its device is absent (no GPU): the test is skipped.
  void SetUp() override {
    mr_ = GetParam().make(keepalive_);
    if (mr_ == nullptr) GTEST_SKIP() << GetParam().name << ": device not present";
  }
  // Adaptors and pools are pushed after their upstreams: destroy them first.
  ~ResourceConformance() override {
    while (!keepalive_.empty()) keepalive_.pop_back();
  }
  std::vector<std::shared_ptr<void>> keepalive_;
  MemoryResource* mr_ = nullptr;
};

TEST_P(ResourceConformance, AllocateReturnsAlignedDistinctPointers) {
  const size_t bytes = std::min<size_t>(4096, GetParam().max_bytes);
  std::vector<void*> ptrs;
  std::set<void*> distinct;
  for (int i = 0; i < 8; ++i) {
    void* p = mr_->allocate(bytes);
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u) << "allocation not 64-byte aligned";
    distinct.insert(p);
    ptrs.push_back(p);
  }
  EXPECT_EQ(distinct.size(), ptrs.size());
  for (void* p : ptrs) mr_->deallocate(p, bytes);
}

TEST_P(ResourceConformance, ReuseAfterDeallocateWorks) {
  const size_t bytes = GetParam().max_bytes;
  for (int i = 0; i < 16; ++i) {
    void* p = mr_->allocate(bytes);
    ASSERT_NE(p, nullptr);
    mr_->deallocate(p, bytes);
  }
}

TEST_P(ResourceConformance, HasAName) { EXPECT_FALSE(mr_->name().empty()); }

}  // namespace gx::testing
