"""slurm/pretrain.sbatch's own plumbing, run by bash with a stand-in ``srun`` that records the
command it is asked to start on every node (the script on a real cluster: test_slurm_jobs.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SBATCH = Path(__file__).resolve().parents[2] / "slurm" / "pretrain.sbatch"


def _launch_argv(tmp_path: Path, **env: str) -> list[str]:
    stand_ins = tmp_path / "bin"
    stand_ins.mkdir()
    srun = stand_ins / "srun"
    srun.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$SRUN_ARGV"\n')
    srun.chmod(0o755)
    proc = subprocess.run(
        ["bash", str(SBATCH), "model.num_layers=2"],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(
            PATH=f"{stand_ins}:{os.environ['PATH']}",
            DATA="/data/x",
            NPROC_PER_NODE="2",
            SLURM_JOB_ID="7",
            SLURM_JOB_NODELIST="n[1-2]",
            SRUN_ARGV=str(tmp_path / "argv"),
            **env,
        ),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return (tmp_path / "argv").read_text().splitlines()


def test_max_restarts_and_timeouts_reach_the_launchers(tmp_path):
    argv = _launch_argv(tmp_path, MAX_RESTARTS="2", RESTART_TIMEOUT="90", JOIN_TIMEOUT="120")
    assert argv[argv.index("--max-restarts") + 1] == "2", argv
    assert argv[argv.index("--restart-timeout") + 1] == "90", argv
    assert argv[argv.index("--join-timeout") + 1] == "120", argv
    assert "model.num_layers=2" in argv


def test_without_max_restarts_a_dead_rank_fails_the_job(tmp_path):
    argv = _launch_argv(tmp_path)
    assert argv[argv.index("--max-restarts") + 1] == "0", argv
    assert "--restart-timeout" not in argv and "--join-timeout" not in argv  # the defaults
