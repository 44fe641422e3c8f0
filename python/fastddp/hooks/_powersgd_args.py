"""The arguments of the PowerSGD hooks ("powersgd", "powersgd_batched"): one set of checks
for ``fastddp.hooks.powersgd`` and ``fastddp.hooks.batched_powersgd``, and torch's
``PowerSGDState`` read as native-hook options."""

from typing import Any


def powersgd_options(name: str, matrix_approximation_rank: int, start_powerSGD_iter: int,
                     min_compression_rate: float, use_error_feedback: bool, warm_start: bool,
                     orthogonalization_epsilon: float, random_seed: int,
                     batch_tensors_with_same_shape: bool,
                     compression_stats_logging_frequency: int,
                     start_arg: str = "start_powerSGD_iter") -> dict[str, Any]:
    """The checked options of the hook built by `name` (for messages), as the C++ registry
    takes them. Every bad argument raises ValueError, as torch's PowerSGDState does;
    `start_arg` is what the caller calls start_powerSGD_iter."""
    _check_int(name, "matrix_approximation_rank", matrix_approximation_rank, minimum=1)
    _check_int(name, start_arg, start_powerSGD_iter, minimum=0)
    _check_int(name, "random_seed", random_seed, minimum=0)
    _check_int(name, "compression_stats_logging_frequency", compression_stats_logging_frequency,
               minimum=0)
    if random_seed > 2**32 - 1:
        raise ValueError(f"{name}: random_seed must be between 0 and 2**32 - 1, got {random_seed}")
    for arg, value in (("use_error_feedback", use_error_feedback), ("warm_start", warm_start),
                       ("batch_tensors_with_same_shape", batch_tensors_with_same_shape)):
        if not isinstance(value, bool):
            # ValueError, as for every bad powersgd argument (torch's PowerSGDState raises it).
            raise ValueError(f"{name}: {arg} must be a bool, got {type(value).__name__}")  # noqa: TRY004
    for arg, value in (("min_compression_rate", min_compression_rate),
                       ("orthogonalization_epsilon", orthogonalization_epsilon)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name}: {arg} must be a number >= 0, got {value!r}")
    if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
        raise ValueError(f"{name}: {start_arg} must be > 1 if use_error_feedback or "
                         f"warm_start is enabled (torch's rule: DDP rebuilds its buckets after "
                         f"the first iteration), got {start_powerSGD_iter}")
    return {"matrix_approximation_rank": matrix_approximation_rank,
            "start_powerSGD_iter": start_powerSGD_iter,
            "min_compression_rate": float(min_compression_rate),
            "use_error_feedback": use_error_feedback, "warm_start": warm_start,
            "orthogonalization_epsilon": float(orthogonalization_epsilon),
            "random_seed": random_seed,
            "batch_tensors_with_same_shape": batch_tensors_with_same_shape,
            "compression_stats_logging_frequency": compression_stats_logging_frequency}


def _check_int(hook: str, arg: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{hook}: {arg} must be an int >= {minimum}, got {value!r}")


def options_from_state(state: Any) -> dict[str, Any]:
    """torch's PowerSGDState as native-hook options: its settings, iteration, logging
    frequency and generator (the native hook goes on from where the generator stands)."""
    _, key, pos, *_ = state.rng.get_state()
    return {"matrix_approximation_rank": int(state.matrix_approximation_rank),
            "start_powerSGD_iter": int(state.start_powerSGD_iter),
            "min_compression_rate": float(state.min_compression_rate),
            "use_error_feedback": bool(state.use_error_feedback),
            "warm_start": bool(state.warm_start),
            "orthogonalization_epsilon": float(state.orthogonalization_epsilon),
            "batch_tensors_with_same_shape": bool(state.batch_tensors_with_same_shape),
            "compression_stats_logging_frequency":
                int(state.compression_stats_logging_frequency),
            "iter": int(state.iter),
            "numpy_rng_state": " ".join(str(int(v)) for v in [pos, *key])}
