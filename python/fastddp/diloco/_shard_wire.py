"""The quantized wires' shard-sum form (``quantized_sum="shards"``), as the "int8" hook reduces
(Note [8-bit wire formats], csrc/hooks/quant8/quant8_hook.h): the flat buffer, zero-padded to
world x S values (S a whole number of blocks), is quantized once (error fed back) and cut into
world shards; one alltoall hands rank r every rank's shard r; rank r decodes and sums them in
float32 in rank order and re-quantizes the sum (that rounding is shared by every rank and not
fed back); one allgather hands every rank every summed shard, decoded into the average.

A rank sends 2 (W - 1) / W x (bytes a value) x n, against (W - 1) x ... for the gather form:
the same on 2 ranks, less from 3 on. The second collective needs the first's result:
middle() runs it (DiLoCo calls it halfway through the overlap window), else wait() does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllToAllOptions

from fastddp import _C, _group_ops
from fastddp.diloco._wire import INT4_BLOCK, INT8_BLOCK, Wire


class _Codec:
    """Block-scaled codes of one format: `code_bytes` bytes of codes per `block` values."""

    def __init__(self, name: str, block: int, code_bytes_per_block: int):
        self.name, self.block, self.per_block = name, block, code_bytes_per_block

    def quantize(self, src: torch.Tensor, residual: torch.Tensor | None, world: int
                 ) -> torch.Tensor:
        """(world, shard bytes) uint8: each shard's [codes | scales]; residual = error."""
        if self.name == "int8":
            out = _C._quantize8(src, "int8", self.block, residual is not None)
            codes, scales = out[0], out[1]
            if residual is not None:
                residual.copy_(out[2])
        else:
            blocks = src.numel() // self.block
            codes = torch.empty(blocks * self.per_block, dtype=torch.uint8, device=src.device)
            scales = torch.empty(blocks, dtype=torch.float32, device=src.device)
            _C.quantize4(src, self.block, codes, scales, residual)
        return torch.cat([codes.view(world, -1), scales.view(torch.uint8).view(world, -1)],
                         dim=1)

    def decode(self, packed: torch.Tensor, values: int) -> torch.Tensor:
        """float32 values of (count, shard bytes) packed shards of `values` values each, as
        one (count, values) tensor."""
        count = packed.shape[0]
        code_bytes = values // self.block * self.per_block
        codes = packed[:, :code_bytes].reshape(-1)
        scales = packed[:, code_bytes:].contiguous().view(torch.float32).reshape(-1)
        if self.name == "int8":
            out = _C._dequantize8(codes, scales, "int8", self.block)
        else:
            out = torch.empty(count * values, dtype=torch.float32, device=packed.device)
            _C.dequantize4(codes, scales, count * values, self.block, out)
        return out.view(count, values)


CODECS = {"int8": _Codec("int8", INT8_BLOCK, INT8_BLOCK),
          "int4": _Codec("int4", INT4_BLOCK, INT4_BLOCK // 2)}


class ShardExchange:
    """The two collectives of one shard-sum exchange."""

    def __init__(self, wire: "ShardSumWire", n: int, shard: int, recv: torch.Tensor,
                 work: dist.Work):
        self.wire, self.n, self.shard = wire, n, shard
        self._recv, self._work = recv, work
        self._gathered: torch.Tensor | None = None

    def middle(self) -> None:
        """Waits for the alltoall, sums this rank's shard, launches the allgather."""
        if self._gathered is not None:
            return
        wire, world = self.wire, self.wire.world
        _group_ops.wait(self._work)
        mine = wire._sum_ranks(wire.codec.decode(self._recv.view(world, -1), self.shard))
        packed = wire.codec.quantize(mine, None, 1).view(-1)
        wire.payload_bytes += packed.numel()
        self._gathered = torch.empty(world, packed.numel(), dtype=torch.uint8,
                                     device=packed.device)
        self._work = _group_ops.all_gather_single(wire.group, self._gathered.view(-1), packed)

    def wait(self) -> torch.Tensor:
        self.middle()
        _group_ops.wait(self._work)
        return self.wire.codec.decode(self._gathered, self.shard).view(-1)[:self.n]


class ShardSumWire(Wire):
    def __init__(self, name: str, group: dist.ProcessGroup, flats: list[torch.Tensor],
                 error_feedback: bool):
        self.name, self.codec = name, CODECS[name]
        super().__init__(group, flats, error_feedback)

    def start(self, index: int, flat: torch.Tensor) -> ShardExchange:
        n, world, block = flat.numel(), self.world, self.codec.block
        shard = -(-n // (world * block)) * block
        staging = torch.zeros(world * shard, dtype=torch.float32, device=flat.device)
        staging[:n].copy_(flat).mul_(1.0 / world)
        residual = self.residuals[index]
        error = None
        if residual is not None:
            staging[:n].add_(residual)
            error = torch.empty_like(staging)
        packed = self.codec.quantize(staging, error, world).view(-1)
        if residual is not None:
            residual.copy_(error[:n])
        self.payload_bytes += packed.numel()
        recv = torch.empty_like(packed)
        # Even splits (empty split lists), launched: _group_ops.all_to_all_single waits.
        work = self.group.alltoall_base(recv, packed, [], [], AllToAllOptions())
        return ShardExchange(self, n, shard, recv, work)
