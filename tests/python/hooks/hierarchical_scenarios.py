"""Hierarchical-reduction scenarios on 4 gloo ranks as 2 nodes x 2 local ranks (see
harness.py). The reference is written here in plain torch collectives over groups of its
own: each rank's local gradient (a plain model, no DDP) goes through the algorithm of Note
[hierarchical reduction] as one flat tensor. Every step of that algorithm is elementwise
(a 2-term float sum is commutative, rounding is per element), so the bucket layout fastddp
chose does not change a bit of the result.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fastddp
from tests.python.scenarios import ULPS, agree, assert_close_ulps, vector_batch

LOCAL = 2
EXACT = {"rtol": 0.0, "atol": 0.0}


def odd_mlp() -> nn.Module:
    """Parameters of 240, 30, 510, 17, 68 and 4 elements: most buckets need padding."""
    return nn.Sequential(nn.Linear(8, 30), nn.Tanh(), nn.Linear(30, 17), nn.ReLU(),
                         nn.Linear(17, 4))


def _reference_groups() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    world = dist.get_world_size()
    nodes = world // LOCAL
    intra, _ = dist.new_subgroups_by_enumeration(
        [list(range(k * LOCAL, (k + 1) * LOCAL)) for k in range(nodes)])
    inter, _ = dist.new_subgroups_by_enumeration(
        [list(range(j, world, LOCAL)) for j in range(LOCAL)])
    return intra, inter


def reference(flat: torch.Tensor, inner: str, intra: dist.ProcessGroup,
              inter: dist.ProcessGroup) -> torch.Tensor:
    """The algorithm in torch ops: reduce_scatter of g/local in float32 inside the node,
    `inner` ("none": float allreduce / nodes; "bf16": bf16(shard / nodes), bf16 allreduce)
    between nodes, allgather inside the node."""
    n, local, nodes = flat.numel(), intra.size(), inter.size()
    padded = torch.zeros((n + local * nodes - 1) // (local * nodes) * local * nodes)
    padded[:n] = flat * (1.0 / local)
    shard = torch.empty(padded.numel() // local)
    dist.reduce_scatter_tensor(shard, padded, group=intra)
    if inner == "none":
        shard.mul_(1.0 / nodes)
        dist.all_reduce(shard, group=inter)
    else:
        wire = (shard * (1.0 / nodes)).to(torch.bfloat16)
        dist.all_reduce(wire, group=inter)
        shard = wire.float()
    out = torch.empty_like(padded)
    dist.all_gather_into_tensor(out, shard, group=intra)
    return out[:n]


def _hook(inner: str, source: str, gradient_as_bucket_view: bool = False):
    if inner == "int8":  # item 2 of issue 16, from another branch: by its registry name
        inter = fastddp.hooks.from_registry("int8")
    else:
        inter = {"none": fastddp.hooks.allreduce(), "bf16": fastddp.hooks.bf16(),
                 "bf16_fp32": fastddp.hooks.bf16(accumulate="fp32")}[inner]
    if source == "groups":
        return fastddp.hooks.hierarchical(inter=inter,
                                          groups=fastddp.hooks.hierarchical_groups(LOCAL))
    if source == "mesh":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size() // LOCAL, LOCAL),
                                mesh_dim_names=("node", "local"))
        return fastddp.hooks.hierarchical(inter=inter, mesh=mesh)
    return fastddp.hooks.hierarchical(inter=inter, local_size=LOCAL)


def hier_training(inner: str, source: str = "local_size", steps: int = 3,
                  gradient_as_bucket_view: bool = False) -> str:
    """fastddp with the hierarchical hook against the reference of the same algorithm
    ("bf16", "bf16_fp32": bit for bit) and against the exact mean of the gradients
    ("none": a few ulps; the bf16 ones: within bf16 rounding; "int8": within int8 rounding
    of the mean only). Returns the hook's name."""
    intra, inter = _reference_groups()
    torch.manual_seed(0)
    base = odd_mlp()
    fast = fastddp.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.001,
                                           gradient_as_bucket_view=gradient_as_bucket_view)
    fast.register_comm_hook(None, _hook(inner, source))
    local = copy.deepcopy(base)
    opt = torch.optim.SGD(fast.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        inputs, target = vector_batch(step)
        opt.zero_grad(set_to_none=step % 2 == 0)
        local.zero_grad()
        F.mse_loss(fast(inputs), target).backward()
        F.mse_loss(local(inputs), target).backward()
        mine = torch.cat([p.grad.flatten() for p in local.parameters()])
        got = torch.cat([p.grad.flatten() for p in fast.parameters()])
        mean = mine.clone()
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
        ref = reference(mine, "none" if inner == "none" else "bf16", intra, inter)

        def check() -> None:
            where = f"step {step}, hierarchical({inner}) via {source}"
            if inner == "none":
                # The mean's 4-rank sum rounds 3 times in gloo's order, the algorithm's twice
                # in its own (x 1/2 is exact): a few ulps of the largest |gradient| (measured
                # 0.5; scenarios.ULPS). The reference is the same elementwise ops: bit for bit.
                assert_close_ulps(got, mean, ULPS, msg=lambda m: f"{where} vs the mean: {m}")
                torch.testing.assert_close(got, ref, **EXACT,
                                           msg=lambda m: f"{where} vs the reference: {m}")
                return
            if inner == "int8":
                # int8 (Note [8-bit wire formats]): a step is 1/127 of its 256-element
                # block's largest |value|, and each element is quantized twice between the
                # nodes (its node's share, then the sum), about a quarter step off each on
                # average: L1 error ~ blockmax / 254, which these gradients' blocks (largest
                # ~7x their mean |value|) make 2.8e-2 of the mean's L1 norm (measured 2.9e-2).
                rel = ((got - mean).abs().sum() / mean.abs().sum()).item()
                assert 0 < rel < 3e-2, f"{where}: relative L1 error {rel:.2e} vs the exact mean"
                return
            # With 2 nodes, fp32 accumulation sums the same two bf16 values and rounds once,
            # as the bf16 allreduce does: both equal the reference bit for bit.
            torch.testing.assert_close(got, ref, **EXACT,
                                       msg=lambda m: f"{where} vs the reference: {m}")
            # bf16 rounds each element twice (the shard before the inter-node sum, the sum),
            # half an ulp, 2^-9 relative, each: 3.9e-3 of the L1 norm where the nodes'
            # shares do not cancel, 8e-3 allowing their L1 norm twice the mean's
            # (measured 2.2e-3).
            rel = ((got - mean).abs().sum() / mean.abs().sum()).item()
            assert rel < 8e-3, f"{where}: relative L1 error {rel:.2e} vs the exact mean"
            assert not torch.equal(got, mean), f"{where}: bf16 left no trace"

        agree(check)
        opt.step()
        with torch.no_grad():
            for p, q in zip(local.parameters(), fast.parameters()):
                p.copy_(q)
    # comm_stats' wire bytes: the inner hook's for this rank's shard (1/LOCAL of the bucket
    # padded to a multiple of the world size), what crosses the inter-node link.
    world = dist.get_world_size()
    width = {"none": 4, "int8": None}.get(inner, 2)
    for b in fast.comm_stats()["buckets"] if width else []:
        shard = (b["numel"] + world - 1) // world * world // LOCAL
        assert b["wire_bytes"] == shard * width, (b, shard, width)
    return fast._reducer.hook_name


def _error(fn) -> str | None:
    try:
        fn()
    except (ValueError, TypeError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def bad_configurations() -> dict[str, str | None]:
    """The error each wrong setup raises (None: it raised nothing), on every rank alike."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    hooks = fastddp.hooks
    world = dist.get_world_size()
    errors: dict[str, str | None] = {}
    errors["local_size=1"] = _error(lambda: hooks.hierarchical(local_size=1))
    errors["inter=auto"] = _error(lambda: hooks.hierarchical(inter=hooks.auto()))
    errors["inter=hier"] = _error(lambda: hooks.hierarchical(inter=hooks.hierarchical(
        local_size=2)))

    def register(hook, group=None) -> None:
        model = fastddp.DistributedDataParallel(odd_mlp(), process_group=group)
        model.register_comm_hook(None, hook)

    errors["local_size=3"] = _error(lambda: register(hooks.hierarchical(local_size=3)))
    errors["local_size=world"] = _error(lambda: register(hooks.hierarchical(local_size=world)))
    grid = torch.arange(world).view(world // LOCAL, LOCAL)
    errors["mesh misnamed"] = _error(lambda: hooks.hierarchical(
        mesh=DeviceMesh("cpu", grid, mesh_dim_names=("local", "node"))))
    errors["mesh node dim 1"] = _error(lambda: hooks.hierarchical(
        mesh=DeviceMesh("cpu", grid.view(1, world), mesh_dim_names=("node", "local"))))
    errors["mesh local dim 1"] = _error(lambda: hooks.hierarchical(
        mesh=DeviceMesh("cpu", grid.view(world, 1), mesh_dim_names=("node", "local"))))
    errors["mesh 1-D"] = _error(lambda: hooks.hierarchical(
        mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("node",))))
    # A model over half of the world with a mesh over all of it.
    half, _ = dist.new_subgroups(world // 2)
    mesh = init_device_mesh("cpu", (world // LOCAL, LOCAL), mesh_dim_names=("node", "local"))
    errors["mesh does not tile"] = _error(
        lambda: register(hooks.hierarchical(mesh=mesh), group=half))
    return errors


class FailOnceGroup(dist.ProcessGroup):
    """The inter-node group behind a Python ProcessGroup whose `fail_at`-th allreduce runs
    (the peer gets its sum) and then, where `failing`, raises: one
    rank of a node sees one bucket's inter-node reduction fail, its node's other rank not."""

    def __init__(self, inner: dist.ProcessGroup, fail_at: int, failing: bool) -> None:
        super().__init__(inner.rank(), inner.size())
        self.inner, self.fail_at, self.failing, self.calls = inner, fail_at, failing, 0

    def allreduce(self, tensor_list, opts=None):
        self.calls += 1
        work = self.inner.allreduce(tensor_list)
        if not self.failing or self.calls != self.fail_at:
            return work
        work.wait()
        raise RuntimeError("injected inter-node failure")  # as gloo raises for a dead peer

    def getBackendName(self) -> str:
        return "python-fail-once"


def inner_fails_on_one_rank(steps: int = 4) -> list[str | None]:
    """Rank 0's inter-node reduction of its second bucket fails in step 1, no other rank's
    does (Note [hierarchical reduction], its failure paragraph): rank 0's backward raises,
    the others' do not, and the other steps are the exact mean on every rank. Rank 0 still
    issues that bucket's allgather inside its node: had it skipped it, its node peer's
    allgather would pair with rank 0's next intra collective (a mismatch or a hang, and no
    correct later step). Step 0 succeeds everywhere, so that every rank rebuilds its buckets
    after it alike. Returns each step's error on this rank (None: it raised nothing)."""
    intra, inter = fastddp.hooks.hierarchical_groups(LOCAL)
    torch.manual_seed(0)
    model = fastddp.DistributedDataParallel(odd_mlp(), bucket_cap_mb=0.001)
    failing = FailOnceGroup(inter, fail_at=0, failing=dist.get_rank() == 0)
    model.register_comm_hook(None, fastddp.hooks.hierarchical(
        inter=fastddp.hooks.allreduce(), groups=(intra, failing)))
    assert len(model._initial_bucket_sizes) > 2  # the failing bucket is not the last
    errors: list[str | None] = []
    for step in range(steps):
        if step == 1:
            failing.fail_at = failing.calls + 2  # this step's second bucket
        inputs, target = vector_batch(step)
        model.zero_grad()
        try:
            F.mse_loss(model(inputs), target).backward()
        except RuntimeError as e:
            errors.append(str(e))
            continue
        errors.append(None)
        if step == 1:
            continue  # rank 0's node peer holds zeros in rank 0's shard of that bucket
        got = torch.cat([p.grad.flatten() for p in model.parameters()])
        local = copy.deepcopy(model.module)
        local.zero_grad()
        F.mse_loss(local(inputs), target).backward()
        mean = torch.cat([p.grad.flatten() for p in local.parameters()])
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
        # As in hier_training's "none": a few ulps of the largest |gradient|.
        agree(lambda: assert_close_ulps(got, mean, ULPS, msg=lambda m: f"step {step}: {m}"))
    return errors
