// The gated delta rule's chunk loop on CPU (gated_delta_cpu.cpp): declared here for the module's bindings.
#pragma once

#include <torch/extension.h>

#include <vector>

std::vector<torch::Tensor> gated_delta_scan_forward(torch::Tensor kq, torch::Tensor v, torch::Tensor eG,
                                                    torch::Tensor eGe, torch::Tensor a, torch::Tensor Tb,
                                                    torch::Tensor A, torch::Tensor h0, double scale, bool need_last,
                                                    int64_t threads);

std::vector<torch::Tensor> gated_delta_scan_backward(torch::Tensor kq, torch::Tensor v, torch::Tensor eG,
                                                     torch::Tensor eGe, torch::Tensor a, torch::Tensor Tb,
                                                     torch::Tensor A, torch::Tensor states, torch::Tensor kqS,
                                                     torch::Tensor u, torch::Tensor dout, torch::Tensor dlast,
                                                     double scale, bool zero_start, bool want_dh0,
                                                     int64_t threads);

// The same loops with the keys' and queries' l2norm and layout and the per-chunk factors made (and
// differentiated) inside them, no document masks: forward returns [o, states, z, kq, rs, P, M, T, eG, eGe, a, Tb,
// A]; backward [dk, dq, dv, dg, dbeta, dh0].
std::vector<torch::Tensor> gated_delta_chunk_forward(torch::Tensor k, torch::Tensor q, torch::Tensor v,
                                                     torch::Tensor g, torch::Tensor beta, torch::Tensor h0,
                                                     int64_t C, double scale, bool normalise, bool need_last,
                                                     int64_t threads);

std::vector<torch::Tensor> gated_delta_chunk_backward(torch::Tensor kq, torch::Tensor rs, torch::Tensor v,
                                                      torch::Tensor beta, torch::Tensor P, torch::Tensor M,
                                                      torch::Tensor T, torch::Tensor eG, torch::Tensor eGe,
                                                      torch::Tensor a, torch::Tensor Tb, torch::Tensor A,
                                                      torch::Tensor states, torch::Tensor z, torch::Tensor dout,
                                                      torch::Tensor dlast, double scale, bool normalise,
                                                      bool zero_start, bool want_dh0, int64_t threads);
