"""Kernels the model and trainer call that are not token mixers: the LM-head loss and attention masks for CUDA."""
