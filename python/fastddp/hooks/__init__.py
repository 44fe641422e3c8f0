"""Communication hooks for fastddp.DistributedDataParallel.

Built-ins run in C++ (no Python per bucket)::

    model.register_comm_hook(None, fastddp.hooks.bf16())
    model.register_comm_hook(None, fastddp.hooks.bf16(accumulate="fp32", error_feedback=True))
    model.register_comm_hook(None, fastddp.hooks.fp16())
    model.register_comm_hook(None, fastddp.hooks.int8())
    model.register_comm_hook(None, fastddp.hooks.fp8(format="e5m2", error_feedback=False))
    model.register_comm_hook(None, fastddp.hooks.allreduce())
    model.register_comm_hook(None, fastddp.hooks.powersgd(matrix_approximation_rank=2,
                                                          start_powerSGD_iter=10))
    model.register_comm_hook(None, fastddp.hooks.batched_powersgd(start_powerSGD_iter=10))
    model.register_comm_hook(None, fastddp.hooks.acpsgd(matrix_approximation_rank=4))
    model.register_comm_hook(None, fastddp.hooks.hierarchical(inter=fastddp.hooks.bf16()))

torch's own hook functions are recognized and run by the same C++ code:
``default_hooks.allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``, and
``fp16_compress_wrapper(allreduce_hook)`` / ``bf16_compress_wrapper(allreduce_hook)``, and
``powerSGD_hook`` and ``batched_powerSGD_hook`` with a ``PowerSGDState`` (its settings
are read at registration; its training state is loaded into the native hook, and read back
from it whenever Python reads the state, so torch's checkpoint recipe works: see
powersgd_live.py). Any other callable ``hook(state, bucket) -> torch.futures.Future`` runs as
it would under torch DDP, on a real ``torch.distributed.GradBucket``.

A built-in hook object is also a torch-style Python hook: calling it runs the same algorithm
in plain torch ops, so ``torch_ddp.register_comm_hook(None, fastddp.hooks.bf16())`` gives the
reference that fastddp's native path is tested against, bit for bit.

Here: the catalog that names every hook for the launcher, the tuner, the self-check and the
docs (catalog.py), the constructors (_constructors.py), the hook objects and their torch
references (_comm_hook.py), torch's own hooks on fastddp (_torch_hooks.py), auto()'s hook and
where the core finds its tuner (auto_hook.py; the tuner and its candidates are
fastddp.tuning's), hierarchical reduction's process groups (node_groups.py), and PowerSGD: its
arguments (_powersgd_args.py), torch's PowerSGDState kept live on the native hook
(powersgd_live.py) and its checkpoint layout (_powersgd_layout.py).
"""

from fastddp.hooks._comm_hook import CommHook, HierarchicalHook
from fastddp.hooks._constructors import (acpsgd, allreduce, auto, batched_powersgd, bf16, fp8,
                                         fp16, from_registry, hierarchical,
                                         hierarchical_groups, int8, noop, powersgd)
# Beyond __all__: what fastddp.DistributedDataParallel, the tuner, the launcher's link emulator
# and the torchft integration call to register a hook or recognize one of torch's.
from fastddp.hooks._torch_hooks import (builtin_for_type, check_comm_hook,  # noqa: F401
                                        native_torch_hooks, resolve, torch_builtin)
from fastddp.hooks.auto_hook import AutoHook

__all__ = ["AutoHook", "CommHook", "HierarchicalHook", "acpsgd", "allreduce", "auto",
           "batched_powersgd", "bf16", "fp16", "fp8", "from_registry", "hierarchical",
           "hierarchical_groups", "int8", "native_torch_hooks", "noop", "powersgd"]
