"""Package layout: derived from the source tree, so a new subpackage cannot be left out.

The user's layout keeps data/, kernels/ and launch/ at the top level; they are installed as
t2train.data, t2train.kernels and t2train.launch so no top-level import name collides with
PyPI packages (e.g. `kernels`, which transformers auto-imports). Everything else about the
project is in pyproject.toml.
"""

from setuptools import find_packages, setup

SOURCE_ROOTS = {
    "t2train": "t2train",
    "t2train.data": "data",
    "t2train.kernels": "kernels",
    "t2train.launch": "launch",
}

packages = []
for package, folder in SOURCE_ROOTS.items():
    packages += [package] + [f"{package}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=SOURCE_ROOTS)
