"""torch.compile with fastddp on 2 real gloo ranks, against torch DDP compiled the same way.

Gradients and parameters after several SGD steps (bit for bit), and the number of graphs
dynamo's DDPOptimizer splits the model into, equal torch DDP's (inductor on CPU); comm
hooks work under compile (bit for bit against the same hook uncompiled); static_graph and
find_unused_parameters behave as under torch; compiled autograd, since fastddp's C++
reducer hooks cannot be traced, raises NotImplementedError at the first backward instead of
skipping the allreduce (on a model built under optimize_ddp="python_reducer" it trains:
test_python_reducer.py).
"""

import pytest

from tests.python.ddp import compile_scenarios as s
from tests.python.harness import World

pytestmark = pytest.mark.compile  # the slow ones: compiles on every test (see pyproject.toml)


@pytest.fixture(scope="module")
def world2():
    # Its own world: dynamo's caches and config stay out of the shared ranks.
    w = World(2, timeout_s=600)
    w.start()
    yield w
    w.close()


@pytest.mark.parametrize("mode", s.MODES)
def test_compiled_matches_torch_ddp(world2, mode):
    """torch.compile(DDP(m)) and DDP(torch.compile(m)) under inductor: fastddp's grads and
    parameters are torch DDP's, and the forward is split into as many graphs."""
    counts = world2.check(s.same_as_torch, mode=mode, backend="inductor")
    for rank_counts in counts:
        assert rank_counts["fastddp"] == rank_counts["torch"], rank_counts
        assert rank_counts["torch"] > 1, f"DDPOptimizer did not split the model: {rank_counts}"
        # Once compiled, no step sends a frame through dynamo's Python side (fastddp's
        # forward once did, at every call: about 200 us a step).
        converted = rank_counts["converted"]
        assert converted["fastddp"] <= converted["torch"], rank_counts


@pytest.mark.parametrize("cap_mb", [2, 25])
def test_split_follows_bucket_cap(world2, cap_mb):
    """The split follows bucket_cap_mb as torch's does."""
    counts = world2.check(s.same_as_torch, mode="outer", backend="aot_eager",
                          bucket_cap_mb=cap_mb, steps=2)[0]
    assert counts["fastddp"] == counts["torch"], counts


@pytest.mark.parametrize(("mode", "options"), [
    ("outer", {"static_graph": True}),
    ("inner", {"static_graph": True}),
    ("outer", {"find_unused_parameters": True, "unused": True}),
    ("inner", {"find_unused_parameters": True, "unused": True}),
    ("outer", {"unused": True}),  # unused parameter without find_unused_parameters
])
def test_graph_options_as_torch(world2, mode, options):
    """static_graph and find_unused_parameters under compile: torch's result or its error."""
    result = world2.check(s.same_as_torch, mode=mode, backend="aot_eager", **options)[0]
    if options.get("unused") and not options.get("find_unused_parameters"):
        # Both raise at the second forward; same_as_torch compared the error types.
        assert result["error"] == "RuntimeError", result
        assert "find_unused_parameters=True" in result["fastddp"], result
    else:
        assert result["fastddp"] == result["torch"] > 1, result


@pytest.mark.parametrize("hook", ["fastddp.bf16", "fastddp.bf16_fp32", "powersgd", "custom"])
@pytest.mark.parametrize("mode", s.MODES)
def test_hooks_under_compile(world2, hook, mode):
    """bf16, bf16 with fp32 accumulation, PowerSGD and a Python hook on a compiled model:
    the uncompiled model's gradients, bit for bit."""
    results = world2.check(s.hook_compiled_vs_eager, hook=hook, mode=mode)
    assert results[0]["graphs"] > 1, results
    assert results[0]["hook"].startswith(hook.removeprefix("fastddp.").split("_")[0]), results


@pytest.mark.parametrize("mode", s.MODES)
def test_python_hook_buckets_as_torch(world2, mode):
    """A Python hook on compiled models: torch DDP's gradients and the same buckets (as
    the hook sees them) in the same order."""
    counts = world2.check(s.same_as_torch, mode=mode, backend="aot_eager", hook="custom")[0]
    assert counts["fastddp"] == counts["torch"], counts


def test_compiled_autograd_training_step_raises(world2):
    """The way torch recommends compiled autograd (the config flag and a compiled step):
    NotImplementedError naming the setting, no gradient written. torch DDP raises too."""
    messages = world2.expect_error(s.compiled_autograd, NotImplementedError,
                                   match="torch._dynamo.config.compiled_autograd=True", how="step")
    assert "compiled autograd" in messages[0]
    reference = world2.check(s.torch_under_compiled_autograd)[0]
    assert reference.startswith("RuntimeError") and "Compiled autograd" in reference, reference


def test_compiled_autograd_around_backward_raises(world2):
    """compiled_autograd._enable() around backward only: NotImplementedError at that
    backward from the reducer's hooks (their compiled_args), naming compiled autograd; no
    gradient written, the allreduce is not silently skipped."""
    world2.expect_error(s.compiled_autograd, NotImplementedError,
                        match="backward under compiled autograd is not supported",
                        how="backward")


def test_compiled_autograd_flag_with_eager_backward(world2):
    """The flag on, a compiled model and an eager backward: compiled autograd never runs
    the backward, and fastddp trains as torch DDP does."""
    counts = world2.check(s.compiled_forward_under_config)[0]
    assert counts["fastddp"] == counts["torch"], counts


def test_patched_script_splits_as_torch(world2):
    """fastddp.patch() (python -m fastddp): a script compiling torch's DDP name gets
    fastddp, split as torch's would be."""
    counts = world2.check(s.patched)[0]
    assert counts["fastddp"] == counts["torch"] > 1, counts
