"""fastddp.DiLoCo against torchft's ``torchft.local_sgd.DiLoCo`` (torchft 0.2.0), run on every
rank of a harness world: each rank is one torchft replica group of one rank (its own TCPStore
and Manager on a torchft ProcessGroupGloo, as torchft's local_sgd_integ_test.py builds them),
joined through the Lighthouse the test process runs. No failure is injected.
"""

import copy
from datetime import timedelta

import torch
import torch.distributed as dist

import fastddp
from tests.python.diloco.diloco_scenarios import local_step
from tests.python.scenarios import agree, mlp, rounding_ulps

# Generous: the ranks share 2 loaded cores with other test runs; nothing waits this long on a
# healthy run, and the harness's own deadline (the test's timeout_s) is longer still.
TORCHFT_TIMEOUT = timedelta(seconds=90)


def _fragments(model: torch.nn.Module, streaming: bool) -> list[torch.nn.Module]:
    """The whole model, or its three Linear layers (mlp()'s modules 0, 2 and 4) as fragments."""
    return [model[0], model[2], model[4]] if streaming else [model]


def _torchft_run(lighthouse: str, base: torch.nn.Module, steps: int, sync_every: int,
                 outer_lr: float, outer_momentum: float, streaming: bool, overlap: int,
                 merge_alpha: float) -> torch.nn.Module:
    from torchft.local_sgd import DiLoCo as TorchftDiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    model = copy.deepcopy(base)
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    fragments = _fragments(model, streaming)
    outer = [torch.optim.SGD(f.parameters(), lr=outer_lr, momentum=outer_momentum,
                             nesterov=True) for f in fragments]
    store = dist.TCPStore(host_name="localhost", port=0, is_master=True,
                          wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=TORCHFT_TIMEOUT),
        min_replica_size=2,
        load_state_dict=lambda state: model.load_state_dict(state["model"]),
        state_dict=lambda: {"model": model.state_dict()},
        replica_id=f"diloco_test_{dist.get_rank()}",
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        port=0,
        timeout=TORCHFT_TIMEOUT,
        quorum_timeout=TORCHFT_TIMEOUT,
        connect_timeout=TORCHFT_TIMEOUT,
        use_async_quorum=False,  # torchft's DiLoCo requires it
        # Not init_sync: at step 0 it would copy replica 0's state into the others at the first
        # quorum (the first sync, after H local steps), which fastddp's DiLoCo does at
        # construction, before any step.
        init_sync=False,
    )
    try:
        with TorchftDiLoCo(manager, fragments, inner, outer, sync_every=sync_every,
                           fragment_sync_delay=overlap, fragment_update_alpha=merge_alpha):
            for step in range(steps):
                local_step(model, inner, step)
    finally:
        manager.shutdown(wait=False)
    return model


def matches_torchft(lighthouse: str, steps: int, sync_every: int, streaming: bool = False,
                    overlap: int = 0, merge_alpha: float = 0.0) -> None:
    """The same model, data, AdamW inner optimizer and outer SGD(0.7, 0.9, nesterov) under
    both; the weights after `steps` inner steps agree. `streaming`: the three Linear layers
    as fragments (torchft's model_fragments, one outer optimizer each), with `overlap`
    (torchft's fragment_sync_delay) and `merge_alpha` (its fragment_update_alpha).

    Both average the fp32 pseudo-gradient as a SUM allreduce over gloo then a division by the
    number of ranks, and step the same torch SGD: on 2 ranks bit for bit (measured). On 3,
    gloo's ring adds the ranks in an order set by how it chunks each buffer, and torchft
    reduces each parameter alone where fastddp reduces one flat buffer: each sync's average
    may differ by rounding_ulps() (tests/python/scenarios.py) of a tensor's largest |element|,
    allowed once per sync (measured on 3 ranks: at most 1.5e-8 after 2 syncs)."""
    torch.manual_seed(0)
    base = mlp()
    model = copy.deepcopy(base)
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    with fastddp.DiLoCo(model, inner, sync_every=sync_every, outer_lr=0.7, outer_momentum=0.9,
                        fragments=_fragments(model, streaming), overlap=overlap,
                        merge_alpha=merge_alpha):
        for step in range(steps):
            local_step(model, inner, step)
    theirs = _torchft_run(lighthouse, base, steps, sync_every, 0.7, 0.9, streaming, overlap,
                          merge_alpha)
    ulps = rounding_ulps() * (steps // sync_every)

    def check() -> None:
        for (name, ref), ours in zip(theirs.named_parameters(), model.parameters(), strict=True):
            atol = ulps * torch.finfo(torch.float32).eps * ref.detach().abs().max().item()
            torch.testing.assert_close(ours.detach(), ref.detach(), rtol=0, atol=atol,
                                       msg=lambda m: f"{name} against torchft's DiLoCo: {m}")
    agree(check)
