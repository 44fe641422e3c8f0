"""How the reduced gradients are handed out in .grad, fastddp against torch DDP (issue 55):
run on every rank of a harness world (see harness.py).

Under torch DDP's default mode (gradient_as_bucket_view=False) a parameter's .grad is a
tensor of its own, which the reducer fills from the bucket after the allreduce; under
gradient_as_bucket_view=True it is a view of the bucket. fastddp may hand out the bucket's
memory instead of copying it only where no user can tell: every scenario here trains torch
DDP and fastddp side by side from one seed on the same per-rank data and compares, after
every backward and every optimizer step, bit for bit (no tolerance anywhere, on 2 ranks
and on 3: both reduce the same bucket layout in the same order):

* the parameters and the .grad values (torch.equal), .grad being None exactly where
  torch's is;
* what else a user can observe of each .grad (`_observed`): shape, dtype, strides,
  whether it is an autograd view, its storage offset and storage size (what torch.save and
  copy.deepcopy write, and what a kept reference keeps alive), which other grads share
  its storage, requires_grad, and whether it is the very tensor object that .grad held at
  the previous check. The storage is not compared under gradient_as_bucket_view with
  several buckets, where it differs by fastddp's design (`storage_comparable`).
"""

import copy
import io
import pickle
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh

import fastddp
from tests.python.ddp.contract_scenarios import Branchy
from tests.python.scenarios import ConvNet, agree, image_batch, mlp, side_by_side, vector_batch

STEPS = 5


# --- models ---------------------------------------------------------------------------

class KeepsGrad(torch.optim.SGD):
    """An optimizer that keeps a reference to each .grad it stepped on (not a copy), as
    some user optimizers and gradient-statistics trackers do."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["last_grad"] = p.grad
        return super().step(closure)


# --- what a user can observe ------------------------------------------------------------

def _observed(model: nn.Module, before: list) -> list[dict | None]:
    """Per parameter, what a user can see of .grad besides its values (None: no .grad).
    `before`: weak references to the .grad tensors at the previous check (None where
    none): weak, so that the checks keep no gradient alive that the training would free."""
    groups: dict[int, int] = {}
    seen = []
    for i, (p, old) in enumerate(zip(model.parameters(), before, strict=True)):
        g = p.grad
        earlier = None if old is None else old()
        if g is None:
            seen.append(None)
            continue
        storage = g.untyped_storage()
        seen.append({
            "shape": tuple(g.shape), "dtype": g.dtype, "stride": g.stride(),
            "is_view": g._is_view(), "storage_offset": g.storage_offset(),
            "storage_nbytes": storage.nbytes(),
            # the first parameter whose .grad lives in the same storage
            "storage_shared_with": groups.setdefault(storage.data_ptr(), i),
            "requires_grad": g.requires_grad,
            "same_tensor_as_before": g is earlier,
            # whether last check's .grad still exists, .grad or not (weakref.finalize,
            # a WeakKeyDictionary: a gradient dropped and not kept is freed under torch)
            "earlier_grad_alive": earlier is not None,
        })
    return seen


def _grads(model: nn.Module) -> list:
    return [p.grad for p in model.parameters()]


def _weak_grads(model: nn.Module) -> list:
    return [None if p.grad is None else weakref.ref(p.grad) for p in model.parameters()]


def _same_tensor(where: str, what: str, theirs: torch.Tensor, ours: torch.Tensor) -> None:
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, (
        f"{where}: {what}: fastddp {ours.dtype}{list(ours.shape)}, "
        f"torch DDP {theirs.dtype}{list(theirs.shape)}")
    if not torch.equal(ours, theirs):
        diff = (ours.double() - theirs.double()).abs()
        raise AssertionError(f"{where}: {what}: {int((diff > 0).sum())} of {ours.numel()} "
                             f"elements differ from torch DDP's, by up to {diff.max().item():.3g}")


STORAGE = ("storage_offset", "storage_nbytes", "storage_shared_with")


def storage_comparable(fast: nn.Module) -> bool:
    """Whether the .grad storages can be compared with torch's: not under
    gradient_as_bucket_view with several buckets, where fastddp's bucket views are slices
    of one flat buffer per dtype (Note [aligned flat buffer] in csrc/reducer/bucket.h,
    fastddp's design) and torch's of one tensor per bucket: their storage offsets and
    sizes differ there by design, and only the grads' own layout is compared."""
    return not (getattr(fast, "gradient_as_bucket_view", False)
                and len(fast.bucket_plan()) > 1)


class SideBySide:
    """torch DDP (`ref`) and fastddp (`fast`) and the checks between them. `ddp`: the
    fastddp model, where `fast` is a part of its module."""

    def __init__(self, ref: nn.Module, fast: nn.Module, ddp: nn.Module | None = None):
        self.ref, self.fast = ref, fast
        self.ddp = fast if ddp is None else ddp
        self.before = {m: [None] * len(list(m.parameters())) for m in (ref, fast)}

    @property
    def models(self) -> tuple[nn.Module, nn.Module]:
        return self.ref, self.fast

    def check(self, where: str) -> None:
        """Parameters, .grad values and what else is observable of .grad, on every rank."""
        ref, fast = _module(self.ref), _module(self.fast)
        theirs = _observed(ref, self.before[self.ref])
        ours = _observed(fast, self.before[self.fast])
        self.before = {m: _weak_grads(_module(m)) for m in self.models}
        skip = () if storage_comparable(self.ddp) else STORAGE

        def compare() -> None:
            names = [n for n, _ in ref.named_parameters()]
            for name, p, q, t, o in zip(names, ref.parameters(), fast.parameters(), theirs, ours,
                                        strict=True):
                _same_tensor(where, f"parameter {name}", p.detach(), q.detach())
                if t is None or o is None:
                    assert t is None and o is None, (
                        f"{where}: {name}.grad is {'None' if o is None else 'set'} under "
                        f"fastddp but {'None' if t is None else 'set'} under torch DDP")
                    continue
                _same_tensor(where, f"{name}.grad", p.grad, q.grad)
                bad = {k: (o[k], t[k]) for k in t if k not in skip and o[k] != t[k]}
                assert not bad, (f"{where}: {name}.grad differs from torch DDP's in "
                                 + ", ".join(f"{k} (fastddp {a}, torch {b})"
                                             for k, (a, b) in bad.items()))

        agree(compare)


def _module(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def _pair(build=mlp, **ddp_kwargs) -> SideBySide:
    return SideBySide(*side_by_side(build, **ddp_kwargs))


def _optimizers(pair: SideBySide, cls=torch.optim.SGD, **kwargs) -> list[torch.optim.Optimizer]:
    kwargs = kwargs or {"lr": 0.05, "momentum": 0.9}
    return [cls(m.parameters(), **kwargs) for m in pair.models]


def _backward(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    inputs, target = batch
    F.mse_loss(model(inputs), target).backward()


def _train(pair: SideBySide, opts: list, steps: int = STEPS, set_to_none: bool = True,
           batch=vector_batch, first_step: int = 0, tell_step: bool = False) -> None:
    """`tell_step`: the module's `step` is set before each forward (Branchy)."""
    for step in range(first_step, first_step + steps):
        for model, opt in zip(pair.models, opts):
            if tell_step:
                model.module.step = step
            opt.zero_grad(set_to_none=set_to_none)
            _backward(model, batch(step))
        pair.check(f"step {step}, after backward")
        for opt in opts:
            opt.step()
        pair.check(f"step {step}, after opt.step()")


# --- 1, 2: zero_grad with and without set_to_none -----------------------------------------

def zero_grad_each_step(gradient_as_bucket_view: bool, set_to_none: bool,
                        bucket_cap_mb: float | None) -> None:
    """SGD with momentum, opt.zero_grad(set_to_none=...) before every backward."""
    pair = _pair(gradient_as_bucket_view=gradient_as_bucket_view, bucket_cap_mb=bucket_cap_mb)
    _train(pair, _optimizers(pair), set_to_none=set_to_none)
    if set_to_none and not gradient_as_bucket_view:
        # The path under test was taken: the last step wrote nothing back.
        _expect_cost(pair.ddp, write_back_bytes=0, kept_grad_copy_bytes=0)


def _expect_cost(fast: nn.Module, **expected: int) -> None:
    """fastddp's last step's counted cost (Note [counted cost]) has these figures."""
    cost = fast.comm_stats()["step_cost"]
    _expect(all(cost[k] == v for k, v in expected.items()),
            f"last step's cost {cost}, expected {expected}")


# --- 3: no_sync -----------------------------------------------------------------------

def no_sync_micro_batches(gradient_as_bucket_view: bool, set_to_none: bool) -> None:
    """Two micro-batches under no_sync(), then a synchronized one, then opt.step()."""
    pair = _pair(gradient_as_bucket_view=gradient_as_bucket_view)
    opts = _optimizers(pair)
    for step in range(STEPS):
        for opt in opts:
            opt.zero_grad(set_to_none=set_to_none)
        for k in range(3):
            for model in pair.models:
                if k < 2:
                    with model.no_sync():
                        _backward(model, vector_batch(10 * step + k))
                else:
                    _backward(model, vector_batch(10 * step + k))
            pair.check(f"step {step}, micro-batch {k}" + (" (no_sync)" if k < 2 else ""))
        for opt in opts:
            opt.step()
        pair.check(f"step {step}, after opt.step()")


# --- 4: .grad replaced by the user's own tensor ----------------------------------------------

def _own_grad(p: torch.Tensor, how: str, index: int) -> torch.Tensor | None:
    if how == "all":
        return torch.zeros_like(p)
    if how == "some":  # every other parameter; the rest have none. Non-zero: accumulated
        return torch.full_like(p, 0.25) if index % 2 == 0 else None
    # "strided": weights laid out transposed (not the parameter's strides)
    return torch.zeros(p.shape[::-1]).t() if p.dim() == 2 else torch.zeros_like(p)


def own_grad_tensors(gradient_as_bucket_view: bool, how: str) -> None:
    """Before each backward, .grad set to tensors the user keeps: afterwards `p.grad is g`
    must hold exactly where it holds under torch DDP, and g must hold torch's g's values."""
    pair = _pair(gradient_as_bucket_view=gradient_as_bucket_view)
    opts = _optimizers(pair)
    for step in range(STEPS):
        mine = []
        for model, opt in zip(pair.models, opts):
            opt.zero_grad(set_to_none=True)
            own = [_own_grad(p, how, i) for i, p in enumerate(model.module.parameters())]
            for p, g in zip(model.module.parameters(), own):
                p.grad = g
            _backward(model, vector_batch(step))
            mine.append(own)
        pair.check(f"step {step}, after backward")

        def compare_own(step: int = step) -> None:
            names = [n for n, _ in pair.ref.module.named_parameters()]
            for name, p, q, g_ref, g_fast in zip(names, pair.ref.module.parameters(),
                                                 pair.fast.module.parameters(), *mine):
                if g_ref is None:
                    continue
                assert (q.grad is g_fast) == (p.grad is g_ref), (
                    f"step {step}: {name}: `p.grad is g` is {q.grad is g_fast} under fastddp, "
                    f"{p.grad is g_ref} under torch DDP")
                _same_tensor(f"step {step}", f"the user's tensor for {name}.grad", g_ref, g_fast)
                assert g_fast.stride() == g_ref.stride(), (
                    f"step {step}: the user's tensor for {name}.grad has strides "
                    f"{g_fast.stride()} under fastddp, {g_ref.stride()} under torch DDP")

        agree(compare_own)
        for opt in opts:
            opt.step()
        pair.check(f"step {step}, after opt.step()")


# --- 5: .grad of another shape or dtype ------------------------------------------------------

def _outcome(action) -> tuple:
    try:
        return ("ok", action())
    except Exception as e:  # noqa: BLE001  (the type and message are what is compared)
        return (type(e).__name__, str(e))


def _bad_grad_step(model: nn.Module, opt: torch.optim.Optimizer, how: str) -> dict:
    p = model.module[4].bias  # the last layer's: the first gradient ready in backward
    opt.zero_grad(set_to_none=True)
    g = torch.zeros_like(p)
    if how == "assign_shape":
        p.grad = torch.zeros(2, *p.shape)
    elif how == "assign_dtype":
        p.grad = torch.zeros_like(p, dtype=torch.float64)
    else:
        # The .grad setter refuses another shape or dtype: a tensor of the user's that is
        # .grad already can still change underneath (Tensor.data's setter allows it).
        p.grad = g
        g.data = (torch.zeros(2, *p.shape) if how == "data_shape"
                  else torch.zeros_like(p, dtype=torch.float64))
    _backward(model, vector_batch(2))
    return {"grads": [None if q.grad is None else q.grad.clone() for q in model.parameters()],
            "grad_is_g": p.grad is g, "g": g.clone()}


def bad_grad(gradient_as_bucket_view: bool, how: str) -> list[tuple]:
    """Two ordinary steps (torch's buckets are rebuilt at the second), then the last
    layer's bias gets a .grad of another shape or dtype before the third backward. Whatever
    torch DDP does, fastddp must do; where both raise, the same type, and fastddp's own
    message (where it is not torch's) names the parameter. Returns the two outcomes."""
    pair = _pair(gradient_as_bucket_view=gradient_as_bucket_view)
    opts = _optimizers(pair)
    _train(pair, opts, steps=2)
    outcomes = [_outcome(lambda m=m, o=o: _bad_grad_step(m, o, how))
                for m, o in zip(pair.models, opts)]

    def compare() -> None:
        (t_kind, t_value), (f_kind, f_value) = outcomes
        assert f_kind == t_kind, (
            f"{how}: torch DDP {'accepted it' if t_kind == 'ok' else 'raised ' + t_kind}: "
            f"{t_value if t_kind != 'ok' else ''}; fastddp "
            f"{'accepted it' if f_kind == 'ok' else 'raised ' + f_kind + ': ' + f_value}")
        if t_kind != "ok":
            assert f_value == t_value or "'4.bias'" in f_value, (
                f"{how}: fastddp's message does not name the parameter: {f_value}")
            return
        assert f_value["grad_is_g"] == t_value["grad_is_g"], (f_value["grad_is_g"],
                                                              t_value["grad_is_g"])
        _same_tensor(how, "the user's tensor", t_value["g"], f_value["g"])
        for i, (t, f) in enumerate(zip(t_value["grads"], f_value["grads"])):
            assert (t is None) == (f is None), f"{how}: grad {i}"
            if t is not None:
                _same_tensor(how, f"grad {i}", t, f)

    agree(compare)
    return [(kind, value if kind != "ok" else "ok") for kind, value in outcomes]


# --- 6: channels_last ------------------------------------------------------------------

def channels_last(gradient_as_bucket_view: bool) -> None:
    pair = _pair(lambda: ConvNet().to(memory_format=torch.channels_last),
                 gradient_as_bucket_view=gradient_as_bucket_view)
    _train(pair, _optimizers(pair), batch=image_batch)
    weight = pair.fast.module.conv1.weight
    assert weight.grad.is_contiguous(memory_format=torch.channels_last), weight.grad.stride()


# --- 7: references kept across zero_grad(set_to_none=True) ----------------------------------

def kept_references(gradient_as_bucket_view: bool) -> None:
    """Last step's .grad tensors, views of them, and an optimizer's reference to them, kept
    across zero_grad(set_to_none=True): after the next backward (and step) they must hold
    what torch DDP's hold (torch's default leaves them alone; under gradient_as_bucket_view
    torch writes the next step's gradients into them)."""
    pair = _pair(gradient_as_bucket_view=gradient_as_bucket_view)
    opts = _optimizers(pair, KeepsGrad, lr=0.05, momentum=0.9)
    kept: list[list] = [[], []]
    for step in range(STEPS):
        for model, opt in zip(pair.models, opts):
            opt.zero_grad(set_to_none=True)
            _backward(model, vector_batch(step))
        pair.check(f"step {step}, after backward")
        _compare_kept(kept, opts, f"step {step}, after backward", not gradient_as_bucket_view)
        for opt in opts:
            opt.step()
        pair.check(f"step {step}, after opt.step()")
        _compare_kept(kept, opts, f"step {step}, after opt.step()", not gradient_as_bucket_view)
        for i, model in enumerate(pair.models):
            grads = _grads(model.module)
            kept[i].append((grads, [g.view(-1) for g in grads], [g[:1] for g in grads]))
    if not gradient_as_bucket_view:
        # Handed out and then kept: each kept gradient got memory of its own (a copy).
        _expect_cost(pair.ddp, write_back_bytes=0)
        _expect(pair.ddp.comm_stats()["step_cost"]["kept_grad_copy_bytes"] > 0,
                "the kept gradients were not given memory of their own")


def _compare_kept(kept: list[list], opts: list, where: str, storages: bool) -> None:
    """`storages`: also the memory each kept tensor keeps alive (its storage's size), which
    under torch's default is the gradient's own."""
    def compare() -> None:
        for age, (theirs, ours) in enumerate(zip(*kept)):
            for kind, t_list, o_list in zip(("grad", ".view(-1)", "[:1]"), theirs, ours):
                for i, (t, o) in enumerate(zip(t_list, o_list)):
                    _same_tensor(where, f"kept {kind} of parameter {i} from step {age}", t, o)
                    kept_bytes = (o.untyped_storage().nbytes(), t.untyped_storage().nbytes())
                    assert not storages or kept_bytes[0] == kept_bytes[1], (
                        f"{where}: kept {kind} of parameter {i} from step {age} keeps "
                        f"{kept_bytes[0]} bytes alive under fastddp, {kept_bytes[1]} under "
                        "torch DDP")
        states = [[opt.state[p].get("last_grad") for p in opt.param_groups[0]["params"]]
                  for opt in opts]
        for i, (t, o) in enumerate(zip(*states)):
            assert (t is None) == (o is None), f"{where}: optimizer state {i}"
            if t is not None:
                _same_tensor(where, f"the optimizer's kept .grad of parameter {i}", t, o)

    agree(compare)


# --- 8: deepcopy, pickle, state_dict mid-training ------------------------------------------

def serialized_mid_training(gradient_as_bucket_view: bool, how: str) -> None:
    """Two steps, a third backward (its gradients still in .grad), then the model is
    deep-copied, pickled and unpickled, or saved with state_dict() and loaded back into
    itself after another step; training goes on (the copies' with fresh optimizers) and
    must stay torch DDP's."""
    pair = _pair(gradient_as_bucket_view=gradient_as_bucket_view)
    opts = _optimizers(pair)
    _train(pair, opts, steps=2)
    for model, opt in zip(pair.models, opts):
        opt.zero_grad(set_to_none=True)
        _backward(model, vector_batch(2))
    pair.check("step 2, after backward")
    if how in ("deepcopy", "pickle"):
        copies = [copy.deepcopy(m) if how == "deepcopy" else pickle.loads(pickle.dumps(m))
                  for m in pair.models]
        assert type(copies[1]) is type(pair.fast)
        pair.check(f"the originals after {how}")
        twin = SideBySide(*copies)
        twin.check(f"the copies, as {how} made them")
        _train(twin, _optimizers(twin), steps=3, first_step=3)
        return
    assert how == "state_dict"
    saved = [{k: v.clone() for k, v in m.state_dict().items()} for m in pair.models]
    for opt in opts:
        opt.step()
    pair.check("step 2, after opt.step()")
    for model, state in zip(pair.models, saved):
        model.load_state_dict(state)
    pair.check("after load_state_dict")
    _train(pair, opts, steps=3, first_step=3)


# --- 9: unused parameters, static graph --------------------------------------------------

def unused_parameters(gradient_as_bucket_view: bool, mode: str) -> None:
    """find_unused_parameters (`sometimes` unused on even steps, `never` never, `one_rank`
    used on rank 0 only), or static_graph (the same without `sometimes`)."""
    kwargs = ({"find_unused_parameters": True} if mode == "find_unused_parameters"
              else {"static_graph": True})
    pair = _pair(lambda: Branchy(dynamic=mode == "find_unused_parameters"),
                 gradient_as_bucket_view=gradient_as_bucket_view, **kwargs)
    _train(pair, _optimizers(pair), tell_step=True)
    assert pair.fast.module.never.weight.grad is None


# --- 10: optimizers in backward -----------------------------------------------------------

def optimizer_in_backward(gradient_as_bucket_view: bool) -> None:
    """The first layer's parameters have optimizers in backward (SGD with momentum), the
    rest an AdamW stepped after backward, zero_grad(set_to_none=True) before each backward.
    torch DDP runs optimizers in backward only with an accelerator (its hook makes a
    torch.Stream()), so the reference is written out as in optim_in_backward_scenarios.py:
    torch DDP, then the same optimizers after backward on the averaged gradients. After
    each backward the in-backward parameters' .grad is None (as under torch's feature) and
    the others' .grad is torch DDP's, in value and in everything observable."""
    from torch.distributed.optim import _apply_optimizer_in_backward

    pair = _pair(gradient_as_bucket_view=gradient_as_bucket_view)
    in_bwd = list(pair.fast.module.parameters())[:2]
    _apply_optimizer_in_backward(torch.optim.SGD, in_bwd, {"lr": 0.05, "momentum": 0.9})
    ref_params = list(pair.ref.module.parameters())
    ref_opts = [torch.optim.SGD(ref_params[:2], lr=0.05, momentum=0.9),
                torch.optim.AdamW(ref_params[2:], lr=0.01)]
    fast_rest = torch.optim.AdamW(list(pair.fast.module.parameters())[2:], lr=0.01)
    rest = SideBySide(pair.ref.module[2:], pair.fast.module[2:], ddp=pair.fast)
    for step in range(STEPS):
        for opt in (*ref_opts, fast_rest):
            opt.zero_grad(set_to_none=True)
        for model in pair.models:
            _backward(model, vector_batch(step))
        rest.check(f"step {step}, after backward")
        agree(lambda step=step: _expect(all(p.grad is None for p in in_bwd),
                                        f"step {step}: an in-backward parameter kept its .grad"))
        for opt in (*ref_opts, fast_rest):
            opt.step()
        agree(lambda step=step: [_same_tensor(f"step {step}", f"parameter {i}", p, q)
                                 for i, (p, q) in enumerate(zip(ref_params,
                                                                pair.fast.module.parameters()))])
        rest.check(f"step {step}, after opt.step()")


# --- 11: compression hooks --------------------------------------------------------------

HOOKS = {"torch.bf16": (dh.bf16_compress_hook, dh.bf16_compress_hook),
         "torch.fp16": (dh.fp16_compress_hook, dh.fp16_compress_hook),
         # fastddp's built-ins round as torch's hooks, bit for bit (tests/python/hooks/
         # test_hooks.py, EXACT_PAIRS, Note [torch's half rounding])
         "fastddp.bf16": (dh.bf16_compress_hook, fastddp.hooks.bf16),
         "fastddp.fp16": (dh.fp16_compress_hook, fastddp.hooks.fp16)}


def compression_hook(gradient_as_bucket_view: bool, hook: str,
                     bucket_cap_mb: float | None) -> None:
    """torch's hook on torch DDP; the same torch hook (run natively) or fastddp's
    built-in on fastddp; zero_grad(set_to_none=True). Bit for bit, as test_hooks.py's
    exact pairs."""
    pair = _pair(gradient_as_bucket_view=gradient_as_bucket_view, bucket_cap_mb=bucket_cap_mb)
    torch_hook, fast_hook = HOOKS[hook]
    pair.ref.register_comm_hook(None, torch_hook)
    pair.fast.register_comm_hook(
        None, fast_hook() if hook.startswith("fastddp.") else fast_hook)
    _train(pair, _optimizers(pair))


# --- 12: what can be done to a handed-out .grad ------------------------------------------

def _try(action) -> str:
    try:
        action()
        return "ok"
    except Exception as e:  # noqa: BLE001  (the type is what is compared)
        return type(e).__name__


def grad_properties(gradient_as_bucket_view: bool, bucket_cap_mb: float | None) -> list:
    """After each backward: `.grad._is_view()`, whether `.grad.requires_grad_(False)` and
    `.grad.detach_()` succeed, and how many bytes torch.save writes for it, as under torch
    DDP; training goes on after them, equal to torch's."""
    pair = _pair(gradient_as_bucket_view=gradient_as_bucket_view, bucket_cap_mb=bucket_cap_mb)
    opts = _optimizers(pair)
    seen = []
    for step in range(STEPS):
        for model, opt in zip(pair.models, opts):
            opt.zero_grad(set_to_none=True)
            _backward(model, vector_batch(step))
        pair.check(f"step {step}, after backward")
        props = []
        saved_whole = storage_comparable(pair.fast)
        for model in pair.models:
            mine = []
            for p in model.module.parameters():
                # torch.save writes a tensor's whole storage (see storage_comparable)
                buffer = io.BytesIO()
                torch.save(p.grad, buffer)
                mine.append((p.grad._is_view(), _try(lambda: p.grad.requires_grad_(False)),
                             _try(lambda: p.grad.detach_()),
                             len(buffer.getvalue()) if saved_whole else None))
            props.append(mine)

        def compare(step: int = step) -> None:
            names = [n for n, _ in pair.ref.module.named_parameters()]
            for name, t, o in zip(names, *props):
                assert o == t, (f"step {step}: {name}.grad: (_is_view, requires_grad_(False), "
                                f"detach_(), torch.save bytes) {o} under fastddp, {t} under "
                                "torch DDP")

        agree(compare)
        seen.append(props[1])
        pair.check(f"step {step}, after requires_grad_/detach_")
        for opt in opts:
            opt.step()
        pair.check(f"step {step}, after opt.step()")
    return seen


def _expect(condition: bool, message: str) -> None:
    assert condition, message
