"""Known library warnings are silenced narrowly: by message and emitting module only."""

from __future__ import annotations

import logging
import warnings

from t2train.compat import library_noise


def _warn_from(module: str, message: str) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        library_noise.silence()
        exec(
            compile(f"import warnings\nwarnings.warn({message!r}, UserWarning)", module, "exec"),
            {"__name__": module},
        )
    return [str(w.message) for w in caught]


def test_the_known_megatron_warning_is_dropped_and_others_are_kept():
    known = "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."
    assert _warn_from("megatron.core.optimizer", known) == []
    assert _warn_from("megatron.core.optimizer", "something new") == ["something new"]
    assert _warn_from("some.other.library", known) == [known]  # only megatron's
    norm = "Apex is not installed. Falling back to Torch Norm"
    assert _warn_from("megatron.core.models.backends", norm) == []
    scope = "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer."
    assert _warn_from("megatron.core.transformer.transformer_config", scope) == []
    assert _warn_from("megatron.core.transformer.transformer_config", "new") == ["new"]


def test_the_known_torch_log_record_is_dropped_and_others_are_kept(caplog):
    library_noise.silence()
    logger = logging.getLogger("torch.utils.cpp_extension")
    with caplog.at_level(logging.WARNING, logger="torch.utils.cpp_extension"):
        logger.warning("No CUDA runtime is found, using CUDA_HOME='/usr/local'")
        logger.warning("a new problem")
    assert [r.getMessage() for r in caplog.records] == ["a new problem"]


def test_torchaos_enum_registration_notice_is_dropped(caplog):
    library_noise.silence()
    logger = logging.getLogger("torch.utils._pytree")
    with caplog.at_level(logging.WARNING, logger="torch.utils._pytree"):
        logger.warning(
            "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by "
            "torch.compile as an opaque value type. Calling register_constant() on Enum "
            "subclasses is deprecated and will be an error in a future release."
        )
        logger.warning("a new problem")
    assert [r.getMessage() for r in caplog.records] == ["a new problem"]


def _warn(module: str, message: str, category) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        library_noise.silence()
        warnings.warn_explicit(message, category, f"{module}.py", 1, module=module)
    return [str(w.message) for w in caught]


def test_checkpoint_loads_and_zero_collectives_are_quiet_and_only_them():
    load = "`load_state_dict` is deprecated and will be removed in future versions. Please use"
    assert _warn("megatron.core.dist_checkpointing.strategies.torch", load, FutureWarning) == []
    sharded = "Please use DTensor instead and we are deprecating ShardedTensor."
    assert _warn("torch.distributed.checkpoint.planner_helpers", sharded, FutureWarning) == []
    gather = (
        "`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
        "`torch.distributed.all_gather_single` instead."
    )
    assert _warn("torch.distributed.c10d_logger", gather, FutureWarning) == []
    assert _warn("some.library", gather, FutureWarning) == [gather]  # only torch's own
    other = "`torch.distributed.broadcast_object_list` is deprecated"
    assert _warn("torch.distributed.c10d_logger", other, FutureWarning) == [other]


def test_cuda_advice_is_dropped_only_without_cuda():
    advice = (
        "When using sequence parallelism it is recommended to set the environment "
        "variable CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup"
    )
    assert _warn("megatron.core.tensor_parallel.layers", advice, UserWarning) == [advice]
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        library_noise.silence_without_cuda()  # what the megatron-core CPU shim calls
        for message in (advice, advice.replace("sequence parallelism", "async grad allreduce")):
            warnings.warn_explicit(
                message, UserWarning, "layers.py", 1, module="megatron.core.tensor_parallel.layers"
            )
    assert caught == []


def test_launch_and_deepspeed_log_records_are_dropped(caplog):
    library_noise.silence()
    with caplog.at_level(logging.WARNING):
        logging.getLogger("torch.distributed.run").warning(
            "\n*****\nSetting OMP_NUM_THREADS environment variable for each process to be 1 in "
            "default, to avoid your system being overloaded"
        )
        logging.getLogger("DeepSpeed").warning(
            "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable "
            "to detect it."
        )
        logging.getLogger("DeepSpeed").warning("a new problem")
    assert [r.getMessage() for r in caplog.records] == ["a new problem"]


def test_known_prints_are_dropped_and_other_lines_pass(capsys):
    with library_noise.known_prints_dropped():
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
        print("kept", end="")
        print(" line")
        print("DeepSpeed deepspeed.ops.comm.other built successfully, and more")
    assert capsys.readouterr().out == (
        "kept line\nDeepSpeed deepspeed.ops.comm.other built successfully, and more\n"
    )
