#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include "core/serial_executor.h"

namespace gx {

TEST(SerialExecutor, RunsTasksInSubmissionOrderOffTheCallingThread) {
  SerialExecutor ex;
  std::vector<int> order;
  std::thread::id runner;
  std::vector<std::shared_future<void>> done;
  for (int i = 0; i < 50; ++i)
    done.push_back(ex.submit([&, i] {
      runner = std::this_thread::get_id();
      order.push_back(i);  // one task at a time: no lock needed
    }));
  for (auto& f : done) f.get();
  ASSERT_EQ(order.size(), 50u);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(order[static_cast<size_t>(i)], i);
  EXPECT_NE(runner, std::this_thread::get_id());
  EXPECT_EQ(ex.queued(), 0u);
}

TEST(SerialExecutor, PicksTheMostUrgentQueuedTaskEachTime) {
  SerialExecutor ex;
  std::atomic<bool> release{false};
  std::vector<int> order;
  ex.submit([&] {  // occupies the thread while the others queue
    while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  for (int p : {5, 3, 9, 3, 0}) ex.submit([&order, p] { order.push_back(p); }, p);
  release = true;
  ex.drain();
  EXPECT_EQ(order, (std::vector<int>{0, 3, 3, 5, 9}));  // by priority; the two 3s in submission order
}

TEST(SerialExecutor, SubmitReturnsBeforeTheTaskRuns) {
  SerialExecutor ex;
  std::atomic<bool> release{false};
  std::atomic<int> ran{0};
  auto first = ex.submit([&] {
    while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ran += 1;
  });
  auto second = ex.submit([&] { ran += 1; });
  EXPECT_EQ(ran.load(), 0);
  EXPECT_EQ(ex.queued(), 2u);
  EXPECT_EQ(second.wait_for(std::chrono::milliseconds(20)), std::future_status::timeout);
  release = true;
  second.get();
  EXPECT_EQ(ran.load(), 2);
}

TEST(SerialExecutor, AnExceptionReachesThatTasksFutureAndLaterTasksStillRun) {
  SerialExecutor ex;
  auto bad = ex.submit([] { throw std::runtime_error("chunk 3 failed"); });
  bool later_ran = false;
  auto good = ex.submit([&] { later_ran = true; });
  try {
    bad.get();
    FAIL() << "the task's exception was not rethrown";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "chunk 3 failed");
  }
  good.get();
  EXPECT_TRUE(later_ran);
}

TEST(SerialExecutor, DrainAndDestructionWaitForEverythingQueued) {
  std::atomic<int> ran{0};
  {
    SerialExecutor ex;
    for (int i = 0; i < 10; ++i)
      ex.submit([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        ran += 1;
      });
    ex.drain();
    EXPECT_EQ(ran.load(), 10);
    for (int i = 0; i < 5; ++i) ex.submit([&] { ran += 1; });
  }  // the destructor runs the five queued tasks before joining
  EXPECT_EQ(ran.load(), 15);
}

}  // namespace gx
