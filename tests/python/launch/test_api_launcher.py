"""The launcher's --check-for-nan-in-grad and --hook allreduce | int8 | fp8, end to end: an
unmodified script (scripts/train_api.py) under `torchrun --nproc_per_node=2 -m fastddp`,
against the same script under stock torch DDP (FASTDDP_DISABLE=1)."""

from pathlib import Path

import pytest
import torch

from tests.python.launch.launch_script import run_launcher

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_api.py"
TIMEOUT_S = 180  # a no-hang deadline only: a run takes about 15 s on 2 loaded cores
NAN_MESSAGE = "non-finite gradient (NaN or Inf) in parameter '2.weight' on rank 1 at step 2"


def launch(tmp_path: Path, name: str, launcher_args: list[str], script_args: list[str] = (),
           disable: bool = False, nproc: int | None = 2) -> tuple[dict | None, int, str]:
    """Runs the script under the launcher; returns rank 0's JSON (None if it wrote none),
    the exit status and the combined output."""
    result, code, output, _ = run_launcher(SCRIPT, tmp_path / f"{name}.json", launcher_args,
                                           script_args, disable, nproc, TIMEOUT_S)
    return result, code, output


def launched(tmp_path: Path, name: str, *args, **kwargs) -> tuple[dict, str]:
    result, code, output = launch(tmp_path, name, *args, **kwargs)
    assert code == 0 and result is not None, f"{name} failed ({code}):\n{output}"
    return result, output


def flat(params: list[list[float]]) -> torch.Tensor:
    return torch.cat([torch.tensor(p, dtype=torch.float32) for p in params])


@pytest.fixture(scope="module")
def stock(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    """torch DDP with torch's allreduce_hook (the launcher's --hook allreduce under
    FASTDDP_DISABLE=1, replacing the script's summing hook); rank 1's gradient of 2.weight
    holds a NaN in backward 2, which torch DDP averages into the parameters."""
    return launched(tmp_path_factory.mktemp("stock"), "stock", ["--hook", "allreduce"],
                    ["--sum-hook", "--nan-at", "2"], disable=True)


def test_hook_allreduce_is_torch_ddp_bit_for_bit(tmp_path, stock):
    """--hook allreduce replaces the script's summing hook with fastddp's native allreduce:
    the parameters after both steps are torch DDP's bit for bit (2 ranks: halving is exact,
    so scale-then-sum is sum-then-scale), NaN included: without --check-for-nan-in-grad the
    NaN is averaged in as torch DDP does, and nothing raises."""
    fast, out = launched(tmp_path, "allreduce", ["--hook", "allreduce", "--report"],
                         ["--sum-hook", "--nan-at", "2"])
    assert "fastddp.ddp.DistributedDataParallel" in fast["classes"]
    assert fast["hook_calls"] == 0 and stock[0]["hook_calls"] == 0
    assert "comm hook sum_hook was not registered: --hook allreduce" in out, out
    assert "hook=allreduce (launcher" in out and ", hook allreduce" in out, out
    for step, (ours, theirs) in enumerate(zip(fast["params"], stock[0]["params"]), start=1):
        a, b = flat(ours), flat(theirs)
        assert torch.equal(a.isnan(), b.isnan()), f"step {step}: NaN in other places"
        assert torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)), f"step {step} differs"
    assert int(flat(fast["params"][1]).isnan().sum()) == 1, "the NaN element, averaged in"


def test_check_for_nan_in_grad_raises_on_every_rank(tmp_path):
    """The same run with --check-for-nan-in-grad: backward 2 raises on both ranks, naming
    the parameter, the rank and the step (torch DDP has no such check: stock torch raises
    nothing, as the test above shows), and the script does not finish."""
    result, code, out = launch(tmp_path, "nan", ["--hook", "allreduce",
                                                 "--check-for-nan-in-grad"],
                               ["--sum-hook", "--nan-at", "2"])
    assert code != 0 and result is None, out
    assert "check_for_nan_in_grad=True (launcher)" in out, out
    assert out.count(NAN_MESSAGE) >= 2, out  # rank 0's and rank 1's tracebacks
    refused, code, out = launch(tmp_path, "nan_stock", ["--check-for-nan-in-grad"],
                                nproc=None, disable=True)
    assert code == 2 and "check_for_nan_in_grad is fastddp's" in out, out


# The 8-bit wires' bound on one step's averaged gradient (Note [8-bit wire formats] in
# csrc/hooks/quant8/quant8_hook.h; W ranks, G = the largest |local gradient| over all ranks, each
# block's absmax <= G). Rank r sends y = g_r / W, quantized with error <= e * absmax(y) <=
# e G / W; the W dequantized shards summed: error <= e G. The sum (|S| <= G (1 + e)) is
# quantized again: error <= e G (1 + e). Total: e G (2 + e), where e is the largest error
# of one code relative to its block's absmax:
#   int8: round to the nearest multiple of absmax / 127: e = 1 / 254
#   fp8 e4m3: 3 mantissa bits, round to nearest: relative error <= 2^-4 of the value (<=
#   absmax); below 2^-6 (subnormals) absolute <= 2^-10 of the scale absmax / 448, smaller:
#   e = 1 / 16
# One SGD step moves a parameter by lr * gradient, so the parameters after step 1 differ
# from torch DDP's by at most lr * e G (2 + e), plus the float32 rounding of p - lr * g
# under either gradient: one half-ulp each of |p| < 1, 2^-24 each.
RELATIVE_CODE_ERROR = {"int8": 1 / 254, "fp8": 1 / 16}


@pytest.mark.parametrize("hook", ["int8", "fp8"])
def test_hook_8bit_within_the_wire_bound(tmp_path, stock, hook):
    fast, out = launched(tmp_path, hook, ["--hook", hook, "--report"],
                         ["--sum-hook", "--steps", "1"])
    assert "fastddp.ddp.DistributedDataParallel" in fast["classes"]
    assert fast["hook_calls"] == 0 and f"comm hook sum_hook was not registered: --hook {hook}" \
        in out, out
    assert f"hook={hook} (launcher" in out and f", hook {hook}" in out, out
    e = RELATIVE_CODE_ERROR[hook]
    g_max = stock[0]["grad_max"]
    assert fast["grad_max"] == g_max  # the same data and model on both sides
    ours, theirs = flat(fast["params"][0]), flat(stock[0]["params"][0])
    assert theirs.abs().max() < 1, "the rounding term assumes |p| < 1"
    bound = stock[0]["lr"] * e * g_max * (2 + e) + 2 * 2.0**-24
    diff = (ours - theirs).abs().max().item()
    assert diff <= bound, f"{hook}: max |param - torch DDP's| {diff:.3g} > bound {bound:.3g}"
    assert diff > 0, f"{hook}: bit-equal to the fp32 average: the 8-bit wire did not run"
