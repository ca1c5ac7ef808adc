"""The GPU check: everything a bare, offline GPU machine runs to prove the GPU path.

``make gpu-bundle`` (where there is network) builds ``.gpu-bundle/`` (``bundle.py``); on the
GPU machine ``python3 -m tools.gpu_check OUT_DIR`` installs it (``install.py``) and runs
the check (``check.py``: sections from ``plan.py`` and ``targets.yaml``, report from
``report.py``). docs/gpu/README.md gives the exact device command.
"""
