// mlakv::Error: the one exception type of the library.
#include "mlakv/error.h"

#include <cstring>
#include <string>

namespace mlakv {
namespace {

// __FILE__ may be an absolute build path; the basename is what a reader of the message needs.
const char* file_basename(const char* file) {
  if (file == nullptr) return "?";
  const char* base = file;
  for (const char* p = file; *p != '\0'; ++p) {
    if (*p == '/' || *p == '\\') base = p + 1;
  }
  return base;
}

}  // namespace

Error::Error(const char* file, int line, const std::string& message)
    : std::runtime_error(std::string(file_basename(file)) + ":" + std::to_string(line) + ": " +
                         message),
      message_(message) {}

}  // namespace mlakv
