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
// The bindings map UsageError to ValueError, OutOfMemoryError and InternalError to RuntimeError.
//
// Messages are built by detail::concat without iostreams: inside the extension (torch 2.11
// CUDA builds, GCC 13), formatting an integer through std::ostringstream has crashed in
// std::ostream::operator<<(long); to_string and snprintf do not touch the stream locale
// machinery.
#pragma once

#include <cstdio>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

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
inline void append_to(std::string& out, std::string_view text) { out.append(text); }
inline void append_to(std::string& out, const char* text) { out.append(text != nullptr ? text : "(null)"); }
inline void append_to(std::string& out, char c) { out.push_back(c); }
inline void append_to(std::string& out, bool b) { out.append(b ? "true" : "false"); }
template <typename T>
std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> && !std::is_same_v<T, char>> append_to(
    std::string& out, T value) {
  out.append(std::to_string(value));
}
template <typename T>
std::enable_if_t<std::is_floating_point_v<T>> append_to(std::string& out, T value) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(value));
  out.append(buf);
}
template <typename T>
std::enable_if_t<std::is_enum_v<T>> append_to(std::string& out, T value) {
  out.append(std::to_string(static_cast<long long>(value)));
}

template <typename... Args>
std::string concat(const Args&... args) {
  std::string out;
  (append_to(out, args), ...);
  return out;
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
