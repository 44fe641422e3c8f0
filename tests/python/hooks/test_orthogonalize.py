"""Fused PowerSGD orthogonalization (fastddp._C.fused_orthogonalize) against torch's
powerSGD_hook._orthogonalize.

r <= 2: torch's Gram-Schmidt, so the results agree element by element. r > 2: torch
uses linalg.qr; the fused kernel's twice-applied Gram-Schmidt (on CUDA from 8192 rows,
CholeskyQR2: its arithmetic on CPU is tall() here) gives the same columns up to sign (which
PowerSGD's P Q^T does not see), so signs are matched first. The CUDA tests check the GPU
kernels against torch on CUDA and against the CPU kernel.
"""

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

from fastddp import _C

NS = [1, 2, 3, 4, 8, 16, 17, 100, 1000, 4096]
RANKS = [1, 2, 3, 4, 8, 16]
# From 8192 rows (kTallRows), r > 2 takes the tall path on CUDA (CholeskyQR2 over row
# chunks, Note [tall orthogonalization]); on CPU tall() runs its arithmetic. 20011 leaves a
# short last chunk.
TALL_NS = [8192, 20011]
TALL_RANKS = [3, 4, 8, 16]


def random_batch(batch: int, n: int, r: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, n, r, generator=g, dtype=torch.float64).to(dtype)


def match_signs(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """got with each column's sign flipped to agree with want's."""
    sign = torch.sign((got.double() * want.double()).sum(dim=1, keepdim=True))
    sign[sign == 0] = 1
    return got * sign.to(got.dtype)


def orthogonality_error(p: torch.Tensor) -> float:
    p = p.double()
    eye = torch.eye(p.shape[2], dtype=torch.float64)
    return (p.mT @ p - eye).abs().max().item()


def orthogonality_bound(m: torch.Tensor, eps: float) -> float:
    """What orthogonality_error may reach for the input m: rounding (1e-5 in float32, 1e-12
    in float64, well above n * unit roundoff for these n) plus epsilon's own share.
    Gram-Schmidt divides column j's residual v_j by |v_j| + eps, which shortens it by
    eps / |v_j|, so its squared norm misses 1 by 2 eps / |v_j|; |v_j| is |R_jj| of
    torch's QR of m (columns that were zero, which take the completion path, excluded)."""
    tol = 1e-5 if m.dtype == torch.float32 else 1e-12
    if eps == 0.0:
        return tol
    norms = torch.linalg.qr(m.double()).R.diagonal(dim1=-2, dim2=-1).abs()
    norms = norms[norms > 1e-6 * norms.max()]
    return tol + 2 * eps / norms.min().item()


def span_error(a: torch.Tensor, p: torch.Tensor) -> float:
    """max |A - P P^T A| / max |A|: the input's columns lie in the span of P's."""
    a, p = a.double(), p.double()
    return ((p @ (p.mT @ a) - a).abs().max() / a.abs().max()).item()


def cancellation(m: torch.Tensor) -> float:
    """How much Gram-Schmidt amplifies rounding in the second column: 1 / sin of the
    smallest angle between a matrix's two columns (1 for one column)."""
    if m.shape[2] < 2:
        return 1.0
    c = m.double() / m.double().norm(dim=1, keepdim=True)
    cos = (c[:, :, 0] * c[:, :, 1]).sum(dim=1).abs().clamp(max=1)
    return (1 / (1 - cos**2).sqrt()).max().item()


def fused(m: torch.Tensor, epsilon: float) -> torch.Tensor:
    out = m.clone()
    assert _C.fused_orthogonalize(out, epsilon) is True
    return out


def tall(m: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """The CUDA tall path's arithmetic (CholeskyQR2 over row chunks) on a CPU tensor, as
    fused() takes it on CUDA; epsilon is ignored there, as by QR."""
    out = m.clone()
    assert _C._tall_orthogonalize_cpu(out) is True
    return out


def torch_orthogonalize(m: torch.Tensor, epsilon: float) -> torch.Tensor:
    out = m.clone()
    psgd._orthogonalize(out, epsilon)
    return out


def check_matches_torch(r: int, n: int, device: str, orthogonalize=fused) -> None:
    """The fused kernel of `device` (or `orthogonalize`) against torch's _orthogonalize on
    the same device."""
    for dtype in (torch.float32, torch.float64):
        for batch in (1, 7):
            for eps in (0.0, 1e-8):
                m = random_batch(batch, n, r, dtype, seed=1000 * n + 10 * r + batch)
                got = orthogonalize(m.to(device), eps).cpu()
                want = torch_orthogonalize(m.to(device), eps).cpu()
                what = f"{device} {dtype} batch {batch} n {n} r {r} eps {eps}"
                if r <= 2:
                    # The same op order; only torch's float sums differ from our double ones
                    # (differences the cancellation of nearly parallel columns amplifies:
                    # small n draws some).
                    atol = (1e-6 if dtype == torch.float32 else 1e-12) * cancellation(m)
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=what)
                else:
                    # QR and Gram-Schmidt differ by rounding amplified by the condition
                    # number, which is large for random square matrices: compare P P^T (the
                    # projection PowerSGD applies) with a tolerance on it, and orthogonality
                    # and span strictly.
                    tol = 1e-5 if dtype == torch.float32 else 1e-12
                    assert orthogonality_error(got) < tol, what
                    assert span_error(m, got) < 100 * tol, what
                    if n >= 2 * r:  # well conditioned: the columns themselves agree
                        torch.testing.assert_close(match_signs(got, want), want, rtol=1e-5,
                                                   atol=tol / 10, msg=what)


@pytest.mark.parametrize("n", NS + TALL_NS[:1])
@pytest.mark.parametrize("r", RANKS)
def test_matches_torch(r: int, n: int) -> None:
    if r > n:
        pytest.skip("PowerSGD's matrices have r <= n")
    check_matches_torch(r, n, "cpu")


@pytest.mark.parametrize("n", TALL_NS)
@pytest.mark.parametrize("r", TALL_RANKS)
def test_tall_matches_torch(r: int, n: int) -> None:
    check_matches_torch(r, n, "cpu", tall)


def ran_tall_path(m: torch.Tensor) -> bool:
    """Whether orthogonalizing m recorded the tall path's profiler range."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fused(m, 0.0)
    names = {e.name for e in prof.events()}
    assert "fastddp orthogonalize" in names or "fastddp orthogonalize tall" in names
    return "fastddp orthogonalize tall" in names


def test_cpu_keeps_gram_schmidt_on_tall_matrices() -> None:
    # Per core, the vectorized Gram-Schmidt is several times faster than CholeskyQR2's
    # r^2 scalar products per row; the tall path is the GPU's (test_kernel_paths_cuda.py).
    assert not ran_tall_path(random_batch(1, 20011, 16, torch.float64, 0))


@pytest.mark.parametrize("n, r", [(8191, 3), (20011, 2), (20011, 65)])
def test_tall_twin_refuses_other_shapes(n: int, r: int) -> None:
    # Below 8192 rows, at r <= 2 (torch's Gram-Schmidt) and above the CPU's rank limit.
    m = random_batch(1, n, r, torch.float32, 0)
    before = m.clone()
    assert _C._tall_orthogonalize_cpu(m) is False
    assert torch.equal(m, before)


def test_tall_path_gives_the_same_bits_on_any_thread_count() -> None:
    # Partial Gram matrices per fixed row chunk, summed in chunk order: the threads only
    # decide who computes which chunk.
    m = random_batch(3, 20011, 4, torch.float32, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = tall(m)
        torch.set_num_threads(max(2, threads))
        many = tall(m)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


@pytest.mark.parametrize("n, orthogonalize", [(1024, fused), (8192, tall)], ids=["", "tall"])
@pytest.mark.parametrize("r", [3, 4, 8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nearly_dependent_columns_stay_orthogonal(r: int, dtype: torch.dtype, n: int,
                                                  orthogonalize) -> None:
    # Every column is the first plus 1e-4 of noise: one Gram-Schmidt pass would lose
    # about 1e-4 * 1e4 = all of its orthogonality in float32; QR and two passes do not
    # (nor does the tall path, whose Cholesky step sends such matrices to Gram-Schmidt).
    m = random_batch(3, n, r, torch.float64, seed=r)
    m[:, :, 1:] = m[:, :, :1] + 1e-4 * m[:, :, 1:]
    m = m.to(dtype)
    got = orthogonalize(m, 0.0)
    assert orthogonality_error(got) < 1e-4
    assert orthogonality_error(torch_orthogonalize(m, 0.0)) < 1e-4  # torch's QR: the bar


@pytest.mark.parametrize("r", [1, 2])
def test_zero_column_like_torch(r: int) -> None:
    m = random_batch(2, 50, r, torch.float32, seed=3)
    m[1, :, 0] = 0
    # With epsilon the zero column stays zero; without, it (and what is projected on it)
    # becomes NaN, in both.
    torch.testing.assert_close(fused(m, 1e-8), torch_orthogonalize(m, 1e-8), rtol=1e-5,
                               atol=1e-6)
    got, want = fused(m, 0.0), torch_orthogonalize(m, 0.0)
    assert got[1].isnan().all() and want[1].isnan().all()
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n, orthogonalize", [(64, fused), (8192, tall)], ids=["", "tall"])
@pytest.mark.parametrize("eps", [0.0, 1e-8])
def test_rank_deficient_is_completed_like_qr(eps: float, n: int, orthogonalize) -> None:
    # torch's QR returns orthonormal columns for any input; so does the fused r > 2 path
    # (a zero gradient must not turn into NaN), the tall one included.
    m = random_batch(3, n, 4, torch.float32, seed=4)
    m[0] = 0
    m[1, :, 2] = 0
    m[2, :, 3] = 3 * m[2, :, 1]
    got = orthogonalize(m, eps)
    assert got.isfinite().all()
    assert orthogonality_error(got) < 1e-5
    assert span_error(m[1:], got[1:]) < 1e-5


def test_empty_batch() -> None:
    m = torch.empty(0, 10, 2)
    assert _C.fused_orthogonalize(m, 0.0) is True


@pytest.mark.parametrize(
    "make",
    [
        lambda: random_batch(2, 20, 3, torch.float32, 0).transpose(0, 1),  # non-contiguous
        lambda: random_batch(2, 20, 3, torch.float32, 0)[:, ::2],  # strided rows
        lambda: random_batch(2, 20, 2, torch.bfloat16, 0),
        lambda: random_batch(2, 20, 2, torch.float16, 0),
        lambda: random_batch(2, 3, 4, torch.float32, 0),  # r > n
        lambda: random_batch(1, 100, 65, torch.float32, 0),  # r above the CPU limit
        lambda: random_batch(1, 20, 2, torch.float32, 0)[0],  # not a batch
    ],
    ids=["transposed", "strided", "bf16", "fp16", "r>n", "r=65", "2-d"],
)
def test_unsupported_input_is_left_alone(make) -> None:
    m = make()
    before = m.clone()
    assert _C.fused_orthogonalize(m, 1e-8) is False
    assert torch.equal(m, before)


@pytest.mark.gpu
@pytest.mark.parametrize("r", RANKS)
def test_cuda_matches_torch_on_cuda(r: int) -> None:
    """The CUDA kernel against torch's _orthogonalize on CUDA tensors (its Gram-Schmidt in
    torch's CUDA ops for r <= 2, CUDA's linalg.qr above), with the CPU test's bounds."""
    for n in NS + (TALL_NS if r > 2 else []):
        if r <= n:
            check_matches_torch(r, n, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("r", [1, 2, 4, 8, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_matches_cpu(r: int, dtype: torch.dtype) -> None:
    for n, eps in [(r, 0.0), (1000, 0.0), (4096, 1e-8), (70_000, 0.0)]:
        m = random_batch(5, n, r, dtype, seed=n + r)
        if r > 2:
            m[1, :, r - 1] = 0  # the completion path
        want = fused(m, eps)
        got = m.cuda()
        assert _C.fused_orthogonalize(got, eps) is True
        got = got.cpu()
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        what = f"{dtype} n {n} r {r}"
        assert orthogonality_error(got) < orthogonality_bound(m, eps), what
        # The same algorithm, but sums in another order: the columns agree where the
        # matrices are well conditioned and no completion (whose basis vector may differ on a
        # near tie) happened.
        if n >= 2 * r:
            keep = [b for b in range(5) if r <= 2 or b != 1]
            torch.testing.assert_close(got[keep], want[keep], rtol=tol, atol=tol, msg=what)
    wide = torch.randn(2, 64, 33, device="cuda")
    assert _C.fused_orthogonalize(wide, 0.0) is False
