"""Numerical kernels, each with a pure-PyTorch reference, a fast PyTorch path and optional CUDA dispatch.

Import from the submodules (``from archscale.kernels.selective_scan import selective_scan``); the package does
not re-export, so that a function never shadows the module of the same name.
"""
