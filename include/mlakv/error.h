// mlakv: the one exception type of the library, and the check macros that raise it.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace mlakv {

// Every error the library reports is an mlakv::Error. Argument errors name the argument, what was
// expected and what was given; backend errors name the failing call. what() starts with
// "file:line: ".
class Error : public std::runtime_error {
 public:
  Error(const char* file, int line, const std::string& message);
  // The message without the "file:line: " prefix.
  const std::string& message() const noexcept { return message_; }

 private:
  std::string message_;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace mlakv

// MLAKV_CHECK(cond, parts...): throws mlakv::Error with the streamed parts when cond is false.
#define MLAKV_CHECK(cond, ...)                                                        \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      throw ::mlakv::Error(__FILE__, __LINE__, ::mlakv::detail::concat(__VA_ARGS__)); \
    }                                                                                 \
  } while (0)

#define MLAKV_FAIL(...) \
  throw ::mlakv::Error(__FILE__, __LINE__, ::mlakv::detail::concat(__VA_ARGS__))
