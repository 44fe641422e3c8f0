"""fastddp's CUDA paths against torch's own references on CUDA (cuda_references_scenarios.py):
the bf16/fp16 hooks against torch's bf16/fp16_compress_hook under torch DDP, bit for bit;
torch's powerSGD_hook run natively against torch DDP running it; check_for_nan_in_grad's
CUDA kernels (csrc/kernels/cuda/nonfinite.cu and half_cast.cu's flag).

The GPU tests carry the `gpu` marker (conftest.py skips them where no GPU is visible): ranks
on one GPU over gloo, which reduces CUDA tensors through host memory with its CPU sums.
The same scenarios run on the CPU in make test (the tests without the marker).
"""

import pytest

from tests.python.harness import World
from tests.python.hooks import cuda_references_scenarios as s

NAN_MESSAGE = "non-finite gradient (NaN or Inf) in parameter '2.weight' on rank 1 at step 2"

# (world size, fastddp's hook, torch DDP's, packed layout, extra arguments).
HALF_CASES = {
    "bf16": (2, "fastddp.bf16", "torch.bf16_compress_hook", False, {}),
    "fp16": (2, "fastddp.fp16", "torch.fp16_compress_hook", False, {}),
    # float16 subnormals: the order of cast and division shows even on 2 ranks.
    "fp16_small": (2, "fastddp.fp16", "torch.fp16_compress_hook", False, {"loss_scale": 1e-4}),
    "torch_bf16_wrapper": (2, "torch.bf16_compress_wrapper", "torch.bf16_compress_wrapper",
                           False, {}),
    "torch_fp16_hook": (2, "torch.fp16_compress_hook", "torch.fp16_compress_hook", False, {}),
    "bf16_bucket_view": (2, "fastddp.bf16", "torch.bf16_compress_hook", False,
                         {"gradient_as_bucket_view": True}),
    "bf16_float64": (2, "fastddp.bf16", "torch.bf16_compress_hook", False,
                     {"dtype": "float64"}),
    "bf16_3ranks": (3, "fastddp.bf16", "torch.bf16_compress_hook", True, {}),
    "fp16_3ranks": (3, "fastddp.fp16", "torch.fp16_compress_hook", True, {}),
}
NAN_CASES = [("allreduce", "float32", False), ("allreduce", "float64", False),
             ("allreduce", "float32", True), ("bf16", "float32", False),
             ("fp16", "float32", False), ("bf16", "float64", False)]


@pytest.fixture(scope="module")
def gloo_worlds():
    """2- and 3-rank gloo worlds, all ranks on the one GPU, started on first use."""
    worlds = {}

    def get(size: int) -> World:
        if size not in worlds:
            worlds[size] = World(size, backend="gloo")
        return worlds[size]

    yield get
    for world in worlds.values():
        world.close()


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(HALF_CASES))
def test_half_hooks_match_torch_on_cuda(gloo_worlds, case):
    size, fast, ref, packed, extra = HALF_CASES[case]
    names = gloo_worlds(size).check(s.half_hooks, fast_hook=fast, ref_hook=ref, packed=packed,
                                    device="cuda", **extra)
    assert names[0] in ("bf16", "fp16"), names


@pytest.mark.gpu
@pytest.mark.parametrize("rank", [2, 4])
def test_powersgd_on_a_tall_matrix_matches_torch_on_cuda(gloo_worlds, rank):
    """An 8200 x 16 weight on 2 ranks' CUDA tensors: from rank 3 fastddp orthogonalizes its
    P on the tall path (CholeskyQR2, Note [tall orthogonalization]), torch with linalg.qr;
    at rank 2 both run Gram-Schmidt. Grads within powersgd_scenarios.TOL every step."""
    from tests.python.hooks import powersgd_scenarios

    out = gloo_worlds(2).check(powersgd_scenarios.powersgd_training, model="tall",
                               device="cuda", matrix_approximation_rank=rank,
                               start_powerSGD_iter=2)[0]
    assert out["differs_from_mean"]
    tall = "fastddp orthogonalize tall" in out["orthogonalize_ranges"]
    assert tall == (rank > 2), out["orthogonalize_ranges"]


@pytest.mark.gpu
@pytest.mark.parametrize("batched", [False, True], ids=["powerSGD_hook", "batched"])
def test_torch_powersgd_hook_on_cuda_gloo(gloo_worlds, batched):
    """torch's powerSGD_hook with a PowerSGDState on 2 ranks' CUDA tensors: fastddp runs it
    natively, torch DDP runs torch's (powersgd_torch_state_scenarios.TOL); 3 of the 5
    steps compressed."""
    from tests.python.hooks import powersgd_torch_state_scenarios

    world = gloo_worlds(2)
    assert world.check(powersgd_torch_state_scenarios.torch_hook_with_state, device="cuda",
                       batched=batched) == [3, 3]


@pytest.mark.gpu
@pytest.mark.parametrize(("hook", "dtype", "bucket_view"), NAN_CASES)
def test_nan_in_cuda_gradient(gloo_worlds, hook, dtype, bucket_view):
    messages = gloo_worlds(2).check(s.nan_then_torch, hook=hook, device="cuda", dtype=dtype,
                                    gradient_as_bucket_view=bucket_view)
    assert all(NAN_MESSAGE in m and "rank 0" not in m for m in messages), messages


# --- the same scenarios on the CPU -------------------------------------------------

@pytest.mark.parametrize("hook", list(s.NAN_HOOKS))
def test_nan_scenario_on_cpu(world, hook):
    messages = world.check(s.nan_then_torch, hook=hook, device="cpu")
    assert all(NAN_MESSAGE in m and "rank 0" not in m for m in messages), messages


def test_packed_half_scenario_on_cpu(world):
    assert world.check(s.half_hooks, fast_hook="fastddp.fp16",
                       ref_hook="torch.fp16_compress_hook", packed=True,
                       device="cpu")[0] == "fp16"


def test_tall_powersgd_scenario_on_cpu(world):
    # The tall-matrix scenario above on CPU tensors: the same grads as torch's hook, and no
    # tall path (the CPU keeps Gram-Schmidt, test_orthogonalize.py).
    from tests.python.hooks import powersgd_scenarios

    out = world.check(powersgd_scenarios.powersgd_training, model="tall",
                      matrix_approximation_rank=4, start_powerSGD_iter=2)[0]
    assert out["differs_from_mean"]
    assert out["orthogonalize_ranges"] == ["fastddp orthogonalize"]
