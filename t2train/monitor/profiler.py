"""``log.profile_steps``: a ``torch.profiler`` trace of a few training steps, per rank.

Each profiling rank (``log.profile_ranks``) writes ``<run_dir>/profile/rank<R>.pt.trace.json``
when the last profiled step ends: Chrome trace events, which Perfetto (ui.perfetto.dev) and
TensorBoard's PyTorch profiler plugin open, the host's operators and, on CUDA, the device's
kernels. The regions are named: each decoder layer's forward (``t2train layer N``), each
Triton kernel (its operator, ``t2train::<name>``), the optimizer step (``Optimizer.step#...``).
With ``log.memory_snapshot`` on CUDA the caching allocator's history over the same steps is
written to ``profile/memory_rank<R>.pickle`` (drop it on pytorch.org/memory_viz).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from t2train.compat import library_noise
from t2train.config.schema import LogConfig


class StepProfiler:
    """``begin(step)`` and ``end(step)`` around every training step; ``close`` at the end."""

    def __init__(self, log: LogConfig, run_dir: Path, rank: int):
        window = log.profile_window()
        self.window = window if window and log.profiles_rank(rank) else None
        self.folder, self.rank = run_dir / "profile", rank
        self.memory = log.memory_snapshot and torch.cuda.is_available()
        self.profile: Optional[torch.profiler.profile] = None
        self.written: list[Path] = []

    def begin(self, step: int) -> None:
        if self.window is None or step != self.window[0]:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        else:
            library_noise.profiler_quiet_without_cuda()
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        self.profile = torch.profiler.profile(activities=activities, record_shapes=True)
        self.profile.start()

    def end(self, step: int) -> None:
        if self.profile is not None and self.window is not None and step == self.window[1]:
            self.close()

    def close(self) -> None:
        """Stop and write what was recorded (a run that stops inside the window too)."""
        if self.profile is None:
            return
        profile, self.profile = self.profile, None
        profile.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"rank{self.rank}.pt.trace.json"
        profile.export_chrome_trace(str(trace))
        self.written.append(trace)
        if self.memory:
            snapshot = self.folder / f"memory_rank{self.rank}.pickle"
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.written.append(snapshot)
