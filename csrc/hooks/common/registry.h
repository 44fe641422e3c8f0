// The comm-hook registry: fastddp's hooks by name.
//
// A hook is registered as a factory taking the process group and typed
// options; `fastddp.hooks` (Python) and `_C.create_comm_hook` look hooks up
// here, so a built-in never needs its own binding.
//
// Adding a hook from C++: FASTDDP_REGISTER_COMM_HOOK("name", factory) in the
// hook's .cpp (docs/hooks.md, "Adding a hook"). The registry is fastddp's own:
// the package installs no headers for another extension to compile a CommHook
// against.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "../../reducer/comm_hook.h"

namespace c10d {
class ProcessGroup;
}

namespace fastddp {

// A hook option's value: what Python's bool, int, float and str become.
using HookOption = std::variant<bool, int64_t, double, std::string>;

// Options by name, with typed, checked access: a misspelt or mistyped option
// is an error naming the hook and the option, never silently ignored.
class HookOptions {
 public:
  HookOptions() = default;
  HookOptions(std::string hook, std::map<std::string, HookOption> values)
      : hook_(std::move(hook)), values_(std::move(values)) {}

  bool get_bool(const std::string& key, bool fallback) const;
  int64_t get_int(const std::string& key, int64_t fallback) const;
  double get_double(const std::string& key, double fallback) const;  // ints accepted
  // A string that must be one of `choices`.
  std::string get_choice(const std::string& key, const std::string& fallback,
                         const std::vector<std::string>& choices) const;
  // Raises for any option not in `known`.
  void check_known(const std::vector<std::string>& known) const;

  const std::map<std::string, HookOption>& values() const { return values_; }

 private:
  const HookOption* find(const std::string& key) const;
  std::string hook_;
  std::map<std::string, HookOption> values_;
};

using CommHookFactory = std::function<std::shared_ptr<CommHook>(
    const c10::intrusive_ptr<c10d::ProcessGroup>& group, const HookOptions& options)>;

// Registers `factory` under `name`; raises if the name is taken.
void register_comm_hook_factory(const std::string& name, CommHookFactory factory);

// Builds the hook registered as `name`; raises, listing the known names, if none is.
std::shared_ptr<CommHook> create_comm_hook(const std::string& name,
                                           const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                           const std::map<std::string, HookOption>& options);

std::vector<std::string> comm_hook_names();

struct CommHookRegistrar {
  CommHookRegistrar(const std::string& name, CommHookFactory factory) {
    register_comm_hook_factory(name, std::move(factory));
  }
};

#define FASTDDP_REGISTER_COMM_HOOK_CONCAT_INNER(a, b) a##b
#define FASTDDP_REGISTER_COMM_HOOK_CONCAT(a, b) FASTDDP_REGISTER_COMM_HOOK_CONCAT_INNER(a, b)
#define FASTDDP_REGISTER_COMM_HOOK(name, factory)                                  \
  static const ::fastddp::CommHookRegistrar FASTDDP_REGISTER_COMM_HOOK_CONCAT(     \
      fastddp_comm_hook_registrar_, __LINE__)(name, factory)

}  // namespace fastddp
