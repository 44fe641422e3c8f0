"""``--emulate-link`` / ``patch(emulate_link=...)``: every process group a wrapped model (or a
built-in hook's state) reduces over is replaced by one EmulatedLinkGroup over it, all with
the same link. One wrapper per group, shared by every model on it, so that their collectives
queue on one emulated link as they would on the real one.
"""

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from fastddp.link.emulator import EmulatedLinkGroup
from fastddp.link.model import Link, parse_link


class LinkEmulation:
    """The launcher's link and the wrappers it made, one per wrapped process group."""

    def __init__(self, link: Link | str):
        self.link = parse_link(link) if isinstance(link, str) else link
        if not isinstance(self.link, Link):
            raise TypeError(f"emulate_link must be a Link or a spec such as '3GB/s,20us', got "
                            f"{type(link).__name__}")
        # id(inner group) -> its wrapper; the wrapper holds the inner group alive.
        self._groups: dict[int, EmulatedLinkGroup] = {}

    @property
    def groups(self) -> list[EmulatedLinkGroup]:
        return list(self._groups.values())

    def group_for(self, group: dist.ProcessGroup | None) -> EmulatedLinkGroup:
        """The wrapper of ``group`` (None: the default group), made on first use."""
        if group is None:
            group = dist.distributed_c10d._get_default_group()
        if isinstance(group, EmulatedLinkGroup):
            return group  # the script set up its own emulation
        wrapper = self._groups.get(id(group))
        if wrapper is None:
            wrapper = self._groups[id(group)] = EmulatedLinkGroup(group, self.link)
        return wrapper

    def model_group(self, process_group: Any, device_mesh: Any) -> EmulatedLinkGroup:
        """The ``process_group=`` to give a wrapped model instead of what the script passed."""
        if device_mesh is not None:
            raise NotImplementedError(
                "--emulate-link with a model wrapped over device_mesh= is not supported: pass "
                "process_group=device_mesh.get_group() to DistributedDataParallel instead")
        return self.group_for(process_group)

    def hook_state(self, state: Any, hook: Any, note: Callable[[str], None]) -> Any:
        """``state`` with the process group it names (None names WORLD for torch's hooks)
        replaced by its wrapper. Python hooks of the script's own get their state as is."""
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        from fastddp import hooks

        if isinstance(hook, (hooks.CommHook, hooks.AutoHook)):
            # None is the model's (already emulated) group.
            return None if state is None else self.group_for(state)
        if isinstance(state, powerSGD_hook.PowerSGDState):
            state.process_group = self.group_for(state.process_group)
            return state
        if hooks.torch_builtin(hook) is not None and (
                state is None or isinstance(state, dist.ProcessGroup)):
            return self.group_for(state)
        name = getattr(hook, "__qualname__", type(hook).__name__)
        note(f"--emulate-link: the script's comm hook {name} runs its own collectives; those "
             "on process groups it picks itself are not emulated")
        return state

    def describe(self) -> str:
        return f"emulated link {self.link} (launcher)"

    def report_text(self) -> str:
        """One line per emulated group: the collectives and bytes that went through it."""
        if not self._groups:
            return "[fastddp] emulated link: no model used it"
        lines = []
        for wrapper in self._groups.values():
            s = wrapper.stats()
            kinds = ", ".join(f"{k} {n} x ({s['bytes'][k] / 1e6:.2f} MB in all)"
                              for k, n in sorted(s["counts"].items()))
            lines.append(f"[fastddp] emulated link {s['link']} over a group of "
                         f"{wrapper.size()}: {kinds or 'no collectives'}; link busy "
                         f"{s['emulated_s'] * 1e3:.1f} ms")
        return "\n".join(lines)
