"""Numerical kernels (the low-level layer: they import nothing of archscale but each other and `errors`), each
with a pure-PyTorch reference, faster PyTorch or C++ paths and optional CUDA kernels, chosen by `dispatch.py`.

Import from the submodules (``from archscale.kernels.selective_scan import selective_scan``); the package does
not re-export, so that a function never shadows the module of the same name.
"""
