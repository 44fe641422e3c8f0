"""fastddp.DistributedDataParallel: torch DDP's interface over fastddp's C++ reducer."""

import contextlib
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable

from fastddp import _C
from fastddp import hooks as fastddp_hooks
from fastddp._group_ops import broadcast_tensors
from fastddp.ddp import (_compile, _forward, _hook_install, _hook_state, _overlap_optimizer,
                         _pickling, _python_reducer)
from fastddp.ddp._construction import (_check_module, _expect_sparse_gradients, _not_yet,
                                       _params_for_reducer, _resolve_device_ids, _resolve_group,
                                       bucket_limits, check_conversion)
from fastddp.ddp._ddp_logger import DdpLogger
from fastddp.ddp._delayed_allreduce import DelayedAllReduce
from fastddp.ddp._delayed_allreduce import check_arguments as check_delay_arguments
from fastddp.ddp._introspection import bucket_sizes, comm_stats, logging_data
from fastddp.ddp._join import _JoinHook
from fastddp.ddp._mixed_precision import MixedPrecision, reducer_arguments
from fastddp.ddp._mixed_precision import check_arguments as check_mixed_precision
from fastddp.ddp._module_sync import verify_bucket_layout, verify_param_shapes, written_in_python
from fastddp.ddp._optim_in_backward import InBackwardOptimizers
from fastddp.ddp._options import bucket_align_bytes, world1_reducer_requested
from fastddp.ddp._reducer_proxy import ReducerProxy

_MIB = 1024 * 1024
# torch's defaults (25 MiB, a first bucket of 1 MiB), defined once: csrc/core/bucket_plan.h
_DEFAULT_BUCKET_CAP_MB = _C.DEFAULT_BUCKET_CAP_BYTES / _MIB
_DEFAULT_FIRST_BUCKET_BYTES = _C.DEFAULT_FIRST_BUCKET_BYTES


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """Drop-in replacement for :class:`torch.nn.parallel.DistributedDataParallel`.

    Takes every argument torch DDP 2.11-2.15 takes, with the same defaults, and
    trains to the same numbers. Gradient bucketing, the hooks on the autograd
    graph, the overlapped allreduce and the write-back run in C++
    (``fastddp._C.Reducer``). Arguments that fastddp does not implement yet raise
    NotImplementedError; none is silently ignored.
    """

    # Its public name, which pickles (torch.save(model)) and frameworks' class lists carry.
    __module__ = "fastddp.ddp"

    def __init__(
        self,
        module: nn.Module,
        device_ids=None,
        output_device=None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params=None,
        param_to_hook_all_reduce=None,
        mixed_precision=None,
        device_mesh=None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[int] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        lazy_bucket_allocation: bool = False,
        *,
        check_for_nan_in_grad: bool = False,
    ):
        # torch DDP's __init__ would build torch's reducer; only the module and
        # Joinable parts of the base classes are wanted.
        nn.Module.__init__(self)
        Joinable.__init__(self)
        # As torch, decided once, here (Note [python reducer]).
        self._use_python_reducer = _python_reducer.requested()
        check_delay_arguments(delay_all_reduce_named_params, param_to_hook_all_reduce)
        if check_reduction:
            warnings.warn(
                "The `check_reduction` argument in `DistributedDataParallel` module is "
                "deprecated. Please avoid using it.",
                FutureWarning,
                stacklevel=2,
            )
        self.process_group = _resolve_group(process_group, device_mesh, module)
        if device_mesh is not None:
            self.device_mesh = device_mesh

        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        delayed = list(delay_all_reduce_named_params or ())
        self.parameters_to_ignore.update(name for name, _ in delayed)  # as torch: not bucketed
        names, params = _params_for_reducer(module, self.parameters_to_ignore)
        if delayed and not params:
            raise _not_yet("delay_all_reduce_named_params naming every parameter that "
                           "requires grad", "the model then has no reducer at all")
        self._reducer_param_names = names
        self._reducer_params = params
        self._expect_sparse = _expect_sparse_gradients(module, params)
        check_mixed_precision(mixed_precision, delayed=bool(delayed),
                              sparse=any(self._expect_sparse))
        self._module_parameters = [
            p for n, p in module.named_parameters() if n not in self.parameters_to_ignore
        ]
        _check_module(module, self._module_parameters, params)

        self.device_type = self._module_parameters[0].device.type
        self.device = self._module_parameters[0].device
        self.is_multi_device_module = False
        self.device_ids, self.output_device = _resolve_device_ids(
            device_ids, output_device, self.device_type
        )
        self.module = module
        self.dim = dim
        self.static_graph = False
        self.find_unused_parameters = find_unused_parameters
        # As torch: buckets whose parameters are all unused are not reduced (the C++
        # reducer's Note [skipping unused buckets]); the ranks vote on them.
        self.skip_all_reduce_unused_params = bool(skip_all_reduce_unused_params)
        self._divide_by_initial_world_size = True
        self.gradient_as_bucket_view = gradient_as_bucket_view
        # fastddp's own (Megatron's name): raise on NaN/Inf gradients, see docs/failures.md.
        self.check_for_nan_in_grad = bool(check_for_nan_in_grad)
        self.batched_grad_copy = batched_grad_copy
        self.lazy_bucket_allocation = bool(lazy_bucket_allocation)  # torch 2.15's, in C++
        self.mixed_precision = mixed_precision  # torch's attribute
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._lazy_init_ran = False  # as torch: optimizers in backward are found at forward 1
        self._in_backward: InBackwardOptimizers | None = None
        if forward_sync_buffers is not None:
            self.forward_sync_buffers, init_sync_buffers = forward_sync_buffers, True
        else:
            sync = broadcast_buffers if broadcast_buffers is not None else True
            self.forward_sync_buffers, init_sync_buffers = sync, sync
        self.modules_buffers = [
            b for n, b in module.named_buffers() if n not in self.parameters_to_ignore
        ]

        caps = [int(mb * _MIB) for mb in bucket_cap_mb_list] if bucket_cap_mb_list else []
        cap_mb = max(bucket_cap_mb_list) if caps else (
            bucket_cap_mb if bucket_cap_mb is not None else _DEFAULT_BUCKET_CAP_MB)
        self.bucket_bytes_cap = int(cap_mb * _MIB)
        first = _DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else self.bucket_bytes_cap
        initial_limits, rebuild_limits = bucket_limits(
            caps, first, self.bucket_bytes_cap, static_graph or not find_unused_parameters)

        world = self.process_group.size()
        # A process group written in Python is talked to at world size 1 too, as torch does
        # (its Work objects may count, log or fence; torch's own test_c10d_pypg checks it).
        talks = world > 1 or written_in_python(self.process_group)
        if init_sync and talks:
            with torch.no_grad():
                verify_param_shapes(self.process_group, names, params, self.device)
                states = [p.detach() for p in self._module_parameters]
                if init_sync_buffers:
                    states += [b.detach() for b in self.modules_buffers]
                broadcast_tensors(self.process_group, states, src=0)

        self._reducer = None
        self._overlap = None  # overlap_optimizer()'s, once registered
        self._sharded = None  # fastddp.optim.ShardedOptimizer's buckets, once sharded
        self._comm_hooks: list[tuple[Any, object]] = []
        self._native_hook = None  # the registered C++ hook (None: the default allreduce)
        self._auto = None  # fastddp.hooks.auto()'s tuner, once registered
        self._ddp_sink_clone = True
        self.logger = DdpLogger()
        self._bucket_limits = (initial_limits, rebuild_limits)
        plan = self._initial_plan()
        if init_sync and talks:
            # Sizes in millionths of a MiB: shown as given (0.001, not 0.000999451).
            verify_bucket_layout(self.process_group, names, plan, {
                "bucket_cap_mb": [] if bucket_cap_mb is None else [round(bucket_cap_mb * 1e6)],
                "bucket_cap_mb_list": [round(mb * 1e6) for mb in bucket_cap_mb_list or ()],
                "find_unused_parameters": [int(find_unused_parameters)],
            }, self.device)
        self._initial_bucket_sizes = bucket_sizes(params, plan)
        # At world size 1 there is nothing to average: unless a comm hook is
        # registered (torch runs it there too), FASTDDP_WORLD1_REDUCER=1 asks
        # for the full path or check_for_nan_in_grad for its check, no reducer,
        # no flat buffers, and forward is the bare module's.
        if self._wants_reducer():
            self._build_reducer(plan)
        self._python_reducer = _python_reducer.attach(self, bucket_cap_mb)
        self.reducer = ReducerProxy(self)  # torch's ddp.reducer, for frameworks that call it
        self._delayed = (DelayedAllReduce(self.process_group, delayed, param_to_hook_all_reduce)
                         if delayed else None)
        self._delay_all_reduce_params = [p for _, p in delayed]  # torch's attribute
        # After the initial broadcast (fp32 buffers, as torch's) and the reducer.
        self._mp = MixedPrecision(self, mixed_precision) if mixed_precision is not None else None
        if static_graph:
            self._set_static_graph()

    def _wants_reducer(self) -> bool:
        """Whether the reducer is built before any hook is registered (registering one
        builds it at world size 1 too, see _hook_install.py)."""
        if self._use_python_reducer:  # Note [python reducer]
            return False
        return (self.process_group.size() > 1 or world1_reducer_requested()
                or written_in_python(self.process_group) or self.mixed_precision is not None
                or getattr(self, "check_for_nan_in_grad", False))

    def _initial_plan(self) -> list[list[int]]:
        """The reducer's first buckets as C++ plans and orders them (plan_initial_buckets)."""
        return _C.initial_bucket_plan(
            self._reducer_params, self._bucket_limits[0], self._expect_sparse)

    def _build_reducer(self, plan: list[list[int]] | None = None) -> None:
        options = {"gradient_as_bucket_view": self.gradient_as_bucket_view,
                   **reducer_arguments(self)}  # mixed_precision's replace some
        self._reducer = _C.Reducer(
            self._reducer_params, self._reducer_param_names,
            plan if plan is not None else self._initial_plan(), self.process_group,
            find_unused_parameters=self.find_unused_parameters,
            rebuild_limits=self._bucket_limits[1],
            expect_sparse=self._expect_sparse,
            check_for_nan_in_grad=getattr(self, "check_for_nan_in_grad", False),
            align_bytes=bucket_align_bytes(self._reducer_params[0].device
                                           if self._reducer_params else torch.device("cpu")),
            lazy_bucket_allocation=getattr(self, "lazy_bucket_allocation", False),
            skip_all_reduce_unused_params=getattr(self, "skip_all_reduce_unused_params", False),
            **options,
        )
        self._reducer.set_timing_sample_rate(self.logger.sample_rate)  # Note [device timeline]
        if not self._ddp_sink_clone:
            self._reducer.set_sink_clone(False)
        if self.static_graph:
            self._reducer.set_static_graph()
        if getattr(self, "_overlap", None) is not None:  # a rebuilt reducer steps it too
            self._reducer.set_optimizer_step(self._overlap.native)

    # Buffers sync follows torch 2.13+: broadcast_buffers is an alias.
    @property
    def broadcast_buffers(self) -> bool:
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    # Under torch.compile only the module call is left to dynamo (see _compile.py): the
    # reducer calls around it run eagerly, as torch DDP's _pre_forward/_post_forward do, and
    # the module compiles split at the buckets as under torch DDP.
    @_compile.nonrecursive_disable
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        _compile.skip_this_frame_from_now_on()
        if self._use_python_reducer:  # torch's forward in this mode: the bare module call
            return self.module(*inputs, **kwargs)
        if not self._lazy_init_ran:
            self._lazy_init_ran = True
            self._in_backward = InBackwardOptimizers.find(self._module_parameters)
        if self._overlap is not None and self._overlap.refresh():
            self._reducer.set_optimizer_step(self._overlap.native)
        state = ()  # stays empty without a reducer (world size 1): nothing to do around the call
        if self._reducer is not None or self.device_ids:
            inputs, kwargs, state = _forward.before_module(self, inputs, kwargs)
        # As torch's _run_ddp_forward: this model is the active DDP module while its module
        # runs, so dynamo splits what it compiles in there at self.bucket_bytes_cap. Set on
        # torch's class (named through the base: fastddp.patch() rebinds module globals that
        # name it), which torch._dynamo reads it from.
        torch_ddp = DistributedDataParallel.__base__
        previous, torch_ddp._active_ddp_module = torch_ddp._active_ddp_module, self
        try:
            output = self.module(*inputs, **kwargs)
        finally:
            torch_ddp._active_ddp_module = previous
        if self._in_backward is not None:  # read after the module, as after_module does
            self._in_backward.set_sync(torch.is_grad_enabled() and self.require_backward_grad_sync)
        if self._delayed is not None:  # as torch, at the end of every forward
            self._delayed.point_grads_at_buffer()
        return _forward.after_module(self, output, state) if state else output

    def _apply(self, fn: Any, recurse: bool = True) -> "DistributedDataParallel":
        """nn.Module's conversion (to, double, half, cuda, ...), refused when it would change
        a reduced parameter's dtype or device (see check_conversion). Conversions of the
        inner module itself (model.module.double()) do not pass here."""
        if getattr(self, "_reducer", None) is not None:
            check_conversion(fn, self._reducer_param_names, self._reducer_params)
        return super()._apply(fn, recurse)

    def _will_sync_buffers(self) -> bool:
        return bool(self.require_forward_param_sync and self.forward_sync_buffers
                    and self.modules_buffers)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients accumulate locally inside; the first synchronized backward
        after it reduces their sum."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def bucket_plan(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order (empty at world size 1)."""
        if self._reducer is None:
            return []
        names = self._reducer_param_names
        return [[names[i] for i in bucket] for bucket in self._reducer.bucket_plan()]

    # torch DDP features that later fastddp work implements. Each raises rather
    # than falling through to torch's code, which expects torch's reducer.
    def register_comm_hook(self, state: object, hook: Any) -> None:
        """torch DDP's register_comm_hook: once per model, with torch's checks and errors.

        ``fastddp.hooks.*`` built-ins and torch's default hook functions run in C++;
        any other ``hook(state, bucket) -> torch.futures.Future`` runs in Python on a
        ``torch.distributed.GradBucket``. See fastddp.hooks.
        """
        # torch records each refusal in its logger before raising (_log_and_throw: the
        # type and message; the reducer's REDUCER_CHECK: the message), so
        # _get_ddp_logging_data() names it; so does fastddp.
        try:
            fastddp_hooks.check_comm_hook(hook)
        except (TypeError, ValueError) as e:
            self.logger.set_error_and_log(f"{type(e)}: {e}")
            raise
        if self._comm_hooks:
            message = "register_comm_hook or register_builtin_comm_hook can only be called once."
            self.logger.set_error_and_log(message)
            raise RuntimeError(message)
        if self._use_python_reducer:  # called per parameter (Note [python reducer])
            _python_reducer.check_comm_hook(hook)
        else:
            _hook_install.install(self, state, hook)  # raises before anything is registered
        self._comm_hooks.append((hook, state))

    def _auto_install(self, native: Any, cap_bytes: int) -> None:
        """fastddp.hooks.auto()'s switch, between two steps: the C++ hook ``native`` with
        buckets of ``cap_bytes`` (a new reducer when the cap changes, as unpickling builds
        one)."""
        if cap_bytes != self.bucket_bytes_cap:
            self.bucket_bytes_cap = cap_bytes
            self._bucket_limits = bucket_limits(
                [], cap_bytes, cap_bytes, self.static_graph or not self.find_unused_parameters)
            self._reducer = None  # the old one unhooks itself from autograd as it goes
            self._build_reducer()
        self._native_hook = native
        self._reducer.set_comm_hook(native)

    def auto_choice(self) -> dict | None:
        """With fastddp.hooks.auto() registered: the policy, the choice (None while still
        tuning), the step it took effect at, and the measured and predicted step times (on
        rank 0, which measures: ``trial_step_ms``, each trial's steps in order)."""
        return None if self._auto is None else self._auto.summary()

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        """torch's built-in hook types (ALLREDUCE, FP16_COMPRESS) as fastddp built-ins."""
        hook = fastddp_hooks.builtin_for_type(comm_hook_type)
        if self._use_python_reducer:  # torch's would sit, unused, on its idle C++ reducer
            _python_reducer.check_comm_hook(hook)
        if self._comm_hooks:
            raise RuntimeError(
                "register_builtin_comm_hook or register_comm_hook can only be called once.")
        _hook_install.install(self, None, hook)  # raises before anything is registered
        self._comm_hooks.append((hook, None))

    def overlap_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Steps ``optimizer`` inside every synchronized backward, bucket by bucket as each
        bucket's averaged gradients are written, overlapping the rest of the reduction (and
        on the CPU the rest of backward); the script no longer calls ``optimizer.step()``.
        Same numbers as ``optimizer.step()`` after backward (Note [overlapped optimizer,
        Python side])."""
        _overlap_optimizer.register(self, optimizer)

    def _register_fused_optim(self, optim: type, *args: Any, optim_params: Any = None,
                              **kwargs: Any) -> None:
        """torch's: ``optim(optim_params, *args, **kwargs)`` overlapped as above."""
        _overlap_optimizer.register_fused(self, optim, args, optim_params, kwargs)

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Context manager for uneven inputs, as torch DDP's join(): ranks
        that run out of data shadow the others' collectives until all are done,
        then every rank takes the last joiner's parameters."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> _JoinHook:
        if self._sharded is not None:
            # A rank out of data would shadow the reduce-scatters but never step its shards,
            # and the others' all-gather after their step would wait for it.
            raise NotImplementedError(
                "fastddp.DistributedDataParallel.join(): not with a "
                "fastddp.optim.ShardedOptimizer: a rank out of data steps no shard, and the "
                "other ranks' all-gather of the parameters would wait for it")
        return _JoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    def _set_static_graph(self) -> None:
        """torch DDP's static-graph switch; call it before the first iteration."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.",
                          stacklevel=2)
            return
        if self._reducer is not None:
            with self.logger.recording_errors():
                self._reducer.set_static_graph()
        self.static_graph = True
        if self.find_unused_parameters:
            warnings.warn(
                "You passed find_unused_parameters=true to DistributedDataParallel, "
                "`_set_static_graph` will detect unused parameters automatically, so you do not "
                "need to set find_unused_parameters=true, just be sure these unused parameters "
                "will not change during training loop while calling `_set_static_graph`.",
                stacklevel=2,
            )

    def __getstate__(self) -> dict:
        """As torch DDP (torch.save(model), copy.deepcopy, pickle): see _pickling.py."""
        return _pickling.state_of(self)

    def __setstate__(self, state: dict) -> None:
        _pickling.restore(self, state)

    def _set_ddp_sink_clone(self, val: bool) -> None:
        """torch's switch: whether outputs passing the output sink (find_unused_parameters,
        the first static-graph iteration) are cloned, so in-place ops on them work."""
        self._ddp_sink_clone = val
        if self._reducer is not None:
            self._reducer.set_sink_clone(val)

    def _get_ddp_logging_data(self) -> dict:
        """torch DDP's logging data: the keys that describe the run and its buckets, the
        environment, the sampled runtime statistics and the last error (see
        _introspection.py and _ddp_logger.py)."""
        return logging_data(self)

    def comm_hook_state_dict(self) -> dict:
        """The registered comm hook's state for a checkpoint: for PowerSGD its iteration,
        generator, statistics, and error feedback and warm-start Q by parameter name. Call
        it between steps; restore with load_comm_hook_state_dict() after registering the
        same hook on the new model."""
        return _hook_state.state_dict(self)

    def load_comm_hook_state_dict(self, state: dict) -> None:
        """Restores comm_hook_state_dict()'s state: the next steps are those the
        uninterrupted run would take."""
        _hook_state.load_state_dict(self, state)

    def compression_stats(self) -> dict:
        """PowerSGD's statistics: torch's running totals (rate, numel_before, numel_after,
        as PowerSGDState.compression_stats()) and the bytes of the last step before and
        after compression."""
        return _hook_state.compression_stats(self)

    def comm_stats(self) -> dict:
        """Communication figures of the last synchronized step: bytes reduced
        and sent, compression ratio, per-bucket ready/launched/done times and
        the exposed communication time (see docs/hooks.md, Introspection; on a
        GPU, of the latest sampled step finished there, read without a wait)."""
        return comm_stats(self)
