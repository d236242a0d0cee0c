// Mamba-2's SSD chunked scan on CPU (ssd_cpu.cpp): declared here for the module's bindings.
#pragma once

#include <torch/extension.h>

#include <vector>

std::vector<torch::Tensor> ssd_forward(torch::Tensor x, torch::Tensor dt, torch::Tensor A, torch::Tensor B,
                                       torch::Tensor C, torch::Tensor starts, torch::Tensor D, torch::Tensor h0,
                                       int64_t chunk, int64_t threads);

std::vector<torch::Tensor> ssd_backward(torch::Tensor gy, torch::Tensor glast, torch::Tensor x, torch::Tensor dt,
                                        torch::Tensor A, torch::Tensor B, torch::Tensor C, torch::Tensor starts,
                                        torch::Tensor D, torch::Tensor states, torch::Tensor CB, bool has_h0,
                                        int64_t chunk, int64_t threads);
