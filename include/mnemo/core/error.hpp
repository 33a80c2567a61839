#pragma once
// mnemo::error: the one exception type mnemo throws for bad input, bad settings and bad files.
// Messages start with "mnemo:" and name the file, tensor or parameter at fault.
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace mnemo {

class error : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

namespace detail {
/// Throws E (mnemo::error or a type derived from it) with "mnemo: " and the parts of the message.
template <class E, class... Args>
[[noreturn]] inline void fail_as(Args&&... args) {
    std::ostringstream os;
    os << "mnemo: ";
    (os << ... << std::forward<Args>(args));
    throw E(os.str());
}
template <class... Args>
[[noreturn]] inline void fail(Args&&... args) {
    fail_as<error>(std::forward<Args>(args)...);
}
}  // namespace detail

}  // namespace mnemo

// MNEMO_CHECK(condition, parts of the message...): throws mnemo::error when condition is false.
#define MNEMO_CHECK(cond, ...)                                  \
    do {                                                        \
        if (!(cond)) ::mnemo::detail::fail(__VA_ARGS__);        \
    } while (0)
