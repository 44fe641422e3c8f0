#include "registry.h"

#include "allreduce.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <mutex>
#include "../../util/message.h"

namespace fastddp {
namespace {

struct Registry {
  std::mutex mutex;
  std::map<std::string, CommHookFactory> factories;
};

// Function-local: registrars in other translation units run during static
// initialization, in no particular order.
Registry& registry() {
  static Registry instance;
  return instance;
}

std::string type_name(const HookOption& value) {
  static const char* names[] = {"bool", "int", "float", "str"};
  return names[value.index()];
}

}  // namespace

const HookOption* HookOptions::find(const std::string& key) const {
  auto it = values_.find(key);
  return it == values_.end() ? nullptr : &it->second;
}

bool HookOptions::get_bool(const std::string& key, bool fallback) const {
  const HookOption* v = find(key);
  if (v == nullptr) return fallback;
  FASTDDP_CHECK(std::holds_alternative<bool>(*v), "comm hook '", hook_, "': option '", key,
                "' must be a bool, got ", type_name(*v));
  return std::get<bool>(*v);
}

int64_t HookOptions::get_int(const std::string& key, int64_t fallback) const {
  const HookOption* v = find(key);
  if (v == nullptr) return fallback;
  FASTDDP_CHECK(std::holds_alternative<int64_t>(*v), "comm hook '", hook_, "': option '", key,
                "' must be an int, got ", type_name(*v));
  return std::get<int64_t>(*v);
}

double HookOptions::get_double(const std::string& key, double fallback) const {
  const HookOption* v = find(key);
  if (v == nullptr) return fallback;
  if (std::holds_alternative<int64_t>(*v)) return static_cast<double>(std::get<int64_t>(*v));
  FASTDDP_CHECK(std::holds_alternative<double>(*v), "comm hook '", hook_, "': option '", key,
                "' must be a float, got ", type_name(*v));
  return std::get<double>(*v);
}

std::string HookOptions::get_choice(const std::string& key, const std::string& fallback,
                                    const std::vector<std::string>& choices) const {
  const HookOption* v = find(key);
  if (v == nullptr) return fallback;
  const std::string allowed = join(choices, ", ", "'");
  FASTDDP_CHECK(std::holds_alternative<std::string>(*v), "comm hook '", hook_, "': option '", key,
                "' must be one of ", allowed, ", got a ", type_name(*v));
  const std::string& s = std::get<std::string>(*v);
  for (const std::string& c : choices) {
    if (c == s) return s;
  }
  FASTDDP_CHECK(false, "comm hook '", hook_, "': option '", key, "' must be one of ", allowed,
                ", got '", s, "'");
}

void HookOptions::check_known(const std::vector<std::string>& known) const {
  for (const auto& [key, value] : values_) {
    bool found = false;
    for (const std::string& k : known) found = found || k == key;
    if (found) continue;
    FASTDDP_CHECK(false, "comm hook '", hook_, "' has no option '", key, "' (it takes: ",
                  known.empty() ? "none" : join(known, ", "), ")");
  }
}

void register_comm_hook_factory(const std::string& name, CommHookFactory factory) {
  FASTDDP_CHECK(!name.empty() && factory, "fastddp: a comm hook needs a name and a factory");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  FASTDDP_CHECK(r.factories.count(name) == 0, "fastddp: a comm hook named '", name,
                "' is already registered");
  r.factories.emplace(name, std::move(factory));
}

std::shared_ptr<CommHook> create_comm_hook(const std::string& name,
                                           const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                           const std::map<std::string, HookOption>& options) {
  FASTDDP_CHECK(group, "fastddp: comm hook '", name, "' needs a process group");
  CommHookFactory factory;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.factories.find(name);
    if (it == r.factories.end()) {
      std::string known;
      for (const auto& [n, f] : r.factories) known += cat(" '", n, "'");
      FASTDDP_CHECK(false, "fastddp: no comm hook named '", name, "' is registered (known:",
                    known, ")");
    }
    factory = it->second;
  }
  std::shared_ptr<CommHook> hook = factory(group, HookOptions(name, options));
  FASTDDP_CHECK(hook, "fastddp: the factory of comm hook '", name, "' returned no hook");
  return hook;
}

std::vector<std::string> comm_hook_names() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<std::string> names;
  for (const auto& [n, f] : r.factories) names.push_back(n);
  return names;
}

// The default hook (allreduce.h) is registered here so that allreduce.cpp
// stays the reducer's own; it takes no options.
FASTDDP_REGISTER_COMM_HOOK("allreduce", [](const auto& group, const HookOptions& options) {
  options.check_known({});
  return std::make_shared<AllreduceHook>(group);
});

}  // namespace fastddp
