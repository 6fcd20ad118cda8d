#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "core/peak_window.h"

namespace gx {

TEST(PeakWindow, PeakIsTheLargestCountSinceTheWindowBegan) {
  PeakWindow w;
  w.begin(100);
  w.add(50);
  w.add(-120);
  w.add(10);
  EXPECT_EQ(w.current(), 40);
  EXPECT_EQ(w.peak(), 150);
  w.begin(w.current());  // a new window forgets the old peak
  EXPECT_EQ(w.peak(), 40);
  w.add(5);
  EXPECT_EQ(w.peak(), 45);
}

TEST(PeakWindow, ConcurrentAddsLoseNothing) {
  PeakWindow w;
  w.begin(0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 10000; ++i) {
        w.add(8);
        w.add(-8);
      }
      w.add(1);
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(w.current(), 4);
  EXPECT_GE(w.peak(), 8);
  EXPECT_LE(w.peak(), 4 * 8 + 4);
}

}  // namespace gx
