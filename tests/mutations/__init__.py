"""Named mutations of the residual designs and kernels, and a runner that shows the fast
tests catch each one: ``python -m tests.mutations`` (see ``docs/testing.md``)."""
