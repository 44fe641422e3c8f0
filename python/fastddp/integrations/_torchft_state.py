"""The comm hook's state in torchft's recovery (fastddp/integrations/torchft.py).

A replica that rejoins takes the weights and the optimizer state from a peer through the
manager's checkpoint transport (the functions the user registers), and fastddp's hook state
through the ones registered here, under ``"fastddp_comm_hook"``:

- PowerSGD, batched PowerSGD and ACP-SGD: the peer's state (iteration, generator, warm-start
  Q, ACP-SGD's P: the same on every replica after each step) with the error feedback set to
  zero. Error feedback is each replica's own residual of its own gradients; the peer's added
  to the rejoined replica's would send the peer's residual twice. Zero is where every
  replica started.
- The half and 8-bit hooks with error feedback: that residual is all their state, so the
  rejoined replica keeps its own (zero, as it restarted) and nothing is sent.
- Hooks without state: only the name, checked on arrival.

The state is read on the manager's quorum thread while the main thread may be starting the
next step: both settle the last step's state under the model's lock first
(Note [fault-tolerant step]), so what is sent is the state of the last committed step.
"""

from __future__ import annotations

from typing import Any

import torch

from fastddp.ddp import surface

KEY = "fastddp_comm_hook"
# The error-feedback entries of a PowerSGD state (fastddp/ddp/_hook_state.py): this replica's.
_ERROR_FEEDBACK = ("error", "bucket_error_tail")


def export(ddp: Any) -> dict[str, Any]:
    """The state a rejoining replica takes from this one."""
    if ddp._reducer is None:  # not bound yet: no step taken, nothing to send
        return {"hook": None}
    native = ddp._native_hook
    if native is not None and hasattr(native, "state_dict"):
        return ddp.comm_hook_state_dict()
    name = surface.comm_hook_name(ddp)
    return {"hook": name, "residual_only": surface.comm_hook_keeps_state(ddp)}


def load(ddp: Any, state: dict[str, Any]) -> None:
    """Takes a peer's export(): the state its next steps start from."""
    if state.get("hook") is None or ddp._reducer is None:
        return
    name = surface.comm_hook_name(ddp)
    if state["hook"] != name:
        raise ValueError(f"fastddp under torchft: the peer's comm hook is {state['hook']!r}, "
                         f"this replica's {name!r}: every replica must register the same hook")
    if "residual_only" in state:
        return  # stateless, or only this replica's own residual (see the module's text)
    state = dict(state)
    for key in _ERROR_FEEDBACK:  # PowerSGD's error, batched PowerSGD's padding error
        if key in state:
            state[key] = {k: torch.zeros_like(v) for k, v in state[key].items()}
    ddp.load_comm_hook_state_dict(state)
