// Error and warning messages built without iostreams.
//
// Note [no streams in _C]
// ~~~~~~~~~~~~~~~~~~~~~~~
// TORCH_CHECK(cond, "got ", n) formats its arguments with c10::str, an
// std::ostringstream instantiated in *our* translation unit. When the
// extension ends up with libstdc++'s locale and stream code of its own (a
// compiler that links libstdc++ statically, LDFLAGS=-static-libstdc++), that
// copy runs against the process's shared libstdc++: facets are looked up by
// ids of the other copy, and a stream read or write crashes in codecvt or
// silently fails (the first GPU machine: registering torch's PowerSGD hook
// segfaulted in `operator>>(int&)`; pytorch/pytorch#109923 is the same fault).
// setup.py links the shared libstdc++ that torch loaded and refuses a module
// that still defines stream or locale code (python/fastddp/_libstdcxx.py);
// this header is the second line: fastddp's own messages are concatenated
// with std::to_chars, and the message reaches c10 as one std::string, which
// c10::str passes through untouched. tests/python/install/test_no_streams.py keeps
// streams and the TORCH_CHECK family out of csrc/.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <charconv>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace fastddp {
namespace message_detail {

inline void append(std::string& out, std::string_view s) { out.append(s); }
inline void append(std::string& out, const std::string& s) { out.append(s); }
inline void append(std::string& out, const char* s) { out.append(s ? s : "(null)"); }
inline void append(std::string& out, char c) { out.push_back(c); }
// As an ostream without std::boolalpha prints it.
inline void append(std::string& out, bool b) { out.push_back(b ? '1' : '0'); }

// Integers and floating point through std::to_chars: no locale, no stream.
// Floating point prints the shortest form that reads back to the same value.
template <class T, std::enable_if_t<std::is_arithmetic_v<T> && !std::is_same_v<T, bool> &&
                                        !std::is_same_v<T, char>,
                                    int> = 0>
void append(std::string& out, T value) {
  char buffer[64];
  const std::to_chars_result r = std::to_chars(buffer, buffer + sizeof(buffer), value);
  out.append(buffer, r.ptr);
}

inline void append(std::string& out, c10::ScalarType type) { out.append(c10::toString(type)); }
inline void append(std::string& out, c10::Device device) { out.append(device.str()); }

// "[2, 3]", as c10 prints an IntArrayRef.
inline void append(std::string& out, c10::IntArrayRef values) {
  out.push_back('[');
  for (size_t i = 0; i < values.size(); ++i) {
    if (i) out.append(", ");
    append(out, values[i]);
  }
  out.push_back(']');
}

}  // namespace message_detail

// The arguments one after another, as c10::str would print them.
template <class... Args>
std::string cat(const Args&... args) {
  std::string out;
  (message_detail::append(out, args), ...);
  return out;
}

// The items with `separator` between them; `quote` around each.
inline std::string join(const std::vector<std::string>& items, std::string_view separator,
                        std::string_view quote = "") {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out.append(separator);
    out.append(quote).append(items[i]).append(quote);
  }
  return out;
}

}  // namespace fastddp

// TORCH_CHECK and its kin with the message made by fastddp::cat (Note [no
// streams in _C]); the message is built only when the check fails.
#define FASTDDP_CHECK(cond, ...) TORCH_CHECK(cond, ::fastddp::cat(__VA_ARGS__))
#define FASTDDP_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, ::fastddp::cat(__VA_ARGS__))
#define FASTDDP_CHECK_NOT_IMPLEMENTED(cond, ...) \
  TORCH_CHECK_NOT_IMPLEMENTED(cond, ::fastddp::cat(__VA_ARGS__))
// A CUDA tensor reached an op of a build without CUDA: NotImplementedError naming the op.
#define FASTDDP_FAIL_WITHOUT_CUDA(what)                                                    \
  FASTDDP_CHECK_NOT_IMPLEMENTED(false, "fastddp was built without CUDA, and ", what,      \
                                " got a CUDA tensor: build fastddp with CUDA")
#define FASTDDP_INTERNAL_ASSERT(cond, ...) \
  TORCH_INTERNAL_ASSERT(cond, ::fastddp::cat(__VA_ARGS__))
#define FASTDDP_WARN(...) TORCH_WARN(::fastddp::cat(__VA_ARGS__))
#define FASTDDP_WARN_ONCE(...) TORCH_WARN_ONCE(::fastddp::cat(__VA_ARGS__))
