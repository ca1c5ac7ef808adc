"""t2train.kernels: fused Triton kernels for the residual operators, with PyTorch references."""
