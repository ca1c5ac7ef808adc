"""Pipeline hops at their own size: the schedule is told each receive's shape.

Megatron-core's schedules (0.16.1) send one tensor shape per run, ``(seq_length,
micro_batch, hidden)``. With the depth cache the hops of one layout differ in size. Megatron
has a way to send varying shapes, ``config.variable_seq_lengths``: before every call's
tensors, the ranks exchange 3-integer shape messages and wait for them. With virtual stages
that exchange fails on gloo (``docs/benchmarks.md``, "Pipeline hops"): on a two-rank
pipeline the shapes of the two directions arrive swapped, and with the order fixed it still
deadlocks, because the interleaved schedule does not pair every call on one rank with one
call on its peer, and a call that waits for its shapes before posting its tensors can wait on
a shape its peer sends only after this call's tensors have arrived.

No message is needed: every hop's size is known in advance. Tensors between two pipeline
ranks arrive in the order they are sent, and each rank sends in the order of Megatron's
schedule table (``get_schedule_table``: forward in table order, backward in reverse chunk
order), so the k-th forward tensor a rank receives is the k-th hop its previous rank sends
and carries ``HopPlan.wire_units`` of the chunk it enters; gradients likewise, in the other
direction. ``PlannedShapeCommunicator`` answers Megatron's shape question
(``_communicate_shapes``, asked before each receive when ``variable_seq_lengths`` is on)
from those two queues, without communicating. The receiving decoder checks each hop's size
against the chunk it enters (``ResidualDecoder._receive_hop``), so a schedule that sends in
another order fails loudly instead of training on the wrong units.
"""

from __future__ import annotations

import copy
from collections import deque

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedules import get_schedule_table
from megatron.core.process_groups_config import ProcessGroupCollection

from t2train.parallel.hop_plan import HopPlan


def schedule_order(num_microbatches: int, virtual: int, group_size) -> list[int]:
    """Virtual stage of each forward step of a rank, in the order the schedule runs them."""
    if virtual == 1:
        return [0] * num_microbatches
    return [stage for _, stage in get_schedule_table(num_microbatches, virtual, group_size)]


class PlannedShapeCommunicator(P2PCommunicator):
    """Megatron's communicator, told each receive's shape by the hop plan."""

    def __init__(
        self,
        pp_group,
        config,
        hops: HopPlan,
        unit_shape: tuple[int, int, int],
        num_microbatches: int,
        forward_only: bool,
    ):
        config = copy.copy(config)  # the model's own config keeps fixed shapes
        config.variable_seq_lengths = True  # so the schedule asks _communicate_shapes
        super().__init__(pp_group, config)
        pipeline, rank = pp_group.size(), pp_group.rank()
        virtual = hops.chunks // pipeline
        order = schedule_order(num_microbatches, virtual, config.microbatch_group_size_per_vp_stage)
        seq, micro, hidden = unit_shape

        def shape(chunk: int) -> list[int]:
            return [hops.wire_units(chunk) * seq, micro, hidden]

        sender = (rank - 1) % pipeline  # forward hops enter the chunk after the sender's
        self._forward = deque(
            shape(stage * pipeline + sender + 1)
            for stage in order
            if stage * pipeline + sender + 1 < hops.chunks
        )
        sender = (rank + 1) % pipeline  # gradients of the hops into the sender's chunks
        backward = [] if forward_only else [virtual - 1 - stage for stage in order]
        self._backward = deque(
            shape(stage * pipeline + sender) for stage in backward if stage * pipeline + sender > 0
        )

    def _communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        return (
            self._forward.popleft() if recv_prev else [0, 0, 0],
            self._backward.popleft() if recv_next else [0, 0, 0],
        )


def planned_shape_arguments(
    config,
    hops: HopPlan,
    unit_shape: tuple[int, int, int],
    num_microbatches: int,
    forward_only: bool,
) -> dict:
    """Keyword arguments that make a Megatron schedule receive each hop at its own size."""
    groups = ProcessGroupCollection()
    groups.tp = parallel_state.get_tensor_model_parallel_group()
    groups.cp = parallel_state.get_context_parallel_group()
    groups.embd = parallel_state.get_embedding_group(check_initialized=False)
    groups.pos_embd = parallel_state.get_position_embedding_group(check_initialized=False)
    groups.pp = parallel_state.get_pipeline_model_parallel_group()
    groups.dp_cp = parallel_state.get_data_parallel_group(
        with_context_parallel=True, partial_data_parallel=False
    )
    communicator = PlannedShapeCommunicator(
        groups.pp, config, hops, unit_shape, num_microbatches, forward_only
    )
    return {"p2p_communicator": communicator, "pg_collection": groups}
