"""DiLoCo: local steps, then an outer Nesterov step on the rank-averaged pseudo-gradient
(docs/diloco.md)."""

from fastddp.diloco.diloco import DiLoCo

__all__ = ["DiLoCo"]
