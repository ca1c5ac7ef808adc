"""A loaded data position that no other process can remove: mosaicml-streaming's resume state
kept on the dataset object instead of in shared memory.

streaming 0.13 keeps the state given to ``StreamingDataset.load_state_dict`` only in a
shared-memory segment named by the dataset's prefix (``<prefix>_resume``), and reads it back
by name in ``_resume``: when a pass starts (in the process or DataLoader worker that
iterates) and at every ``state_dict`` (the position a checkpoint records). The name is not
this process's alone. A process that ended leaves its resource tracker to unlink, by name,
the segments it created, and a new dataset on the host may already have taken the same
prefix and made a segment of that name. Without it streaming starts the epoch at its first
sample, silently, and records offset 0 at the next save: a two-node restart trained its
resumed steps on the epoch's first samples again.

``ResumeFromObject`` keeps the loaded state on the dataset and answers ``_resume`` from it,
as streaming's own ``_resume`` does from the segment. That also ends a leak: streaming's
``_resume`` attached to the segment at every call and kept the attachment until the process
exits (an ``atexit`` cleanup), two file descriptors per ``state_dict``, which a trainer calls
at every save. A DataLoader worker gets the state with its copy of the dataset: t2train's
workers are made for each pass (not persistent), after the load. ``RESUME_READER`` is the
contract with streaming, checked in ``tests/test_compat_streaming.py``; the fault itself is
reproduced in ``tests/data/test_data_loader.py``.
"""

from __future__ import annotations

from typing import Any, Optional

from streaming import StreamingDataset

# streaming's method that reads the loaded state back, and its arguments.
RESUME_READER = ("_resume", ["world", "epoch"])


class ResumeFromObject(StreamingDataset):
    """A ``StreamingDataset`` that reads a loaded position from itself, not shared memory.

    Every dataset of t2train gives ``num_canonical_nodes``, so the defaults streaming's
    ``_resume`` derives without it are never needed here."""

    _loaded_state: Optional[dict] = None

    def load_state_dict(self, obj: dict[str, Any]) -> None:
        super().load_state_dict(obj)  # streaming's own copy, which nothing here reads
        self._loaded_state = dict(obj)

    def _resume(self, world, epoch: int) -> tuple[int, int]:
        """(epoch, sample in epoch) to start at: the loaded state's, unless nothing was
        loaded or the pass is a later epoch's (streaming's "stale" state), then the epoch's
        start."""
        state = self._loaded_state
        if state is None or state["epoch"] < epoch:
            self._set_shuffle_block_size(world)
            return epoch, 0
        self.num_canonical_nodes = state["num_canonical_nodes"]
        self.shuffle_seed = state["shuffle_seed"]
        self.initial_physical_nodes = state.get("initial_physical_nodes")
        self._set_shuffle_block_size(world)
        return state["epoch"], state["sample_in_epoch"]
