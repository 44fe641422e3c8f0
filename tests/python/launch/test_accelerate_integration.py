"""``fastddp.integrations.accelerate.Accelerator`` under ``accelerate launch`` (no torchrun, no
``-m fastddp``) on 2 CPU gloo ranks: Accelerate's shipped test_sync.py, unmodified, passing
with fastddp's wrapper (tests/stacks/accelerate_test_sync.py), and tests/stacks/
accelerate_train.py with Accelerate's DDPCommunicationHookType choices against the same
script on Accelerate's own Accelerator (torch's class, torch's hook functions). Skipped when
Accelerate is not installed (``make deps-stacks``)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

# finish(): waits for a 2-rank run that writes {out}.rank{r}.json (any launcher's).
from tests.python.launch.lightning_strategy_scenarios import finish
from tests.python.launch.test_stacks import (EXACT, FASTDDP_CLASS, PACKAGE_DIR, STACKS,
                                             TORCH_CLASS, assert_ranks_agree,
                                             assert_same_training)

pytestmark = [pytest.mark.stacks,
              pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                                 reason="accelerate is not installed (make deps-stacks)")]

POWERSGD_STATE = '{"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}'
# name: (the reference's accelerate_train.py arguments (Accelerate's Accelerator and its
# DistributedDataParallelKwargs), the fastddp run's (after --fastddp), the C++ hook fastddp must
# run, torch's hook function in the reference)
BF16 = ["--comm-hook", "bf16"]
SCENARIOS = {
    "bf16": (BF16, BF16, "bf16", "bf16_compress_hook"),
    # A wrapper of the hook's own precision: fastddp runs the hook alone, natively; torch
    # runs bf16_compress_wrapper(bf16_compress_hook) in Python.
    "bf16_wrapped": ([*BF16, "--comm-wrapper", "bf16"], [*BF16, "--comm-wrapper", "bf16"],
                     "bf16", "bf16_compress_wrapper_hook"),
    "power_sgd": (["--comm-hook", "power_sgd", "--comm-state", POWERSGD_STATE],
                  ["--comm-hook", "power_sgd", "--comm-state", POWERSGD_STATE], "powersgd",
                  "powerSGD_hook"),
    # FastDDPKwargs(hook="bf16"): fastddp.hooks.bf16(), against torch's bf16_compress_hook.
    "fastddp_hook": (BF16, ["--fastddp-hook", "bf16"], "bf16", "bf16_compress_hook"),
}
# Bit for bit (EXACT) but PowerSGD: torch's BLAS and fastddp's fused kernels round each
# product of P Q^T differently (tests/python/hooks/powersgd_scenarios.py: gradients within
# 5e-5 of their scale), which 8 SGD steps of lr 0.05 carry into the weights: measured at most
# 1.2e-7 (absolute) here.
POWERSGD = {"rtol": 1e-5, "atol": 1e-6}
_runs: dict[tuple[str, ...], list[dict]] = {}


def start(tmp: Path, script: str, args: list[str]) -> tuple[subprocess.Popen, Path]:
    """Starts ``accelerate launch`` of a tests/stacks script on 2 CPU ranks."""
    out = tmp / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="1",
               PYTHONPATH=os.pathsep.join([str(PACKAGE_DIR), os.environ.get("PYTHONPATH", "")]))
    for key in ("FASTDDP_DISABLE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                "MASTER_PORT", "ACCELERATE_CONFIG_FILE"):
        env.pop(key, None)
    # Accelerate's own multi-process launcher (torch elastic inside); ACCELERATE_USE_CPU makes
    # it a MULTI_CPU gloo run. Every option given: no config file is read.
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
           "--num_processes=2", "--num_machines=1", "--mixed_precision=no",
           "--dynamo_backend=no", "--main_process_port=0", str(STACKS / script),
           "--out", str(out), *args]
    return subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True), out


def train(tmp_factory, args: list[str]) -> list[dict]:
    """accelerate_train.py's result for ``args``, once per session (references are shared)."""
    key = tuple(args)
    if key not in _runs:
        _runs[key] = finish(*start(tmp_factory.mktemp("accelerate"), "accelerate_train.py",
                                   args))
    return _runs[key]


def test_accelerate_test_sync(tmp_path) -> None:
    ranks = finish(*start(tmp_path, "accelerate_test_sync.py", []))
    for rank in ranks:
        assert rank["script"].endswith(os.path.join("accelerate", "test_utils", "scripts",
                                                    "test_sync.py")), rank["script"]
        # test_sync prepares a model in each of its 3 distributed checks.
        assert rank["prepared"] == [FASTDDP_CLASS] * 3, rank["prepared"]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_comm_hook_matches_torch_ddp(name: str, tmp_path_factory) -> None:
    reference, arguments, native, torch_hook = SCENARIOS[name]
    # fastddp's run in the background while the reference runs (2 cores: each run's ranks
    # mostly wait on each other).
    fast_run = start(tmp_path_factory.mktemp(name), "accelerate_train.py",
                     ["--fastddp", *arguments])
    stock = train(tmp_path_factory, reference)
    fast = finish(*fast_run)
    for ours, theirs in zip(fast, stock, strict=True):
        assert ours["wrapper"]["classes"][0] == FASTDDP_CLASS, ours["wrapper"]
        assert theirs["wrapper"]["classes"][0] == TORCH_CLASS, theirs["wrapper"]
        assert ours["wrapper"]["native_hook"] == native, ours["wrapper"]
        assert theirs["wrapper"]["comm_hooks"] == [torch_hook], theirs["wrapper"]
    assert_same_training(fast, stock, POWERSGD if name == "power_sgd" else EXACT)
    assert_ranks_agree(fast, {k for k in fast[0]["state"] if "running_" in k})


# Accelerator(shard_optimizer=True): the script's SGD with momentum becomes fastddp's
# ShardedOptimizer, the StepLR it built on the SGD before prepare() schedules the sharded one,
# and the run is Accelerate's own with torch DDP and the unsharded SGD: bit for bit without
# clipping (2 ranks: the same reduction order, Note [sharded optimizer]). With
# accelerator.clip_grad_norm_ the norm is summed over shards, not per parameter: another
# order, measured 1.5e-8 on the weights and 4.8e-7 on the losses (about 1 ulp of each).
CLIP_TOL = {"rtol": 1e-5, "atol": 1e-6}


@pytest.mark.parametrize("clip", [[], ["--clip", "0.5"]], ids=["plain", "clip"])
def test_shard_optimizer_matches_accelerate_with_torch_ddp(clip, tmp_path_factory) -> None:
    arguments = ["--schedule", *clip]
    fast_run = start(tmp_path_factory.mktemp("sharded"), "accelerate_train.py",
                     ["--fastddp", "--shard-optimizer", *arguments])
    stock = train(tmp_path_factory, arguments)
    fast = finish(*fast_run)
    for ours, theirs in zip(fast, stock, strict=True):
        assert ours["wrapper"]["classes"][0] == FASTDDP_CLASS, ours["wrapper"]
        assert (ours["wrapper"]["optimizer"], theirs["wrapper"]["optimizer"]) == (
            "ShardedOptimizer", "SGD")
        assert ours["wrapper"]["lr"] == theirs["wrapper"]["lr"] < 0.05  # StepLR stepped it
        refused = ours["wrapper"]["refused"]
        assert len(refused) == 3, refused
        assert refused[0].startswith("NotImplementedError") and "clip_grad_value_" in refused[0]
        assert refused[1].startswith("NotImplementedError") and "all of its parameters" in \
            refused[1]
        # A second optimizer over the model: the first holds all of its shards.
        assert refused[2].startswith("RuntimeError") and "sharded already" in refused[2]
    assert_same_training(fast, stock, CLIP_TOL if clip else EXACT)


def test_handler_checks() -> None:
    from accelerate.utils import DDPCommunicationHookType as Hook
    from accelerate.utils import DistributedDataParallelKwargs

    from fastddp.integrations.accelerate import Accelerator, FastDDPKwargs

    with pytest.raises(NotImplementedError, match="comm_wrapper='fp16' on comm_hook='power_sgd'"):
        FastDDPKwargs(comm_hook=Hook.POWER_SGD, comm_wrapper=Hook.FP16)
    with pytest.raises(NotImplementedError, match="comm_wrapper='bf16' on comm_hook='fp16'"):
        FastDDPKwargs.of(DistributedDataParallelKwargs(comm_hook=Hook.FP16,
                                                       comm_wrapper=Hook.BF16))
    with pytest.raises(ValueError, match="hook or comm_hook"):
        FastDDPKwargs(hook="bf16", comm_hook=Hook.BF16)
    with pytest.raises(ValueError, match="unknown hook 'nope'"):
        FastDDPKwargs(hook="nope")
    with pytest.raises(TypeError, match="shard_optimizer is True, False or a dict"):
        Accelerator(shard_optimizer="yes")
    with pytest.raises(ValueError, match="one DistributedDataParallelKwargs or FastDDPKwargs"):
        Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(), FastDDPKwargs()])
    # The wrapper's keyword arguments, as Accelerate reads them: no hook fields.
    assert FastDDPKwargs(hook="int8", bucket_cap_mb=5).to_kwargs() == {"bucket_cap_mb": 5}


def registered_hooks() -> dict[str, str | None]:
    """On a rank: the C++ hook each comm_hook/comm_wrapper pair registers on fastddp's wrapper
    (at world size 1, where fastddp builds its reducer for a hook, as torch does)."""
    import torch
    from accelerate.utils import DDPCommunicationHookType as Hook

    from fastddp.ddp import DistributedDataParallel
    from fastddp.integrations.accelerate import FastDDPKwargs

    pairs = [(hook, Hook.NO) for hook in Hook] + [(Hook.FP16, Hook.FP16),
                                                  (Hook.BF16, Hook.BF16), (Hook.NO, Hook.BF16)]
    found = {}
    for hook, wrapper in pairs:
        model = DistributedDataParallel(torch.nn.Linear(4, 4))
        FastDDPKwargs(comm_hook=hook, comm_wrapper=wrapper,
                      comm_state_option={"matrix_approximation_rank": 2}).register_comm_hook(model)
        found[f"{hook.value}/{wrapper.value}"] = (model._native_hook.name
                                                 if model._native_hook is not None else None)
    return found


def test_every_choice_is_native(world1) -> None:
    assert world1.check(registered_hooks)[0] == {
        "no/no": None, "fp16/no": "fp16", "bf16/no": "bf16", "power_sgd/no": "powersgd",
        "batched_power_sgd/no": "powersgd_batched", "fp16/fp16": "fp16", "bf16/bf16": "bf16",
        # Accelerate's rule, kept: a wrapper without a hook registers nothing.
        "no/bf16": None}
