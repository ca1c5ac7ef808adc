"""Without a GPU, run the Triton kernels on the CPU interpreter.

Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when a ``t2train.kernels``
kernel module is first imported (lazily, by the tests or by the dispatcher), so setting it
while this directory is collected is early enough. Nothing else in the suite runs Triton on
CPU, so the setting cannot change other tests.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
