// The manager's torch-free parts: the hook phase table, the timeline ring, the optimizer pipeline and
// its named ranges.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/errors.h"
#include "core/hook_phase.h"
#include "core/optimizer_pipeline.h"
#include "core/timeline.h"
#include "core/trace_ranges.h"

namespace gx {

TEST(HookPhase, FollowsAnIterationAndARecomputationInsideBackward) {
  HookPhase p = HookPhase::kIdle;
  for (HookEvent e : {HookEvent::kPreForward, HookEvent::kPostForward}) p = next_hook_phase(p, e);
  EXPECT_EQ(p, HookPhase::kForward);
  p = next_hook_phase(p, HookEvent::kPreBackward);
  EXPECT_EQ(p, HookPhase::kBackward);
  // activation checkpointing re-runs a forward inside backward: still backward
  for (HookEvent e : {HookEvent::kPreForward, HookEvent::kPostForward, HookEvent::kGradArrived,
                      HookEvent::kPostBackward})
    p = next_hook_phase(p, e);
  EXPECT_EQ(p, HookPhase::kBackward);
  p = next_hook_phase(p, HookEvent::kEndBackward);
  EXPECT_EQ(p, HookPhase::kIdle);
  EXPECT_EQ(next_hook_phase(HookPhase::kForward, HookEvent::kEndIteration), HookPhase::kIdle);
  EXPECT_EQ(next_hook_phase(HookPhase::kBackward, HookEvent::kEndIteration), HookPhase::kBackward);
}

TEST(HookPhase, APostForwardWithoutAForwardIsABug) {
  try {
    next_hook_phase(HookPhase::kIdle, HookEvent::kPostForward);
    FAIL() << "expected InternalError";
  } catch (const InternalError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("post_forward"), std::string::npos) << what;
    EXPECT_NE(what.find("idle"), std::string::npos) << what;
  }
}

TEST(Timeline, KeepsTheNewestEventsOldestFirstOnceFull) {
  Timeline t(3);
  for (int i = 0; i < 5; ++i) t.note('F', i, 100 * i);
  const auto events = t.events();
  ASSERT_EQ(events.size(), 3u);
  for (size_t k = 0; k < 3; ++k) {
    EXPECT_EQ(events[k].chunk, static_cast<ChunkId>(k + 2));
    EXPECT_EQ(events[k].device_bytes, static_cast<int64_t>(100 * (k + 2)));
  }
  EXPECT_LE(events[0].seconds, events[2].seconds);
}

TEST(Timeline, KeepsThePeakOfTheLastIterationApartFromTheRing) {
  Timeline t(2);  // smaller than an iteration: the ring drops events, the peak does not
  EXPECT_EQ(t.last_iteration_peak_bytes(), 0);
  for (int64_t b : {300, 900, 100}) t.note('F', 0, b);
  t.note('S', -1, 5000);  // an iteration end's own bytes are not the iteration's
  EXPECT_EQ(t.last_iteration_peak_bytes(), 900);
  t.note('E', 1, 200);
  t.note('S', -1, 200);
  EXPECT_EQ(t.last_iteration_peak_bytes(), 200);
  t.note('S', -1, 0);
  EXPECT_EQ(t.last_iteration_peak_bytes(), 0) << "an iteration without events";
}

TEST(OptimizerPipeline, WithOverlapOffEveryLaunchIsSettledBeforeItReturns) {
  std::vector<int> settled;
  OptimizerPipeline pipe([&](int s) { settled.push_back(s); }, [](int s) { return "set " + std::to_string(s); });
  pipe.set_overlap(false);
  bool computed = false;
  pipe.launch(4, [&] { computed = true; }, [] {}, nullptr, 0);
  EXPECT_TRUE(computed);
  EXPECT_FALSE(pipe.pending(4));
  EXPECT_EQ(settled, (std::vector<int>{4}));
}

TEST(OptimizerPipeline, SettlesInLaunchOrderAndCompletesOnTheSettlingThread) {
  std::vector<int> settled;
  OptimizerPipeline pipe([&](int s) { settled.push_back(s); }, [](int s) { return "set " + std::to_string(s); });
  std::atomic<int> computed{0};
  std::thread::id completer;
  pipe.hold(true);  // nothing starts: both stay pending
  for (int s : {3, 1})
    pipe.launch(s, [&] { computed += 1; }, [&] { completer = std::this_thread::get_id(); }, nullptr, s);
  EXPECT_TRUE(pipe.pending(3) && pipe.pending(1));
  EXPECT_FALSE(pipe.try_settle(3)) << "held: not finished";
  pipe.hold(false);
  pipe.settle_all();
  EXPECT_EQ(computed.load(), 2);
  EXPECT_EQ(settled, (std::vector<int>{3, 1}));
  EXPECT_EQ(completer, std::this_thread::get_id());
  EXPECT_EQ(pipe.pending_count(), 0u);
  EXPECT_GE(pipe.waits(), 0);
}

TEST(OptimizerPipeline, LeavesAStepThatMayNotBeSettledEagerlyAndRethrowsAFailureNamingTheSet) {
  std::vector<int> settled;
  OptimizerPipeline pipe([&](int s) { settled.push_back(s); }, [](int s) { return "set " + std::to_string(s); });
  bool confirmed = false;
  pipe.launch(0, [] {}, [] {}, [&] { return confirmed; }, 0);
  pipe.drain();
  pipe.settle_finished();
  EXPECT_TRUE(pipe.pending(0)) << "speculative and unconfirmed: not settled eagerly";
  confirmed = true;
  pipe.settle_finished();
  EXPECT_FALSE(pipe.pending(0));
  pipe.launch(7, [] { throw std::runtime_error("disk on fire"); }, [] {}, nullptr, 0);
  try {
    pipe.settle(7);
    FAIL() << "expected InternalError";
  } catch (const InternalError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("set 7"), std::string::npos) << what;
    EXPECT_NE(what.find("disk on fire"), std::string::npos) << what;
  }
  EXPECT_EQ(settled, (std::vector<int>{0}));
}

// Records each range's name, thread and order of opening and closing.
class RecordedRanges final : public TraceRanges {
 public:
  struct Range {
    std::string name;
    std::thread::id thread;
    int opened = -1, closed = -1;  // positions in one clock of events
  };
  bool active() const override { return true; }
  std::shared_ptr<void> open(const std::string& name) override {
    const size_t k = begin(name);
    return std::shared_ptr<void>(nullptr, [this, k](void*) { end(k); });
  }
  std::function<void()> traced(const std::string& name, std::function<void()> work) override {
    return [this, name, work = std::move(work)] {
      const size_t k = begin(name);
      work();
      end(k);
    };
  }
  std::vector<Range> ranges() {
    std::lock_guard<std::mutex> lock(mutex_);
    return ranges_;
  }

 private:
  size_t begin(const std::string& name) {
    std::lock_guard<std::mutex> lock(mutex_);
    ranges_.push_back({name, std::this_thread::get_id(), clock_++, -1});
    return ranges_.size() - 1;
  }
  void end(size_t k) {
    std::lock_guard<std::mutex> lock(mutex_);
    ranges_[k].closed = clock_++;
  }
  std::mutex mutex_;
  std::vector<Range> ranges_;
  int clock_ = 0;
};

TEST(OptimizerPipeline, NamesEachStepOnItsLanesThreadAndEachWaitOnTheCallersAroundIt) {
  RecordedRanges recorded;
  OptimizerPipeline pipe([](int) {}, [](int s) { return "set " + std::to_string(s); });
  pipe.set_trace_ranges(recorded);
  pipe.hold(true);  // the settle below finds the step not started: it waits
  pipe.launch(5, [] {}, [] {}, nullptr, 0, StepLane::kCpu, "guess");
  pipe.launch(6, [] {}, [] {}, nullptr, 1, StepLane::kLink);
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    pipe.hold(false);
  });
  pipe.settle(5);
  opener.join();
  pipe.settle_all();
  std::vector<RecordedRanges::Range> ranges = recorded.ranges();
  auto find = [&](const std::string& name) {
    for (const auto& r : ranges)
      if (r.name == name) return r;
    ADD_FAILURE() << "no range named " << name;
    return RecordedRanges::Range{};
  };
  const auto step = find("gx.cpu guess set 5"), link = find("gx.link step set 6"), wait = find("gx.wait set 5");
  EXPECT_NE(step.thread, std::this_thread::get_id()) << "a step runs on its lane's thread";
  EXPECT_NE(link.thread, step.thread) << "each lane has its thread";
  EXPECT_EQ(wait.thread, std::this_thread::get_id()) << "the caller waits";
  EXPECT_LT(wait.opened, step.opened);
  EXPECT_LT(step.closed, wait.closed) << "the wait ends after the step it waited for";
  for (const auto& r : ranges) EXPECT_GT(r.closed, r.opened) << r.name << " left open";
}

}  // namespace gx
