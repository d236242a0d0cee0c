// The language-model loss on CPU (cross_entropy_cpu.cpp): declared here for the module's bindings.
#pragma once

#include <torch/extension.h>

#include <vector>

std::vector<torch::Tensor> cross_entropy_forward(torch::Tensor logits, torch::Tensor targets, int64_t ignore_index,
                                                 double label_smoothing, int64_t threads);

void cross_entropy_scale_grad(torch::Tensor grad, torch::Tensor factor, int64_t threads);
