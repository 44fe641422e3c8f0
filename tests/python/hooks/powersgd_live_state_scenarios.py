"""torch's PowerSGDState registered with torch's hook function on fastddp (run by the native
hook, kept live on it), on every rank of a harness world: its fields against torch's own
hook on the same data, torch's checkpoint recipe (torch.save / pickle the state, register
it again on a new model), and what a state does when its model goes.
"""

import copy
import gc
import io
import pickle

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from tests.python.hooks.powersgd_scenarios import (TOL, Mixed, batch,
                                                   serialized_batched_powerSGD_hook)
from tests.python.hooks.powersgd_state_scenarios import _ulps
from tests.python.scenarios import agree, step_grads, unwrap

ARGS = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2,
        "compression_stats_logging_frequency": 3}
# Mixed in one bucket: torch's powerSGD_hook waits for a collective inside a future
# callback, which deadlocks on gloo with two or more buckets.
ONE_BUCKET_MB = 25
SCALARS = ("iter", "total_numel_before_compression", "total_numel_after_compression",
           "next_stats_report")
DICTS = ("error_dict", "p_memory_dict", "q_memory_dict")


def _hook(batched: bool):
    return psgd.batched_powerSGD_hook if batched else psgd.powerSGD_hook


def _fast(module, state, batched: bool, cap: float, **ddp_args):
    model = fastddp.DistributedDataParallel(module, bucket_cap_mb=cap, **ddp_args)
    model.register_comm_hook(state, _hook(batched))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _step(model, opt, step: int) -> list[torch.Tensor]:
    return step_grads(model, opt, batch(step))


def fields(state) -> dict:
    """The training-state fields of a PowerSGDState, as plain values (one read each)."""
    out = {name: getattr(state, name) for name in SCALARS}
    _, key, pos, *_ = state.rng.get_state()
    out["rng"] = (key.tolist(), int(pos))
    out["stats"] = tuple(state.compression_stats())
    for name in DICTS:
        out[name] = {k: (v.clone(), getattr(v, "_fastddp_layout", None))
                     for k, v in getattr(state, name).items()}
    return out


def same_fields(a: dict, b: dict, where: str) -> None:
    """Bitwise: the same scalars, generator, keys, tensors and layouts."""
    for name in (*SCALARS, "rng", "stats"):
        assert a[name] == b[name], f"{where}: {name} {a[name]!r} != {b[name]!r}"
    for name in DICTS:
        assert sorted(a[name]) == sorted(b[name]), f"{where}: {name} keys"
        for k, (t, layout) in a[name].items():
            u, other = b[name][k]
            assert torch.equal(t, u), f"{where}: {name}[{k}] differs"
            assert layout == other, f"{where}: {name}[{k}] layout {layout} != {other}"


def per_parameter(table: dict) -> dict[str, torch.Tensor]:
    """A torch-layout dict of fields() cut into its parameters' parts (by the layout fastddp
    writes on each tensor): independent of the bucket layout."""
    out = {}
    for t, layout in table.values():
        flat, offset = t.reshape(-1), 0
        for name, *dims in layout["params"]:
            numel = int(np.prod(dims))
            out[name] = flat[offset:offset + numel]
            offset += numel
    return out


def _same_per_parameter(a: dict, b: dict, where: str) -> None:
    """same_fields() for states of models whose buckets differ: the dicts per parameter."""
    for name in (*SCALARS, "rng", "stats"):
        assert a[name] == b[name], f"{where}: {name} {a[name]!r} != {b[name]!r}"
    for name in ("error_dict", "q_memory_dict"):
        x, y = per_parameter(a[name]), per_parameter(b[name])
        assert sorted(x) == sorted(y), (where, name, sorted(x), sorted(y))
        assert all(torch.equal(x[k], y[k]) for k in x), (where, name)


# --- (a) against torch's own hook ---------------------------------------------------------

def against_torch(steps: int = 7, batched: bool = False, **args) -> dict:
    """torch DDP + torch's hook and a PowerSGDState against fastddp + torch's hook and
    another: iter and the statistics after every step, then the generator, error_dict and
    the memories. One bucket (see ONE_BUCKET_MB); parameters copied from torch's model after
    every step, so float rounding does not compound through the optimizer."""
    args = {**ARGS, **args}
    torch.manual_seed(0)
    base = Mixed()
    ref = TorchDDP(copy.deepcopy(base), bucket_cap_mb=ONE_BUCKET_MB)
    ref_state = psgd.PowerSGDState(None, **args)
    # torch 2.14's batched hook needs its 2-D _orthogonalize patched (powersgd_scenarios).
    ref.register_comm_hook(ref_state, serialized_batched_powerSGD_hook if batched
                           else psgd.powerSGD_hook)
    state = psgd.PowerSGDState(None, **args)
    fast, fast_opt = _fast(copy.deepcopy(base), state, batched, ONE_BUCKET_MB)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    per_step = []
    for step in range(steps):
        _step(ref, ref_opt, step)
        _step(fast, fast_opt, step)
        with torch.no_grad():
            for p, q in zip(ref.parameters(), fast.parameters()):
                q.copy_(p)
        per_step.append((state.iter, state.compression_stats()))
        assert per_step[-1] == (ref_state.iter, ref_state.compression_stats()), (
            step, per_step[-1], ref_state.iter, ref_state.compression_stats())
    ours, theirs = fields(state), fields(ref_state)
    p_native = "ps" in fast._native_hook.state_dict() or "bucket_ps" in (
        fast._native_hook.state_dict())

    def check() -> None:
        for name in (*SCALARS, "rng", "stats"):
            assert ours[name] == theirs[name], (name, ours[name], theirs[name])
        for name in DICTS:
            assert sorted(ours[name]) == sorted(theirs[name]), (name, list(ours[name]),
                                                                  list(theirs[name]))
            for k, (t, _) in theirs[name].items():
                mine = ours[name][k][0]
                assert mine.shape == t.shape, (name, k, mine.shape, t.shape)
                if name == "p_memory_dict" and not p_native:
                    assert not mine.any(), "without the module's P, zeros of P's shape"
                    continue
                # PowerSGD's rounding bound (powersgd_scenarios.TOL), relative to each
                # tensor's largest element: measured 1.4e-5 (the error, a residual M - P Q^T,
                # is smaller than M, so M's rounding is a larger part of it).
                scale = float(t.abs().max())
                torch.testing.assert_close(mine, t, rtol=TOL["rtol"], atol=TOL["atol"] * scale,
                                           msg=lambda m, n=name, k=k: f"{n}[{k}]: {m}")
    agree(check)
    return {"iter": ours["iter"], "stats": ours["stats"], "per_step": per_step,
            "keys": {n: sorted(ours[n]) for n in DICTS}, "p_native": p_native,
            "live_type": type(state).__name__, "is_state": isinstance(state, psgd.PowerSGDState),
            "error_layout": ours["error_dict"][0][1] if ours["error_dict"] else None}


# --- (b), (c), (d): torch's checkpoint recipe ----------------------------------------------

def _save(obj: object, via: str) -> bytes:
    if via == "pickle":
        return pickle.dumps(obj)
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _load(blob: bytes, via: str) -> object:
    if via == "pickle":
        return pickle.loads(blob)
    return torch.load(io.BytesIO(blob), weights_only=False)


def resume(via: str = "torch.save", batched: bool = False, cap: float = 0.004,
           cut: int = 4, steps: int = 8, **ddp_args) -> dict:
    """One fastddp run of `steps` steps against one resumed after `cut` from a checkpoint of
    the model, the optimizer and the PowerSGDState, by torch's recipe: load the state, set
    its process_group, register it with a new model. `via`: "torch.save" or "pickle";
    "fresh": the control, a new PowerSGDState instead of the saved one."""
    torch.manual_seed(0)
    state = psgd.PowerSGDState(None, **ARGS)
    model, opt = _fast(Mixed(), state, batched, cap, **ddp_args)
    whole = {s: _step(model, opt, s) for s in range(cut)}
    blob = _save({"model": unwrap(model).state_dict(), "opt": opt.state_dict(),
                  "psgd": state}, "pickle" if via == "pickle" else "torch.save")
    whole.update({s: _step(model, opt, s) for s in range(cut, steps)})
    final = fields(state)

    saved = _load(blob, "pickle" if via == "pickle" else "torch.save")
    loaded = saved["psgd"]
    plain = type(loaded) is psgd.PowerSGDState
    if via == "fresh":
        loaded = psgd.PowerSGDState(None, **ARGS)
    loaded.process_group = dist.group.WORLD  # torch's recipe
    module = Mixed()
    module.load_state_dict(saved["model"])
    resumed, ropt = _fast(module, loaded, batched, cap, **ddp_args)
    ropt.load_state_dict(saved["opt"])
    resumed_iter = loaded.iter
    again = {s: _step(resumed, ropt, s) for s in range(cut, steps)}
    pairs = [(a, b) for s in range(cut, steps) for a, b in zip(whole[s], again[s], strict=True)]
    out = {"equal": all(torch.equal(a, b) for a, b in pairs),
           "max_diff": max(float((a - b).abs().max()) for a, b in pairs), "ulps": _ulps(pairs),
           "loaded_plain": plain, "iter_at_resume": resumed_iter, "final_iter": loaded.iter,
           "plans": [model.bucket_plan(), resumed.bucket_plan()]}
    try:
        same_fields(final, fields(loaded), "final state")
        out["same_final_state"] = True
    except AssertionError as e:
        out["same_final_state"] = str(e)
    return out


def _modules_in(blob: bytes) -> list[str]:
    """The modules a pickle's classes and functions come from."""
    seen = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            seen.add(module)
            return super().find_class(module, name)

    Recorder(io.BytesIO(blob)).load()
    return sorted(seen)


def _trained_live_state(steps: int, batched: bool = False):
    """A fresh PowerSGDState registered on a fresh Mixed model (0.004 MiB buckets), trained
    `steps` steps: (state, model, optimizer)."""
    torch.manual_seed(0)
    state = psgd.PowerSGDState(None, **ARGS)
    model, opt = _fast(Mixed(), state, batched, 0.004)
    for s in range(steps):
        _step(model, opt, s)
    return state, model, opt


def pickle_roundtrip(batched: bool = False, steps: int = 4) -> dict:
    """pickle, torch.save (the state itself) and deepcopy of a live state: torch's plain
    class with the live values; a copy stays as it was while the live state moves on."""
    state, model, opt = _trained_live_state(steps, batched=batched)
    live = fields(state)
    blob = pickle.dumps(state)
    copies = {"pickle": pickle.loads(blob),
              "torch.save": _load(_save(state, "torch.save"), "torch.save"),
              "deepcopy": copy.deepcopy(state)}
    for how, c in copies.items():
        assert type(c) is psgd.PowerSGDState, (how, type(c))
        assert c.process_group is not None, how  # torch's __setstate__: the default group
        same_fields(live, fields(c), how)
    _step(model, opt, steps)
    moved = fields(state)
    assert moved["iter"] == live["iter"] + 1 and fields(copies["pickle"])["iter"] == live["iter"]
    return {"iter": live["iter"], "modules": _modules_in(blob),
            "keys": {n: sorted(live[n]) for n in DICTS}}


# --- the model goes; writes; states fastddp cannot take -----------------------------------

def model_deleted(steps: int = 4) -> dict:
    """The state keeps the native hook's final values and is a plain PowerSGDState again."""
    state, model, opt = _trained_live_state(steps)
    before = fields(state)
    live_type = type(state).__name__
    del model, opt
    gc.collect()
    after = fields(state)
    same_fields(before, after, "after the model went")
    plain = type(state) is psgd.PowerSGDState
    state.iter = 0  # a plain state again: writable
    return {"live_type": live_type, "plain": plain, "iter": after["iter"],
            "errors": len(after["error_dict"])}


def writes_refused() -> dict[str, str]:
    state, model, opt = _trained_live_state(3)
    out = {}
    for case, write in (("iter", lambda: setattr(state, "iter", 0)),
                        ("error_item", lambda: state.error_dict.__setitem__(0, torch.zeros(1))),
                        ("q_clear", lambda: state.q_memory_dict.clear())):
        try:
            write()
        except NotImplementedError as e:
            out[case] = str(e)
    dist.barrier()
    return out


def torch_state(steps: int = 3) -> dict:
    """A PowerSGDState that torch's own hook filled: refused with its dicts (nothing is
    registered), taken with them emptied (its iteration, generator and statistics go on)."""
    torch.manual_seed(0)
    base = Mixed()
    ref = TorchDDP(copy.deepcopy(base), bucket_cap_mb=ONE_BUCKET_MB)
    state = psgd.PowerSGDState(None, **ARGS)
    ref.register_comm_hook(state, psgd.powerSGD_hook)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for s in range(steps):
        _step(ref, ref_opt, s)
    fast = fastddp.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=ONE_BUCKET_MB)
    out = {}
    try:
        fast.register_comm_hook(state, psgd.powerSGD_hook)
    except NotImplementedError as e:
        out["refused"] = str(e)
    before = (state.iter, state.compression_stats(), state.rng.get_state()[2])
    state.error_dict, state.p_memory_dict, state.q_memory_dict = {}, {}, {}
    fast.register_comm_hook(state, psgd.powerSGD_hook)  # the same model: nothing was left
    after = (state.iter, state.compression_stats(), state.rng.get_state()[2])
    _step(fast, torch.optim.SGD(fast.parameters(), lr=0.05), steps)
    out.update(kept=before == after, iter=state.iter, errors=sorted(state.error_dict))
    return out


def own_state_dict(steps: int = 4) -> dict:
    """model.comm_hook_state_dict() / load_comm_hook_state_dict() on a model with a
    registered PowerSGDState; a load shows in the live state."""
    state, model, opt = _trained_live_state(steps)
    saved = model.comm_hook_state_dict()
    other = psgd.PowerSGDState(None, **ARGS)
    fresh, _ = _fast(Mixed(), other, False, 0.004)
    iter_before = other.iter
    fresh.load_comm_hook_state_dict(saved)
    ours, theirs = fields(state), fields(other)
    for name in ("iter", "rng", "stats", "next_stats_report"):
        assert ours[name] == theirs[name], (name, ours[name], theirs[name])
    return {"iter_before": iter_before, "iter": theirs["iter"], "saved_iter": saved["iter"]}


def reregistered(steps: int = 3) -> dict:
    """A live state registered on a second model follows it: the first model's steps and
    its deletion no longer touch the state."""
    state, first, opt = _trained_live_state(steps)
    at_move = fields(state)
    module = Mixed()
    module.load_state_dict(unwrap(first).state_dict())
    second, opt2 = _fast(module, state, False, 0.004)
    # The dicts are keyed by the new model's buckets (not rebuilt yet): compare per parameter.
    _same_per_parameter(at_move, fields(state), "registered again")
    _step(first, opt, steps)  # the first model alone: not the state's any more
    iter_after_first = state.iter
    _step(second, opt2, steps)
    del first, opt
    gc.collect()
    return {"iter_at_move": at_move["iter"], "after_first": iter_after_first,
            "after_second": state.iter, "still_live": type(state) is not psgd.PowerSGDState}


def world1(steps: int = 5) -> dict:
    """At world size 1 (fastddp runs a registered hook there too, as torch does): the state's
    iter and statistics against torch DDP with torch's hook."""
    torch.manual_seed(0)
    base = Mixed()
    ref = TorchDDP(copy.deepcopy(base), bucket_cap_mb=ONE_BUCKET_MB)
    ref_state = psgd.PowerSGDState(None, **ARGS)
    ref.register_comm_hook(ref_state, psgd.powerSGD_hook)
    state = psgd.PowerSGDState(None, **ARGS)
    fast, opt = _fast(copy.deepcopy(base), state, False, ONE_BUCKET_MB)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for s in range(steps):
        _step(ref, ref_opt, s)
        _step(fast, opt, s)
    return {"iter": (state.iter, ref_state.iter),
            "stats": (state.compression_stats(), ref_state.compression_stats()),
            "errors": (sorted(state.error_dict), sorted(ref_state.error_dict)),
            "rng": (int(state.rng.get_state()[2]), int(ref_state.rng.get_state()[2])),
            "same_rng_key": bool(np.array_equal(state.rng.get_state()[1],
                                                ref_state.rng.get_state()[1]))}


def model_copied(steps: int = 4) -> dict:
    """copy.deepcopy of a fastddp model with a registered PowerSGDState: the copy gets a copy
    of the state, live on the copy's hook, and both take the same next steps."""
    state, model, opt = _trained_live_state(steps)
    clone = copy.deepcopy(model)
    clone_opt = torch.optim.SGD(clone.parameters(), lr=0.05, momentum=0.9)
    clone_opt.load_state_dict(opt.state_dict())
    clone_state = clone._comm_hooks[0][1]
    ours, theirs = _step(model, opt, steps), _step(clone, clone_opt, steps)
    a, b = fields(state), fields(clone_state)
    scalars = all(a[n] == b[n] for n in (*SCALARS, "rng", "stats"))
    # The copy's buckets are not the original's (compare per parameter); on 3 ranks gloo's
    # ring then adds in another order.
    x, y = per_parameter(a["error_dict"]), per_parameter(b["error_dict"])
    assert sorted(x) == sorted(y), (sorted(x), sorted(y))
    return {"equal": all(torch.equal(u, v) for u, v in zip(ours, theirs, strict=True)),
            "max_diff": max(float((u - v).abs().max()) for u, v in zip(ours, theirs)),
            "error_diff": max(float((x[k] - y[k]).abs().max()) for k in x),
            "ulps": _ulps(list(zip(ours, theirs))),
            "error_ulps": _ulps([(x[k], y[k]) for k in x]),
            "same_scalars": scalars, "distinct": clone_state is not state,
            "iters": (state.iter, clone_state.iter), "clone_live": type(clone_state).__name__}
