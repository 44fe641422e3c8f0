// The torch headers that the torch-facing sources share, included first by every unity unit
// of setup.py's build and precompiled once per build under GCC (Note [torch headers
// precompiled] in setup.py). Sources still include what they use themselves: this list
// only decides what is parsed once. No pybind11 here: it emits code into every unit that
// includes it (~6 s of a unit's time), so only the bindings pay for it.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>
