"""What users read back from a fastddp model: torch's DDP logging data (the
keys that describe buckets and the run) and fastddp's communication figures."""

from __future__ import annotations

import os
from typing import Any
# The model: fastddp's DistributedDataParallel, which imports this module; the hints name
# torch's class, which it subclasses.
from torch.nn.parallel import DistributedDataParallel


_DTYPE_NAMES = {"float32": "float", "float64": "double", "float16": "c10::Half",
                "bfloat16": "c10::BFloat16"}


def _dtype_name(dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    return _DTYPE_NAMES.get(name, name)


def bucket_sizes(params, plan) -> str:
    """Bytes per bucket in torch's logging format ("a, b, c")."""
    return ", ".join(str(sum(params[i].numel() * params[i].element_size() for i in b)) for b in plan)


_ENV_KEYS = {"master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT",
             "torch_distributed_debug": "TORCH_DISTRIBUTED_DEBUG",
             "cuda_visible_devices": "CUDA_VISIBLE_DEVICES"}
_GLOO_ENV_KEYS = {"gloo_socket_ifname": "GLOO_SOCKET_IFNAME",
                  "gloo_device_transport": "GLOO_DEVICE_TRANSPORT"}
_NCCL_ENV_KEYS = {"nccl_socket_ifname": "NCCL_SOCKET_IFNAME",
                  "nccl_blocking_wait": "TORCH_NCCL_BLOCKING_WAIT",
                  "nccl_async_error_handling": "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                  "nccl_debug": "NCCL_DEBUG", "nccl_nthreads": "NCCL_NTHREADS",
                  "nccl_ib_timeout": "NCCL_IB_TIMEOUT"}


def environment_keys(group) -> dict[str, Any]:
    """torch's logger records the environment the job ran under ("N/A" when unset), with
    the backend's own variables only for that backend."""
    keys = dict(_ENV_KEYS)
    backend = group.name() if hasattr(group, "name") else ""
    if backend == "gloo":
        keys.update(_GLOO_ENV_KEYS)
    elif backend == "nccl":
        keys.update(_NCCL_ENV_KEYS)
    data: dict[str, Any] = {k: os.environ.get(v, "N/A") for k, v in keys.items()}
    if backend == "gloo":
        # torch's logger reads the group's thread count, which Python cannot see; groups
        # made by init_process_group / new_group have torch's default of 2.
        data["gloo_num_threads"] = 2
    return data


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
        "iteration": ddp.logger.sampled_iteration,
        "num_backward_syncs": reducer.num_backward_syncs if reducer is not None else 0,
    }
    if reducer is not None and reducer.has_rebuilt_buckets:
        data["rebuilt_bucket_sizes"] = bucket_sizes(params, plan)
        data["rebuilt_per_bucket_param_indices"] = ", ".join(
            " ".join(str(i) for i in b) for b in plan)
    data.update(environment_keys(ddp.process_group))
    data.update(ddp.logger.runtime_stats)
    error = ddp.logger.error or (reducer.last_error() if reducer is not None else "")
    if error:
        data["has_error"] = 1
        data["error"] = error
    if reducer is not None:
        data["prev_iteration_grad_ready_order_indices"] = ", ".join(
            str(i) for i in reducer.last_ready_order())
    return data


def comm_stats(ddp: DistributedDataParallel) -> dict[str, Any]:
    """Per-step communication figures kept by the C++ reducer (docs/hooks.md#introspection)."""
    reducer = ddp._reducer
    if reducer is None:
        return {"steps": 0, "world_size": 1, "hook": "none (world size 1)", "bytes_reduced": 0,
                "bytes_sent": 0, "compression_ratio": 1.0, "exposed_comm_ms": 0.0,
                "mean_exposed_comm_ms": 0.0, "collectives": 0, "timed_iteration": 0,
                "buckets": []}
    stats = reducer.comm_stats()
    stats["world_size"] = ddp.process_group.size()
    params = ddp._reducer_params
    for bucket, indices in zip(stats["buckets"], reducer.bucket_plan()):
        bucket["num_params"] = len(indices)
        bucket["numel"] = sum(params[i].numel() for i in indices)
        bucket["dtype"] = str(params[indices[0]].dtype).removeprefix("torch.")
    return stats
