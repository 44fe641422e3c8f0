"""The wires that average a flat pseudo-gradient over the ranks: one collective per flat buffer,
launched by start() and finished by the returned Exchange's wait() (so that a later change
can overlap it with local steps).

fp32  an allreduce (SUM) then a division by the world size: torchft's Manager.allreduce's
      arithmetic (ReduceOp.AVG as SUM, then ``/= num_participants``).
bf16  _C.half_compress (bf16 of pseudo-gradient / world [+ residual], residual updated in
      place: error feedback), an allgather of the bf16 codes, _C.half_decompress_into to
      float32 and a float32 sum in rank order.
int4  the same with fastddp's 4-bit codes (Note [int4 wire format], csrc/kernels/quant4.h):
      _C.quantize4 with the error fed back, one packed shard [codes | pad | scales] a rank,
      one allgather, _C.sum_shards4 (every rank's shard decoded and summed in float32 in rank
      order, one call).
int8  the "int8" hook's codes (Note [8-bit wire formats], csrc/hooks/quant8/quant8_hook.h):
      pseudo-gradient / world [+ residual] quantized by _C._quantize8 with its error kept as
      the residual, [codes | scales] packed into one uint8 buffer, one allgather, one
      _C._dequantize8 of every rank's buffer and a float32 sum in rank order.

Every rank decodes the same gathered bytes in the same order, so the averages agree bit for bit
across ranks and the anchors never drift apart.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fastddp import _C, _group_ops

# Note [8-bit wire formats]: one float32 scale per block of 256 values.
INT8_BLOCK = 256
# 4 bits leave 15 levels, so an outlier costs its whole block's resolution: a block of 64
# confines that to 64 neighbours for 1/8 more bytes than 256 (0.5625 bytes a value).
INT4_BLOCK = 64


class Exchange:
    """A launched exchange: wait() blocks until it lands and returns the rank average."""

    def __init__(self, work: dist.Work, finish):
        self._work, self._finish = work, finish

    def wait(self) -> torch.Tensor:
        _group_ops.wait(self._work)
        return self._finish()


class Wire:
    """Averages flat buffers over `group`; holds one error-feedback residual per buffer."""

    name = ""
    quantized = True

    def __init__(self, group: dist.ProcessGroup, flats: list[torch.Tensor], error_feedback: bool):
        self.group, self.world = group, group.size()
        if self.quantized:
            for i, flat in enumerate(flats):
                if flat.dtype != torch.float32:
                    raise NotImplementedError(
                        f"fastddp.DiLoCo: wire={self.name!r} averages float32 parameters only; "
                        f"parameter buffer {i} is {flat.dtype} (use wire='fp32')")
        keep = self.quantized and error_feedback
        self.residuals: list[torch.Tensor | None] = [
            torch.zeros_like(f) if keep else None for f in flats]
        # What this rank put into the collectives (each one's input buffer), counted as sent.
        self.payload_bytes = 0

    def start(self, index: int, flat: torch.Tensor) -> Exchange:
        raise NotImplementedError

    def state_dict(self) -> list[torch.Tensor | None]:
        return [None if r is None else r.clone() for r in self.residuals]

    def load_state_dict(self, residuals: list[torch.Tensor | None]) -> None:
        if len(residuals) != len(self.residuals) or any(
                (a is None) != (b is None) or (a is not None and a.shape != b.shape)
                for a, b in zip(residuals, self.residuals)):
            raise ValueError("fastddp.DiLoCo.load_state_dict: 'residuals' do not fit this "
                             f"DiLoCo's wire={self.name!r} and parameters")
        for mine, saved in zip(self.residuals, residuals):
            if mine is not None:
                mine.copy_(saved)

    def _sum_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """values is (world, n) float32: their sum over rank 0, 1, ... in that order."""
        total = values[0].clone()
        for r in range(1, self.world):
            total += values[r]
        return total


class Fp32Wire(Wire):
    name, quantized = "fp32", False

    def start(self, index: int, flat: torch.Tensor) -> Exchange:
        self.payload_bytes += flat.numel() * flat.element_size()
        work = _group_ops.all_reduce(self.group, flat, dist.ReduceOp.SUM, async_op=True)
        return Exchange(work, lambda: flat.div_(self.world))


class Bf16Wire(Wire):
    name = "bf16"

    def start(self, index: int, flat: torch.Tensor) -> Exchange:
        codes = _C.half_compress(flat, 1.0 / self.world, "bf16", self.residuals[index])
        # Gathered as bytes: gloo's allgather takes no 16-bit integers, and bf16 not everywhere.
        gathered = torch.empty(self.world * 2 * codes.numel(), dtype=torch.uint8,
                               device=flat.device)
        self.payload_bytes += codes.numel() * codes.element_size()
        work = _group_ops.all_gather_single(self.group, gathered, codes.view(torch.uint8))

        def finish() -> torch.Tensor:
            codes_all = gathered.view(torch.bfloat16)
            values = torch.empty(codes_all.numel(), dtype=torch.float32, device=flat.device)
            _C.half_decompress_into([codes_all], [values])
            return self._sum_ranks(values.view(self.world, -1))
        return Exchange(work, finish)


class Int8Wire(Wire):
    name = "int8"

    def start(self, index: int, flat: torch.Tensor) -> Exchange:
        n = flat.numel()
        blocks = -(-n // INT8_BLOCK)
        padded = blocks * INT8_BLOCK
        # Zero padding to whole blocks: every rank's buffer then dequantizes in one call.
        staging = torch.zeros(padded, dtype=torch.float32, device=flat.device)
        staging[:n].copy_(flat).mul_(1.0 / self.world)
        residual = self.residuals[index]
        if residual is not None:
            staging[:n].add_(residual)
        quantized = _C._quantize8(staging, "int8", INT8_BLOCK, residual is not None)
        codes, scales = quantized[0], quantized[1]
        if residual is not None:
            residual.copy_(quantized[2][:n])
        packed = torch.cat([codes, scales.view(torch.uint8)])
        gathered = torch.empty(self.world, packed.numel(), dtype=torch.uint8, device=flat.device)
        self.payload_bytes += packed.numel()
        work = _group_ops.all_gather_single(self.group, gathered.view(-1), packed)

        def finish() -> torch.Tensor:
            all_codes = gathered[:, :padded].reshape(-1)
            all_scales = gathered[:, padded:].contiguous().view(torch.float32).reshape(-1)
            values = _C._dequantize8(all_codes, all_scales, "int8", INT8_BLOCK)
            return self._sum_ranks(values.view(self.world, padded))[:n]
        return Exchange(work, finish)


class Int4Wire(Wire):
    name = "int4"

    def start(self, index: int, flat: torch.Tensor) -> Exchange:
        n = flat.numel()
        staging = flat.mul(1.0 / self.world)
        residual = self.residuals[index]
        if residual is not None:
            staging.add_(residual)
        # The zero bytes between the codes and the 4-aligned scales are part of the shard.
        packed = torch.zeros(_C.quant4_shard_bytes(n, INT4_BLOCK), dtype=torch.uint8,
                             device=flat.device)
        offset = _C.quant4_scales_offset(n)
        _C.quantize4(staging, INT4_BLOCK, packed[:(n + 1) // 2],
                     packed[offset:].view(torch.float32), residual)
        self.payload_bytes += packed.numel()
        gathered = torch.empty(self.world * packed.numel(), dtype=torch.uint8,
                               device=flat.device)
        work = _group_ops.all_gather_single(self.group, gathered, packed)

        def finish() -> torch.Tensor:
            out = torch.empty(n, dtype=torch.float32, device=flat.device)
            return _C.sum_shards4(gathered, self.world, n, INT4_BLOCK, out)
        return Exchange(work, finish)


def make_wire(name: str, group: dist.ProcessGroup, flats: list[torch.Tensor],
              error_feedback: bool) -> Wire:
    """The wire called `name` (checked by _args.check_config)."""
    cls = {"fp32": Fp32Wire, "bf16": Bf16Wire, "int8": Int8Wire, "int4": Int4Wire}[name]
    return cls(group, flats, error_feedback)
