"""The ops the passes put into graphs, all called as `torch.ops.compiled_mtp.<name>`.

Kernels written in C++ live in csrc/, one file an op, each registering its schema, its CPU kernel
(which checks every argument's dtype and shape) and its Meta shape function with TORCH_LIBRARY;
library.py builds them into one library. Ops whose general path is PyTorch code (the sampling ops,
the packed linear, the CUDA sampling kernel in Triton) are registered from their Python modules here.
"""
