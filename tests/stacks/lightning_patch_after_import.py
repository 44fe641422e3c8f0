"""lightning_train.py's automatic run with ``fastddp.patch()`` called in the script after
``import lightning``, which bound torch's class by name at import. Run with plain torchrun:

    torchrun --nproc_per_node=2 lightning_patch_after_import.py --out OUT
"""

import os

import lightning  # noqa: F401  (binds torch's DistributedDataParallel by name)

import fastddp

handle = fastddp.patch()
if int(os.environ.get("RANK", "0")) == 0:
    print(handle.describe(), flush=True)

import lightning_train  # noqa: E402
from stack_result import shutdown  # noqa: E402

if __name__ == "__main__":
    lightning_train.main()
    shutdown()
