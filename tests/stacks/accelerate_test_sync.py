"""Accelerate's shipped test script ``accelerate/test_utils/scripts/test_sync.py``, run unmodified
from site-packages, with fastddp.integrations.accelerate's Accelerator as the one it imports
(tests/python/launch/test_accelerate_integration.py):

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 \\
        accelerate_test_sync.py --out OUT

test_sync compares a DDP-wrapped model's gradients with a single-process copy's under
``no_sync``, ``trigger_sync_in_backward`` and ``accumulate``, and asserts on its own. This
script only puts the Accelerator in place and writes, per rank, the class of every model the
Accelerators prepared, so that the test knows fastddp's wrapper was the one under test.
"""

import argparse
import json
import os
import runpy
import sys
from pathlib import Path

import accelerate.accelerator
import accelerate.test_utils.scripts.test_sync as test_sync

from fastddp.integrations.accelerate import Accelerator


class RecordingAccelerator(Accelerator):
    """fastddp's Accelerator, noting each prepared model's class (the script makes several)."""

    prepared: list[str] = []

    def prepare_model(self, *args, **kwargs):
        model = super().prepare_model(*args, **kwargs)
        RecordingAccelerator.prepared.append(f"{type(model).__module__}."
                                             f"{type(model).__qualname__}")
        return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    # test_sync does `from accelerate.accelerator import Accelerator` when it runs: the name
    # it finds is set here, for this process only (the script's own file stays untouched).
    accelerate.accelerator.Accelerator = RecordingAccelerator
    runpy.run_path(test_sync.__file__, run_name="__main__")
    rank = int(os.environ["RANK"])
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "prepared": RecordingAccelerator.prepared, "script": test_sync.__file__}))
    # The rank is done: its script asserted on its own and the result is written. test_sync
    # destroys the process group itself, with its models (fastddp's or torch's wrappers, in
    # reference cycles) still holding it, so gloo's threads live into the interpreter's
    # finalization; one still releasing a finished collective's Python-owned tensor then
    # needs the GIL, Python 3.11 ends it with pthread_exit, and the unwind through gloo's
    # worker loop aborts the process ("terminate called without an active exception"; CI at
    # afd46e0, after the script passed). The teardown the other stack scripts run
    # (stack_result.shutdown: gc, barrier, then destroy) cannot run after test_sync's own
    # destroy, so the rank leaves without the interpreter's finalization.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
