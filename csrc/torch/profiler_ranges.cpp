// ProfilerRanges: each range is an at::RecordFunction of the user scope, which torch.profiler
// records with the thread it ran on. A worker thread runs a launched task under the launching
// thread's record-function callbacks and debug info (where the profiler keeps its state), as
// torch's own thread pools do, and under nothing else of that thread's state (grad mode,
// autocast, dispatch keys): the task must not change behaviour because a profiler watches.
#include "torch/profiler_ranges.h"

#include <ATen/record_function.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <memory>
#include <string>
#include <utility>

namespace gx::torch_layer {

namespace {

struct OpenRange {
  std::string name;  // the range's own copy while it is open
  at::RecordFunction record{at::RecordScope::USER_SCOPE};
  explicit OpenRange(std::string n) : name(std::move(n)) {
    if (record.isActive()) record.before(std::string_view(name));
  }
};

// Puts a captured thread's profiler state in place on this thread until destroyed.
class ProfilerStateGuard {
 public:
  ProfilerStateGuard(const at::RecordFunctionTLS& tls, std::shared_ptr<c10::ThreadLocalDebugInfo> info)
      : saved_(at::get_record_function_tls_()), info_(std::move(info)) {
    at::set_record_function_tls_(tls);
  }
  ~ProfilerStateGuard() { at::set_record_function_tls_(saved_); }

 private:
  at::RecordFunctionTLS saved_;
  c10::DebugInfoGuard info_;
};

class ProfilerRanges final : public TraceRanges {
 public:
  bool active() const override { return at::hasCallbacks(); }

  std::shared_ptr<void> open(const std::string& name) override { return std::make_shared<OpenRange>(name); }

  std::function<void()> traced(const std::string& name, std::function<void()> work) override {
    return [name, work = std::move(work), tls = at::get_record_function_tls_(),
            info = c10::ThreadLocalDebugInfo::current()] {
      ProfilerStateGuard state(tls, info);
      OpenRange range(name);
      work();
    };
  }
};

}  // namespace

TraceRanges& profiler_ranges() {
  static auto* ranges = new ProfilerRanges();  // never destroyed: managers may outlive static destruction
  return *ranges;
}

}  // namespace gx::torch_layer
