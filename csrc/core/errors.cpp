#include "errors.h"

namespace gx::detail {

void throw_internal(const char* file, int line, const char* cond, const std::string& msg) {
  throw InternalError(concat("gemini_ext internal error (this is a bug, please report it): ", msg,
                             " [", cond, " failed at ", file, ":", line, "]"));
}

}  // namespace gx::detail
