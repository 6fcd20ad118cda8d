// Errors of the gemini_ext core.
//
// Design note: two kinds of failure, never mixed up.
//  * A caller's mistake (bad size, unknown tensor, budget too small) throws a subclass of
//    UsageError whose message names the thing, the expected and the actual value and the fix.
//    GX_CHECK builds such messages.
//  * A broken invariant (a state the code should never reach) throws InternalError, whose
//    message says that this is a bug. GX_INTERNAL_ASSERT builds those. Illegal TensorState
//    transitions are invariant failures of the scheduler, so they throw IllegalTransition,
//    an InternalError carrying the chunk id, the tensor and both states.
// The bindings map UsageError to ValueError, OutOfMemoryError to torch.OutOfMemoryError-like
// RuntimeError and InternalError to RuntimeError.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace gx {

class UsageError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A tier cannot hold what was asked of it (the sim device's capacity, a cudaMalloc failure).
class OutOfMemoryError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class InternalError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}
[[noreturn]] void throw_internal(const char* file, int line, const char* cond, const std::string& msg);
}  // namespace detail

}  // namespace gx

// Caller mistake: GX_CHECK(cond, "what", ...). The message should say expected, actual and fix.
#define GX_CHECK(cond, ...)                                         \
  do {                                                              \
    if (!(cond)) throw ::gx::UsageError(::gx::detail::concat(__VA_ARGS__)); \
  } while (0)

// Invariant: a failure is a bug of gemini_ext.
#define GX_INTERNAL_ASSERT(cond, ...)                                                    \
  do {                                                                                   \
    if (!(cond))                                                                         \
      ::gx::detail::throw_internal(__FILE__, __LINE__, #cond, ::gx::detail::concat("", ##__VA_ARGS__)); \
  } while (0)
