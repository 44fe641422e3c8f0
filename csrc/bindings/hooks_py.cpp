// Python bindings of the comm-hook registry, the Python-hook adapter and the
// half-cast kernels (the kernels for tests and benchmarks).
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>

#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../core/numpy_random.h"
#include "../kernels/quant4.h"
#include "../hooks/half/half_ops.h"
#include "../hooks/hierarchical/hierarchical.h"
#include "../hooks/powersgd/orthogonalize.h"
#include "../hooks/powersgd/powersgd_plan.h"
#include "../hooks/sharded/reduce_scatter.h"
#include "../diloco/quant4_ops.h"
#include "../hooks/quant8/quant8_ops.h"
#include "../hooks/common/collectives.h"
#include "../hooks/common/registry.h"
#include "../hooks/common/side_stream.h"
#include "../hooks/common/spare_state.h"
#include "python_hook.h"
#include "../util/message.h"

namespace py = pybind11;

namespace fastddp {
namespace {

HalfKind kind_from_name(const std::string& dtype) {
  if (dtype == "bf16" || dtype == "bfloat16") return HalfKind::kBFloat16;
  if (dtype == "fp16" || dtype == "float16") return HalfKind::kFloat16;
  throw py::value_error("fastddp: dtype must be 'bf16' or 'fp16', got '" + dtype + "'");
}

at::Tensor half_compress(const at::Tensor& src, double scale, const std::string& dtype,
                         std::optional<at::Tensor> residual, std::optional<at::Tensor> out_arg) {
  const HalfKind kind = kind_from_name(dtype);
  at::Tensor out = out_arg ? *out_arg
                           : at::empty({src.numel()}, src.options().dtype(scalar_type_of(kind)));
  if (!residual) {
    half_compress_into(kind, src, scale, nullptr, nullptr, out);
    return out;
  }
  // In place for Python (its tests' contract); the kernel writes another buffer.
  const at::Tensor next = at::empty_like(*residual);
  half_compress_into(kind, src, scale, &*residual, &next, out);
  residual->copy_(next);
  return out;
}

at::Tensor half_cast_divide(const at::Tensor& src, int64_t divisor, const std::string& dtype) {
  const HalfKind kind = kind_from_name(dtype);
  at::Tensor out = at::empty({src.numel()}, src.options().dtype(scalar_type_of(kind)));
  half_cast_divide_into(kind, src, divisor, out);
  return out;
}

at::Tensor half_decompress(const at::Tensor& src) {
  at::Tensor out = at::empty_like(src, src.options().dtype(at::kFloat));
  half_decompress_many(half_kind_of(src.scalar_type()), {src}, {out});
  return out;
}

void half_decompress_into(const std::vector<at::Tensor>& srcs,
                          const std::vector<at::Tensor>& dsts) {
  if (srcs.empty()) return;
  half_decompress_many(half_kind_of(srcs.front().scalar_type()), srcs, dsts);
}

at::Tensor half_sum_shards(const at::Tensor& shards) {
  FASTDDP_CHECK(shards.dim() == 2, "fastddp half_sum_shards: shards must be (count, n), got ",
                shards.sizes());
  at::Tensor out = at::empty({shards.size(1)}, shards.options());
  half_sum_shards_into(half_kind_of(shards.scalar_type()), shards.contiguous(), shards.size(0),
                       out);
  return out;
}

// (codes, scales[, error]) of a float32 tensor, for tests and benchmarks.
py::tuple quantize8(const at::Tensor& src, const std::string& format, int64_t block, bool error) {
  const Quant8Format f = quant8_format_from_name(format, "format");
  FASTDDP_CHECK(block > 0, "fastddp quant8: block must be positive, got ", block);
  const at::Tensor flat = src.contiguous().view(-1);
  at::Tensor codes = at::empty({flat.numel()}, flat.options().dtype(at::kByte));
  at::Tensor scales =
      at::empty({quant8_num_blocks(flat.numel(), block)}, flat.options().dtype(at::kFloat));
  if (!error) {
    quantize8_into(f, flat, block, codes, scales, nullptr);
    return py::make_tuple(codes, scales);
  }
  at::Tensor err = at::empty_like(flat);
  quantize8_into(f, flat, block, codes, scales, &err);
  return py::make_tuple(codes, scales, err);
}

at::Tensor dequantize8(const at::Tensor& codes, const at::Tensor& scales,
                       const std::string& format, int64_t block) {
  at::Tensor out = at::empty({codes.numel()}, codes.options().dtype(at::kFloat));
  dequantize8_into(quant8_format_from_name(format, "format"), codes.contiguous().view(-1),
                   scales.contiguous().view(-1), block, out);
  return out;
}

struct PendingAllGather {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  void wait() {
    for (auto& work : works) work->wait();
  }
};

}  // namespace

void bind_hooks(py::module& m) {
  py::class_<PythonCommHook, CommHook, std::shared_ptr<PythonCommHook>>(m, "PythonCommHook")
      .def(py::init<py::object, py::object, std::vector<at::Tensor>, std::string>(),
           py::arg("state"), py::arg("hook"), py::arg("params"), py::arg("name"));

  m.def("create_comm_hook", &create_comm_hook, py::arg("name"), py::arg("process_group"),
        py::arg("options") = std::map<std::string, HookOption>{},
        "Builds the comm hook registered as `name` with typed options.");
  m.def("comm_hook_names", &comm_hook_names);
  m.def(
      "create_hierarchical_comm_hook",
      [](c10::intrusive_ptr<c10d::ProcessGroup> intra, c10::intrusive_ptr<c10d::ProcessGroup> inter,
         std::shared_ptr<CommHook> inner, bool factor_counts_nodes) -> std::shared_ptr<CommHook> {
        return std::make_shared<HierarchicalHook>(std::move(intra), std::move(inter),
                                                  std::move(inner), factor_counts_nodes);
      },
      py::arg("intra_group"), py::arg("inter_group"), py::arg("inner"),
      py::arg("factor_counts_nodes") = false,
      "Hierarchical reduction (Note [hierarchical reduction]): reduce_scatter over intra_group, "
      "`inner` (a hook built on inter_group) on this rank's shard, allgather over intra_group. "
      "factor_counts_nodes: the model's reducer runs on inter_group (torchft).");
  m.def(
      "create_reduce_scatter_comm_hook",
      [](c10::intrusive_ptr<c10d::ProcessGroup> group, std::vector<at::Tensor> shards,
         const std::string& wire, bool release_scratch) -> std::shared_ptr<CommHook> {
        std::optional<HalfKind> kind;
        std::optional<Quant8Format> kind8;
        if (wire == "int8" || wire == "e4m3" || wire == "e5m2") {
          kind8 = quant8_format_from_name(wire, "wire");
        } else if (wire != "fp32") {
          kind = kind_from_name(wire);
        }
        return std::make_shared<ReduceScatterHook>(std::move(group), std::move(shards), kind,
                                                   release_scratch, kind8);
      },
      py::arg("process_group"), py::arg("shards"), py::arg("wire") = "fp32",
      py::arg("release_scratch") = false,
      "The sharded optimizer's reduction (Note [sharded buckets]): torch DDP's copy-in, then a "
      "reduce-scatter of bucket b into shards[b]; .grad is left None. wire: 'fp32' (the "
      "bucket's dtype), 'bf16' or 'fp16' (float32 buckets, summed in float32), 'int8', "
      "'e4m3' or 'e5m2' (8-bit block-scaled, float32 buckets, dequantized and summed in "
      "float32). "
      "release_scratch: the CPU path's receive buffers freed after each backward (ZeRO-2).");
  // The launched all-gather, waited for from Python as a Work is (wait() with the
  // backend's own timeout, the GIL released); its Works are only ever dropped here or on
  // the thread that holds the GIL.
  py::class_<PendingAllGather>(m, "PendingAllGather")
      .def("wait", &PendingAllGather::wait, py::call_guard<py::gil_scoped_release>());
  m.def(
      "all_gather_in_place",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& group, at::Tensor flat) {
        return PendingAllGather{all_gather_in_place(*group, flat)};
      },
      py::arg("process_group"), py::arg("flat"), py::call_guard<py::gil_scoped_release>(),
      "Rank r's r-th of world equal parts of `flat` to every rank, in place, launched "
      "(collectives.h): the sharded optimizer's all-gather of its updated shards.");
  m.def(
      "all_reduce_in_place",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& group, const at::Tensor& tensor,
         const c10d::ReduceOp& op) {
        FASTDDP_CHECK(tensor.is_contiguous(), "fastddp: all_reduce_in_place takes a "
                      "contiguous tensor");
        std::vector<at::Tensor> one{storage_alias(tensor, 0, tensor.numel())};
        c10d::AllreduceOptions opts;
        opts.reduceOp = op;
        group->allreduce(one, opts)->wait();
      },
      py::arg("process_group"), py::arg("tensor"), py::arg("op"),
      py::call_guard<py::gil_scoped_release>(),
      "dist.all_reduce of a contiguous tensor, in place, waited for; the Work holds an alias "
      "made in C++ (Note [no Python tensor in a Work], collectives.h).");
  m.def(
      "gather_in_place",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& group, const at::Tensor& tensor,
         const std::vector<at::Tensor>& outputs, int64_t root) {
        auto alias = [](const at::Tensor& t) {
          FASTDDP_CHECK(t.is_contiguous(), "fastddp: gather_in_place takes contiguous tensors");
          return storage_alias(t, 0, t.numel());
        };
        std::vector<at::Tensor> input{alias(tensor)};
        std::vector<std::vector<at::Tensor>> output;
        if (!outputs.empty()) {
          output.emplace_back();
          for (const at::Tensor& t : outputs) output.back().push_back(alias(t));
        }
        c10d::GatherOptions opts;
        opts.rootRank = root;
        group->gather(output, input, opts)->wait();
      },
      py::arg("process_group"), py::arg("tensor"), py::arg("outputs"), py::arg("root"),
      py::call_guard<py::gil_scoped_release>(),
      "dist.gather to group rank `root` (`outputs`: one tensor per rank there, none "
      "elsewhere), waited for; the Work holds aliases made in C++ (Note [no Python tensor "
      "in a Work], collectives.h).");
  m.def("half_compress", &half_compress, py::arg("src"), py::arg("scale"), py::arg("dtype"),
        py::arg("residual") = py::none(), py::arg("out") = py::none(),
        "half(src * scale [+ residual]) as a 1-D bf16/fp16 tensor; residual updated in place.");
  m.def("half_cast_divide", &half_cast_divide, py::arg("src"), py::arg("divisor"),
        py::arg("dtype"),
        "src.to(dtype).div_(divisor) as torch's fp16/bf16_compress_hook rounds it, 1-D.");
  m.def("half_decompress", &half_decompress, py::arg("src"));
  m.def("half_decompress_into", &half_decompress_into, py::arg("srcs"), py::arg("dsts"),
        "Many 16-bit -> float32 casts in one call (one launch on CUDA).");
  m.def("half_sum_shards", &half_sum_shards, py::arg("shards"));
  m.def("_quantize8", &quantize8, py::arg("src"), py::arg("format"), py::arg("block") = 256,
        py::arg("error") = false,
        "Block-scaled 8-bit codes (uint8) and float32 scales of src (format 'int8', 'e4m3' or "
        "'e5m2'; Note [8-bit wire formats]); with error=True also src - dequantized.");
  m.def("_dequantize8", &dequantize8, py::arg("codes"), py::arg("scales"), py::arg("format"),
        py::arg("block") = 256, "float32 values of 8-bit codes and their block scales.");
  // The int4 wire (Note [int4 wire format] in csrc/kernels/quant4.h), into caller buffers:
  // DiLoCo quantizes straight into its wire buffer.
  m.def(
      "quantize4",
      [](const at::Tensor& flat, int64_t block, const at::Tensor& codes_out,
         const at::Tensor& scales_out, std::optional<at::Tensor> err) {
        quantize4_into(flat, block, codes_out, scales_out, err ? &*err : nullptr);
      },
      py::arg("flat"), py::arg("block"), py::arg("codes_out"), py::arg("scales_out"),
      py::arg("err") = py::none(),
      "int4 codes (uint8, two a byte) and float32 block scales of flat (float32) into the "
      "out tensors; with err (may be flat itself), err = flat - dequantized.");
  m.def(
      "dequantize4",
      [](const at::Tensor& codes, const at::Tensor& scales, int64_t n, int64_t block,
         at::Tensor out) {
        dequantize4_into(codes, scales, n, block, out);
        return out;
      },
      py::arg("codes"), py::arg("scales"), py::arg("n"), py::arg("block"), py::arg("out"),
      "The n float32 values of int4 codes and their block scales, into out; returns out.");
  m.def(
      "sum_shards4",
      [](const at::Tensor& shards, int64_t count, int64_t n, int64_t block, at::Tensor out) {
        sum_shards4_into(shards, count, n, block, out);
        return out;
      },
      py::arg("shards"), py::arg("count"), py::arg("n"), py::arg("block"), py::arg("out"),
      "The float32 sum in shard order of `count` packed int4 shards of n values (each "
      "quant4_shard_bytes(n, block) bytes: codes, zero padding to 4 bytes, scales) into out.");
  m.def("quant4_shard_bytes", &kernels::quant4_shard_bytes, py::arg("n"), py::arg("block"));
  m.def("quant4_scales_offset", &kernels::quant4_scales_offset, py::arg("n"),
        "Byte offset of the scales in a packed int4 shard of n values.");

  m.def(
      "powersgd_orthogonalize",
      [](at::Tensor matrices, double epsilon) {
        powersgd_orthogonalize(matrices, epsilon);
        return matrices;
      },
      py::arg("matrices"), py::arg("epsilon") = 0.0,
      "torch's PowerSGD _orthogonalize on a (batch, n, r) tensor, in place; returns it.");
  m.def(
      "_tall_orthogonalize_cpu",
      [](at::Tensor matrices) { return tall_orthogonalize_cpu(matrices); }, py::arg("matrices"),
      "The CUDA tall orthogonalization's arithmetic on a CPU tensor, in place (for tests; see "
      "csrc/hooks/powersgd/orthogonalize.h).");
  m.def(
      "_side_stream",
      [](const std::string& device) {
        const c10::Stream stream = side_stream(c10::Device(device));
        return std::make_tuple(stream.id(), stream.device_index(),
                               static_cast<int>(stream.device_type()));
      },
      py::arg("device"),
      "The hooks' side stream of a device (Note [hook streams]) as (stream_id, device_index, "
      "device_type), the arguments of torch.cuda.Stream that wrap it.");
  m.def("_settle_as_on_device", &set_settle_as_on_device, py::arg("on"),
        "Double-buffered hook state settles as on a device (swap, then a put-back on the "
        "device flag) for CPU tensors too: the tests run that path without a GPU "
        "(csrc/hooks/common/spare_state.h).");
  m.def(
      "fused_orthogonalize",
      [](at::Tensor matrices, double epsilon) { return fused_orthogonalize(matrices, epsilon); },
      py::arg("matrices"), py::arg("epsilon") = 0.0,
      "Orthogonalizes a (batch, n, r) tensor's columns in place with the fused kernels and "
      "returns True; returns False, leaving it untouched, where they do not apply (see "
      "csrc/hooks/powersgd/orthogonalize.h).");
  m.def(
      "numpy_randint",
      [](int64_t seed, int64_t high, int64_t count) {
        if (seed < 0 || seed > 0xffffffffLL) throw py::value_error("seed must be in [0, 2**32)");
        if (high < 1 || high > (int64_t{1} << 32)) {
          throw py::value_error("high must be in [1, 2**32]");
        }
        NumpyRandomState rng(static_cast<uint32_t>(seed));
        std::vector<int64_t> out;
        for (int64_t i = 0; i < count; ++i) out.push_back(rng.randint(high));
        return out;
      },
      py::arg("seed"), py::arg("high"), py::arg("count"),
      "numpy.random.RandomState(seed).randint(high) `count` times, as the powersgd hook draws.");
}

}  // namespace fastddp
