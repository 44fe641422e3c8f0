// PowerSGD's products over a batch of (B, n, m) matrices M with their
// (B, n, r) P and (B, m, r) Q: the fused CPU kernels (kernels/lowrank.h) for
// contiguous float32 CPU tensors, bmm otherwise (CUDA, other dtypes).
#pragma once

#include <ATen/Tensor.h>

namespace fastddp {

void lowrank_project(const at::Tensor& mats, const at::Tensor& q, at::Tensor& p);       // P = M Q
void lowrank_back_project(const at::Tensor& mats, const at::Tensor& p, at::Tensor& q);  // Q = M^T P
// out = P Q^T; with src and err given (M and its error feedback, out's
// shape), also err = src - out in the same pass.
void lowrank_expand(const at::Tensor& p, const at::Tensor& q, at::Tensor& out,
                    const at::Tensor& src = {}, at::Tensor err = {});

}  // namespace fastddp
