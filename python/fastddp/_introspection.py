"""What users read back from a fastddp model: torch's DDP logging data (the
keys that describe buckets and the run) and fastddp's communication figures."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastddp.ddp import DistributedDataParallel

_DTYPE_NAMES = {"float32": "float", "float64": "double", "float16": "c10::Half",
                "bfloat16": "c10::BFloat16"}


def _dtype_name(dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    return _DTYPE_NAMES.get(name, name)


def bucket_sizes(params, plan) -> str:
    """Bytes per bucket in torch's logging format ("a, b, c")."""
    return ", ".join(str(sum(params[i].numel() * params[i].element_size() for i in b)) for b in plan)


class DdpErrorLog:
    """``model.logger``: where torch DDP records the last error it raised (its C++ Logger's
    ``set_error_and_log``), read back as the logging data's ``has_error`` / ``error``.

    Errors raised inside a backward are kept by the C++ reducer (``Reducer.last_error``);
    an error raised from Python (construction, forward) takes precedence over those.
    """

    def __init__(self) -> None:
        self.error = ""
        self.sample_rate = 100  # torch's default: timings every 100 iterations

    def set_error_and_log(self, message: str) -> None:
        self.error = message

    def _set_ddp_runtime_logging_sample_rate(self, rate: int) -> None:
        if rate < 1:
            raise ValueError(f"DDP runtime logging sample rate should be >= 1, got {rate}")
        self.sample_rate = rate


def logging_data(ddp: DistributedDataParallel) -> dict[str, Any]:
    """The subset of torch DDP's ``_get_ddp_logging_data()`` fastddp knows,
    under torch's key names and formats."""
    params = ddp._reducer_params
    reducer = ddp._reducer
    plan = reducer.bucket_plan() if reducer is not None else [list(range(len(params)))]
    unused = reducer.last_unused_parameters() if reducer is not None else []
    data: dict[str, Any] = {
        "module_name": type(ddp.module).__name__,
        "world_size": ddp.process_group.size(),
        # The group's own rank: dist.get_rank(group) fails for groups not made by new_group.
        "rank": ddp.process_group.rank(),
        "backend_name": ddp.process_group.name() if hasattr(ddp.process_group, "name") else "",
        "device_ids": ", ".join(str(i) for i in ddp.device_ids or []),
        "output_device": ddp.output_device if ddp.output_device is not None else -1,
        "broadcast_buffers": int(ddp.forward_sync_buffers),
        "bucket_cap_bytes": ddp.bucket_bytes_cap,
        "find_unused_parameters": int(ddp.find_unused_parameters),
        "gradient_as_bucket_view": int(ddp.gradient_as_bucket_view),
        "static_graph": int(ddp.static_graph),
        "is_multi_device_module": 0,
        "num_parameter_tensors": len(params),
        "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
        "dtypes": ", ".join(sorted({_dtype_name(p.dtype) for p in params})),
        "bucket_sizes": ddp._initial_bucket_sizes,
        "has_rebuilt_buckets": int(reducer is not None and reducer.has_rebuilt_buckets),
        "unused_parameter_size": sum(params[i].numel() * params[i].element_size() for i in unused),
        "comm_hook": reducer.hook_name if reducer is not None else "",
        "join_uneven_inputs": int(ddp._join_config.enable),
        "iteration": max(reducer.num_iterations - 1, 0) if reducer is not None else 0,
        "num_backward_syncs": reducer.num_backward_syncs if reducer is not None else 0,
    }
    if reducer is not None and reducer.has_rebuilt_buckets:
        data["rebuilt_bucket_sizes"] = bucket_sizes(params, plan)
        data["rebuilt_per_bucket_param_indices"] = ", ".join(
            " ".join(str(i) for i in b) for b in plan)
    error = reducer.last_error() if reducer is not None else ""
    error = ddp.logger.error or error
    if error:
        data["has_error"] = 1
        data["error"] = error
    if reducer is not None:
        data["prev_iteration_grad_ready_order_indices"] = ", ".join(
            str(i) for i in reducer.last_ready_order())
    return data


def comm_stats(ddp: DistributedDataParallel) -> dict[str, Any]:
    """Per-step communication figures kept by the C++ reducer (see README)."""
    reducer = ddp._reducer
    if reducer is None:
        return {"steps": 0, "world_size": 1, "hook": "none (world size 1)", "bytes_reduced": 0,
                "bytes_sent": 0, "compression_ratio": 1.0, "exposed_comm_ms": 0.0,
                "mean_exposed_comm_ms": 0.0, "buckets": []}
    stats = reducer.comm_stats()
    stats["world_size"] = ddp.process_group.size()
    params = ddp._reducer_params
    for bucket, indices in zip(stats["buckets"], reducer.bucket_plan()):
        bucket["num_params"] = len(indices)
        bucket["numel"] = sum(params[i].numel() for i in indices)
        bucket["dtype"] = str(params[indices[0]].dtype).removeprefix("torch.")
    return stats
