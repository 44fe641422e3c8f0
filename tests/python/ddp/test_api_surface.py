"""Public torch DDP API items that fastddp takes over, each against torch DDP doing the
same on the same 2 gloo ranks (api_surface_scenarios.py): init_sync, _register_builtin_comm_hook,
fastddp.hooks.native_torch_hooks(), SyncBatchNorm, join(throw_on_early_termination=True),
Join with another Joinable, _ddp_params_and_buffers_to_ignore, _set_ddp_sink_clone.

2 ranks only: at 2 ranks fastddp's scale-then-sum and torch's sum-then-scale are the same
numbers (halving is exact), so the comparisons are bit for bit.
"""

import pytest

import fastddp
from tests.python.ddp import api_surface_scenarios

two_ranks = pytest.mark.parametrize("world", [2], indirect=True, ids=["world2"])


@two_ranks
@pytest.mark.parametrize("init_sync", [False, True])
def test_init_sync(world, init_sync):
    """init_sync=False: no rank takes rank 0's parameters and buffers at construction (torch
    DDP's behaviour, and the numbers equal its own bit for bit in the scenario); True: every
    rank does."""
    results = world.check(api_surface_scenarios.init_sync, init_sync=init_sync)
    for rank, result in enumerate(results):
        # [torch DDP, fastddp]: the ranks started from different seeds.
        assert result["kept_own"] == [not init_sync or rank == 0] * 2, (rank, result)
        assert result["holds_rank0"] == [init_sync or rank == 0] * 2, (rank, result)


@two_ranks
@pytest.mark.parametrize("kind", ["ALLREDUCE", "FP16_COMPRESS"])
def test_register_builtin_comm_hook(world, kind):
    """dist.BuiltinCommHookType on both: grads and parameters bit for bit over 3 steps (for
    FP16_COMPRESS that needs the fp16 wire: plain allreduce would differ), fastddp runs its
    native equivalent, and a second registration is refused with torch's message."""
    results = world.check(api_surface_scenarios.builtin_hook, kind=kind)
    once = "register_comm_hook or register_builtin_comm_hook can only be called once."
    for result in results:
        assert result["hook"] == {"ALLREDUCE": "allreduce", "FP16_COMPRESS": "fp16"}[kind]
        torch_error, fast_error = result["again"]
        assert torch_error is not None and once in torch_error, result
        assert fast_error == once, result


NATIVE = {
    "default_hooks.allreduce_hook": "allreduce",
    "default_hooks.fp16_compress_hook": "fp16",
    "default_hooks.bf16_compress_hook": "bf16",
    "default_hooks.fp16_compress_wrapper(allreduce_hook)": "fp16",
    "default_hooks.bf16_compress_wrapper(allreduce_hook)": "bf16",
    "powerSGD_hook.powerSGD_hook (with a PowerSGDState)": "powersgd",
    "powerSGD_hook.batched_powerSGD_hook (with a PowerSGDState)": "powersgd_batched",
}


def test_native_torch_hooks_lists_torch_functions():
    """What native_torch_hooks() promises: torch's hook functions (each names a real
    function of torch's ddp_comm_hooks modules) and the native built-in that runs it (each
    in the C++ registry)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    mapping = fastddp.hooks.native_torch_hooks()
    assert mapping == NATIVE
    modules = {"default_hooks": default_hooks, "powerSGD_hook": powerSGD_hook}
    for key, native in mapping.items():
        module, function = key.split(" ")[0].split(".")
        assert callable(getattr(modules[module], function.split("(")[0])), key
        assert native in fastddp._C.comm_hook_names(), native


@two_ranks
@pytest.mark.parametrize("key", list(NATIVE))
def test_native_torch_hook_runs_natively(world, key):
    """Each listed torch hook, registered on fastddp, is replaced by its native built-in
    (the reducer names it; torch's Python function would be named by its qualname) and
    trains as torch DDP running torch's function: bit for bit, PowerSGD within float32
    rounding (api_surface_scenarios._close_to_powersgd)."""
    names = world.check(api_surface_scenarios.native_torch_hook, key=key)
    assert names == [NATIVE[key]] * 2, names


@two_ranks
def test_sync_batchnorm_on_cpu_is_refused_as_torch_does(world):
    """SyncBatchNorm's synchronized forward needs a GPU (torch raises "SyncBatchNorm expected
    input tensor to be on GPU" in it), and torch DDP refuses a CPU module that holds one at
    construction. On this CPU-only machine that refusal is what can be compared; on a GPU
    torch DDP adds nothing to SyncBatchNorm (it syncs through its own process group)."""
    results = world.check(api_surface_scenarios.sync_batchnorm)
    for torch_outcome, fast_outcome in results:
        assert torch_outcome == ("ValueError", "SyncBatchNorm layers only work with GPU modules")
        assert fast_outcome == torch_outcome


@two_ranks
def test_join_throw_on_early_termination(world):
    """Uneven inputs under join(throw_on_early_termination=True): the rank that runs out
    and the rank still training raise what torch DDP raises on each, the steps before agree
    bit for bit, and the group stays usable (a barrier after; the harness's deadline
    catches a hang)."""
    results = world.check(api_surface_scenarios.join_throw)
    assert results[0] == ["Rank 0 exhausted all inputs."] * 2, results
    assert results[1] == [
        "Detected at least one rank that exhausted inputs. Throwing across all ranks."] * 2, (
        results)


@two_ranks
def test_join_with_zero_redundancy_optimizer(world):
    """Join([ddp, ZeroRedundancyOptimizer]) (both Joinable) with rank 1 running twice the
    batches of rank 0: the parameters equal torch DDP's under the same Join, bit for bit."""
    assert world.check(api_surface_scenarios.join_with_zero) == [2, 4]


@two_ranks
def test_params_and_buffers_to_ignore(world):
    """Ignored entries, different on each rank, are not broadcast at construction and
    ignored parameters' gradients are not averaged, as in torch DDP (bit for bit over 3
    steps in the scenario); every other entry is rank 0's, every other gradient the mean."""
    for result in world.check(api_surface_scenarios.ignored_params):
        differ = {name for name, same in result["constructed"].items() if not same}
        assert differ == set(api_surface_scenarios.IGNORED), result
        assert {name for name, same in result["grads"].items() if not same} == {"0.bias"}, (
            result)


@two_ranks
@pytest.mark.parametrize("mode", ["find_unused", "static_graph"])
@pytest.mark.parametrize("clone", [True, False])
def test_set_ddp_sink_clone(world, clone, mode):
    """_set_ddp_sink_clone: while outputs pass the sink (every iteration with
    find_unused_parameters, the first of a static graph), True hands out copies and False
    the module's outputs, which then cannot be modified in place (autograd's view error);
    the same as torch DDP, whose grads match bit for bit in the scenario."""
    results = world.check(api_surface_scenarios.sink_clone, clone=clone, mode=mode)
    sink_steps = [True, True] if mode == "find_unused" else [True, False]
    want = [{"shares": not clone or not sink, "in_place": True if sink and not clone else None}
            for sink in sink_steps]
    for torch_rows, fast_rows in results:
        assert torch_rows == want, torch_rows
        assert fast_rows == torch_rows, fast_rows

