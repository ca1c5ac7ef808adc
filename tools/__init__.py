"""Tools run from a checkout of the repository, not installed with the package:
``gpu_check``, the GPU acceptance check (``python3 -m tools.gpu_check``, docs/gpu/README.md).
"""
