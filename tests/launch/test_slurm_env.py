"""The launcher's reading of SLURM environments recorded from real job steps.

``MULTI_NODE`` and ``BATCH_SCRIPT`` were recorded on the local test cluster (slurm-wlm
22.05): ``env`` inside ``srun --ntasks-per-node=1`` on node 2 of a 2-node job, and in the
batch script of that job. The GPU ones follow the same variables with a GPU allocation.
Host lists are expanded by the real ``scontrol`` (``slurm_conf`` installs it).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from t2train.launch.plan import processes_per_node
from t2train.launch.slurm_env import SlurmEnvError, expand_nodelist, read_step

MULTI_NODE = {
    "SLURMD_NODENAME": "n2",
    "SLURM_CLUSTER_NAME": "t2test",
    "SLURM_CPUS_ON_NODE": "2",
    "SLURM_DISTRIBUTION": "cyclic",
    "SLURM_GTIDS": "1",
    "SLURM_JOBID": "1",
    "SLURM_JOB_CPUS_PER_NODE": "2(x2)",
    "SLURM_JOB_ID": "1",
    "SLURM_JOB_NAME": "envjob.sh",
    "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_JOB_PARTITION": "debug",
    "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1",
    "SLURM_LOCALID": "0",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_NODELIST": "n[1-2]",
    "SLURM_NPROCS": "2",
    "SLURM_NTASKS": "2",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_PROCID": "1",
    "SLURM_STEPID": "0",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "n[1-2]",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "SLURM_SUBMIT_DIR": "/tmp/sl",
    "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURM_TASK_PID": "4718",
    "SLURM_TOPOLOGY_ADDR": "n2",
}

BATCH_SCRIPT = {
    key: value
    for key, value in MULTI_NODE.items()
    if not key.startswith(("SLURM_STEP", "SLURM_LAUNCH", "SLURM_DISTRIBUTION"))
}
BATCH_SCRIPT.update(
    SLURMD_NODENAME="n1", SLURM_NODEID="0", SLURM_PROCID="0", SLURM_TOPOLOGY_ADDR="n1"
)

SINGLE_NODE_GPU = {
    "SLURMD_NODENAME": "gpu-07",
    "SLURM_JOB_ID": "48213",
    "SLURM_JOB_NODELIST": "gpu-07",
    "SLURM_NNODES": "1",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "1",
    "SLURM_PROCID": "0",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "gpu-07",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_NUM_TASKS": "1",
    "SLURM_GPUS_ON_NODE": "8",
    "SLURM_GPUS_PER_NODE": "8",
    "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
}

# Four nodes with a gap, the last node's task, on the job's second run.
HETEROGENEOUS = {
    "SLURMD_NODENAME": "gpu-07",
    "SLURM_JOB_ID": "48999",
    "SLURM_JOB_NODELIST": "gpu-[01-03,07]",
    "SLURM_NNODES": "4",
    "SLURM_NODEID": "3",
    "SLURM_NTASKS": "4",
    "SLURM_PROCID": "3",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "gpu-[01-03,07]",
    "SLURM_STEP_NUM_NODES": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_GPUS_ON_NODE": "4",
    "SLURM_RESTART_COUNT": "1",
}


def test_multi_node_step(slurm_conf):
    step = read_step(MULTI_NODE)
    assert (step.job_id, step.nodes, step.node_rank) == ("1", ("n1", "n2"), 1)
    assert step.gpus_on_node is None and step.restart_count == 0


def test_single_node_gpu_step(slurm_conf):
    step = read_step(SINGLE_NODE_GPU)
    assert (step.nodes, step.node_rank, step.gpus_on_node) == (("gpu-07",), 0, 8)
    assert processes_per_node(None, step.gpus_on_node, cuda_devices=8) == 8


def test_heterogeneous_node_list(slurm_conf):
    step = read_step(HETEROGENEOUS)
    assert step.nodes == ("gpu-01", "gpu-02", "gpu-03", "gpu-07")
    assert (step.node_rank, step.gpus_on_node, step.restart_count) == (3, 4, 1)
    assert expand_nodelist("a[1-2],b[08-10]") == ("a1", "a2", "b08", "b09", "b10")


@pytest.mark.parametrize(
    "env, cause",
    [
        (BATCH_SCRIPT, "SLURM_STEP_ID is not set: run the launcher as one task per node"),
        (
            {**MULTI_NODE, "SLURM_STEP_NUM_TASKS": "4"},
            "SLURM_STEP_NUM_TASKS=4: expected one launcher per node",
        ),
        (
            {**MULTI_NODE, "SLURM_STEP_NUM_NODES": "3", "SLURM_STEP_NUM_TASKS": "3"},
            "SLURM_STEP_NODELIST='n[1-2]': names 2 nodes, but SLURM_STEP_NUM_NODES=3",
        ),
        ({**MULTI_NODE, "SLURM_NODEID": "2"}, "SLURM_NODEID=2: expected < SLURM_STEP_NUM_NODES=2"),
        ({**MULTI_NODE, "SLURMD_NODENAME": "n1"}, "SLURMD_NODENAME='n1': expected 'n2'"),
        (
            {**MULTI_NODE, "SLURM_STEP_NUM_NODES": "two"},
            "SLURM_STEP_NUM_NODES='two': expected an integer >= 1",
        ),
        ({**HETEROGENEOUS, "SLURM_GPUS_ON_NODE": "-1"}, "SLURM_GPUS_ON_NODE='-1'"),
        (
            {**MULTI_NODE, "SLURM_STEP_NODELIST": "n[2-1]"},
            "SLURM_STEP_NODELIST='n[2-1]': names 0 nodes, but SLURM_STEP_NUM_NODES=2",
        ),
    ],
)
def test_missing_or_inconsistent_variables_are_named(slurm_conf, env, cause):
    with pytest.raises(SlurmEnvError) as err:
        read_step(env)
    assert cause in str(err.value)


def test_the_job_script_without_gpus_names_nproc_per_node(tmp_path):
    """On a node with no GPU allocated and no NPROC_PER_NODE, the script stops before srun."""
    script = Path(__file__).resolve().parents[2] / "slurm" / "pretrain.sbatch"
    env = {
        "PATH": os.environ["PATH"],
        "DATA": "d",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "n1",
        "SLURM_GPUS_ON_NODE": "0",
    }
    proc = subprocess.run(
        ["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    assert "set NPROC_PER_NODE" in proc.stderr and "--gpus-per-node=0" in proc.stderr
