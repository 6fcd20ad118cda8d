// One conformance suite for every MemoryResource (after RMM's mr tests): each resource of the
// project is instantiated with it, the cuda ones in tests/cpp/cuda.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "core/host_pages.h"
#include "core/memory_resource.h"

namespace gx::testing {

struct ResourceFactory {
  std::string name;
  // Returns the resource to test; `keepalive` owns whatever it needs (upstreams).
  std::function<MemoryResource*(std::vector<std::shared_ptr<void>>& keepalive)> make;
  size_t max_bytes;  // largest request the resource accepts
  bool host = false;  // host memory: must not be inherited by forked children (core/host_pages.h)
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

// A forked child (a DataLoader worker) does not get the resource's host memory: the pages are
// absent there, so nothing the parent writes later is copied for the child. The child only makes
// system calls (mincore, _exit): safe after fork in a threaded process.
TEST_P(ResourceConformance, HostMemoryIsNotInheritedByForkedChildren) {
  if (!GetParam().host) GTEST_SKIP() << GetParam().name << ": not host memory";
  const size_t bytes = GetParam().max_bytes;
  auto* p = static_cast<unsigned char*>(mr_->allocate(bytes));
  p[0] = 1;
  p[bytes / 2] = 2;
  ASSERT_TRUE(host_page_mapped(p + bytes / 2));
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(host_page_mapped(p + bytes / 2) ? 1 : 0);  // 0: absent in the child, as wanted
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << GetParam().name << ": the child inherited the page at the middle of a "
                                    << bytes << "-byte allocation";
  EXPECT_EQ(p[bytes / 2], 2);  // the parent's pages are untouched
  mr_->deallocate(p, bytes);
}

TEST_P(ResourceConformance, HasAName) { EXPECT_FALSE(mr_->name().empty()); }

}  // namespace gx::testing
