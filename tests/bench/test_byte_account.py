"""The byte account (``t2train bench bytes``): each design's compiled layer moves at most what
its design may, and an extra pass over the stream state is caught.

A design's ceiling is 1.3 times the minimum it declares (``ResidualDesign.minimum_traffic``)
or, while it is above that, what it moves now (``NOW``, units per sublayer call, forward +
backward, from ``docs/byte-account.md``): a ratchet that a regression cannot pass, lowered
when a design gets cheaper. The variants are ``tests/variants.py``'s ``every_design()``:
each design once, the local mixer on one of each kind of stream state.
"""

from __future__ import annotations

import pytest
import torch

from t2train.bench.byte_account import account_variant
from t2train.config.loader import load_config
from t2train.residual import get_design, registered
from t2train.residual.declaration import BODY, Traffic

from variants import every_design

pytestmark = pytest.mark.slow

TARGET = 1.3  # times the declared minimum
NOW = {  # units per sublayer call, forward + backward (docs/byte-account.md)
    "mhc": 44.3,
}
SLACK = 0.05  # units: rounding of the table


def ceiling(variant: str, minimum: tuple[float, float]) -> float:
    return max(TARGET * sum(minimum), NOW.get(variant, 0.0) + SLACK)


def test_every_design_declares_its_minimum():
    """Declared per layer, at least the sublayer body's traffic, and `standard`'s is the
    add-and-norm pass around the body written out: read state and output, write state and
    the next normed input; backward read the state's, the normed input's gradients and the
    state, write the state's gradient."""
    model = load_config(overrides=["data.path=unused", "model.num_layers=4"]).model
    assert get_design("standard").minimum_traffic(model, 0) == Traffic(2 + 4, 4 + 4)
    for name in registered():
        design = get_design(name)
        assert design.minimum_traffic is not None, name
        for layer in range(4):
            traffic = design.minimum_traffic(model, layer)
            assert traffic.forward > BODY.forward and traffic.backward > BODY.backward, name


@pytest.mark.parametrize("variant", every_design())
def test_each_design_moves_at_most_its_ceiling(variant):
    account = account_variant(variant)
    assert account.total <= ceiling(variant, account.minimum), (
        f"{variant}: {account.total:.2f} units per sublayer (forward "
        f"{account.units('forward'):.2f}, backward {account.units('backward'):.2f}) against "
        f"a ceiling of {ceiling(variant, account.minimum):.2f} (minimum "
        f"{sum(account.minimum):.2f}); t2train bench bytes --kernels --variants {variant}"
    )


@torch.library.custom_op("t2train_test::copy_of", mutates_args=())
def copy_of(x: torch.Tensor) -> torch.Tensor:
    """An opaque operator: a pass over its input that the compiler cannot fuse away."""
    return x.clone()


@copy_of.register_fake
def _(x):
    return torch.empty_like(x)


copy_of.register_autograd(lambda ctx, grad: copy_of(grad))


def test_an_extra_pass_over_the_stream_state_is_caught(monkeypatch):
    """One more pass over the state per sublayer (read and write it once, forward and
    backward) takes `standard` over its ceiling: the account sees a pass the compiler cannot
    fuse away. (The n-stream designs' passes are n units each: their own rows count them.)"""
    design = "standard"
    from importlib import import_module

    layers = import_module(get_design(design).layers)
    sublayer = getattr(layers, get_design(design).sublayer)
    write = sublayer.write
    monkeypatch.setattr(
        sublayer, "write", lambda self, state, *args: write(self, copy_of(state), *args)
    )
    account = account_variant(design)
    assert account.total > ceiling(design, account.minimum), account.total


def test_an_operator_with_several_outputs_writes_each_of_them():
    """A custom operator returning the state-sized gradient beside a narrow one (as the
    kernels' backward do) writes a packed buffer whose total is no multiple of the tokens:
    each output counts by its own size, the state-sized one as one unit written."""
    from t2train.bench import byte_account

    @torch.library.custom_op("byte_account_test::two_outputs", mutates_args=())
    def two_outputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x[:5].float()

    @two_outputs.register_fake
    def _(x):
        return torch.empty_like(x), x.new_empty((5, x.shape[1]), dtype=torch.float32)

    recorded: list = []
    x = torch.randn(byte_account.TOKENS, byte_account.HIDDEN, dtype=torch.bfloat16)
    torch.compile(lambda t: two_outputs(t + 1), backend=byte_account._accounting_backend(recorded))(
        x
    )
    (operator,) = [k for k in recorded if k.kind == "ExternKernel" and k.read]
    assert (operator.read, operator.written) == (1.0, 1.0), recorded


def test_a_result_too_large_to_inline_on_a_gpu_is_written_out():
    """An expression of ~30 ops read by two kernels (a reduction over tokens and one over h):
    at Inductor's default limits the GPU's writes it out once (fp32: 2 units), in the pass of
    the reduction over h, and the other reads it (3 units read in all); the CPU's, whose
    limit is 50 ops, would have each recompute it from x (2 units read, none written)."""
    from t2train.bench import byte_account

    def long_expression(x):
        t = x.float()
        for _ in range(14):
            t = t * 1.01 + 0.1
        return t.sum(0), t.sum(-1)

    recorded: list = []
    x = torch.randn(byte_account.TOKENS, byte_account.HIDDEN, dtype=torch.bfloat16)
    torch.compile(long_expression, backend=byte_account._accounting_backend(recorded))(x)
    assert sum(k.written for k in recorded) == 2.0, recorded
    assert sum(k.read for k in recorded) == 3.0, recorded


def test_a_result_stored_and_reduced_is_written_by_the_pass_that_reduces_it():
    """Fused as on a GPU (Triton's scheduling): the pointwise result t is written by the
    kernel of its first reduction, which reads x once; the second reduction, of another
    size, reads t again: 2 units read. The CPU's C++ backend writes t in a pass of its own,
    which both reductions read again: 3."""
    from t2train.bench import byte_account

    weights = torch.randn(3, byte_account.HIDDEN)

    def stored_and_reduced(x):
        t = (x.float() * 2 + 1).to(x.dtype)
        return t, t.float().pow(2).sum(-1), (t[:, None, :] * weights).sum(-1)

    recorded: list = []
    x = torch.randn(byte_account.TOKENS, byte_account.HIDDEN, dtype=torch.bfloat16)
    torch.compile(stored_and_reduced, backend=byte_account._accounting_backend(recorded))(x)
    assert (sum(k.read for k in recorded), sum(k.written for k in recorded)) == (2.0, 1.0), recorded


def test_a_norms_input_and_weight_gradients_are_one_pass_as_at_the_presets_sizes():
    """A GPU fuses RMSNorm's two backward reductions, over each row (the input's gradient)
    and over the tokens (the weight's), into one kernel reading x and the gradient once:
    2 units read, 1 written. Inductor does so only from a size on, which the account's
    tokens do not reach (two kernels: 4 units read)."""
    from t2train.bench import byte_account

    x = torch.randn(byte_account.TOKENS, byte_account.HIDDEN, dtype=torch.bfloat16)
    weight = torch.randn(byte_account.HIDDEN, dtype=torch.bfloat16, requires_grad=True)

    def norm(x, weight):
        return torch.nn.functional.rms_norm(x, (byte_account.HIDDEN,), weight, 1e-5)

    recorded: list = []
    compiled = torch.compile(norm, backend=byte_account._accounting_backend(recorded))
    compiled(x.requires_grad_(), weight).backward(torch.randn_like(x))
    backward = [k for k in recorded if k.graph == "backward"]
    assert (sum(k.read for k in backward), sum(k.written for k in backward)) == (2.0, 1.0), backward


@pytest.mark.parametrize("preset", ["125m", "1b"])
def test_the_gpu_checks_presets_are_large_enough_to_fuse_a_norms_reductions(preset):
    """Inductor's size check for a row and a column reduction in one kernel
    (``MixOrderReduction.can_fuse``), restated: what the account assumes at the shapes
    whose step ratios it predicts (a micro-batch's tokens, the hidden size)."""
    config = load_config(preset, overrides=["data.path=unused"])
    tokens = config.train.micro_batch_size * config.model.seq_length
    hidden = config.model.hidden_size
    assert tokens * hidden >= 5 * 2**20 and tokens >= 4096 and tokens >= 2 * hidden


def test_an_input_handed_on_and_read_has_its_two_gradients_added():
    """A layer that reads a tensor and hands it on as it came (AttnRes' earlier sources):
    its gradient from the layer and its gradient from after it are added eagerly between
    the backward graphs (2 units read, 1 written per unit of the tensor); a tensor only
    handed on (the sources' buffer) adds nothing."""
    from t2train.bench import byte_account

    shape = (3, byte_account.TOKENS, byte_account.HIDDEN)
    read = torch.randn(shape, dtype=torch.bfloat16, requires_grad=True)
    carried = torch.randn(shape, dtype=torch.bfloat16, requires_grad=True)
    outputs = [read.sum(0), read, carried]  # read.sum(0): the layer's own use of ``read``
    tangents = [torch.randn_like(t) for t in outputs]
    torch.autograd.backward(outputs, tangents)
    (added,) = byte_account._passed_through([read, carried], outputs, tangents)
    assert (added.graph, added.read, added.written) == ("backward", 6.0, 3.0), added


class _ReadAndHandOn(torch.autograd.Function):
    """Reads x and hands it on through itself: the gradient from after it comes in here."""

    @staticmethod
    def forward(ctx, x):
        return x.sum(0), x.view_as(x)

    @staticmethod
    def backward(ctx, d_sum, d_handed_on):
        return d_sum.expand_as(d_handed_on) + d_handed_on


def test_an_input_handed_on_through_the_graph_adds_nothing_eagerly():
    """Handed on as an output of the compiled graph (AttnRes' earlier sources through the
    read), the tensor's gradient from after the layer enters the layer's backward, which
    adds it: no eager add (one would be counted if it were handed on as it came)."""
    from t2train.bench import byte_account

    x = torch.randn(3, byte_account.TOKENS, byte_account.HIDDEN, dtype=torch.bfloat16)
    x.requires_grad_()
    recorded: list = []
    compiled = torch.compile(
        _ReadAndHandOn.apply, backend=byte_account._accounting_backend(recorded)
    )
    outputs = list(compiled(x))
    tangents = [torch.randn_like(t) for t in outputs]
    torch.autograd.backward(outputs, tangents)
    assert not torch.equal(x.grad, tangents[1])  # the read's own gradient was added
    assert byte_account._passed_through([x], outputs, tangents) == []
    outputs = [x.sum(0), x]  # handed on as it came
    x.grad = None
    torch.autograd.backward(outputs, tangents)
    assert len(byte_account._passed_through([x], outputs, tangents)) == 1


def test_eager_copies_write_their_destination_without_reading_it():
    """Between layers, a copy into a buffer's row moves one unit in and one out; an in-place
    add reads its destination too."""
    from t2train.bench import byte_account

    buffer = torch.zeros(3, byte_account.TOKENS, byte_account.HIDDEN, dtype=torch.bfloat16)
    source = torch.randn(byte_account.TOKENS, byte_account.HIDDEN, dtype=torch.bfloat16)
    eager = byte_account._EagerTraffic()
    with eager.mode:
        buffer[1].copy_(source)
        buffer[2].add_(source)
    copy, add = eager.kernels
    assert (copy.read, copy.written) == (1.0, 1.0), copy
    assert (add.read, add.written) == (2.0, 1.0), add


def test_a_kernel_reading_one_row_of_a_stacked_buffer_reads_one_row():
    """Phase 1 of Block AttnRes writes [S, tokens, h]; a fused kernel (a norm) and an extern
    call (a GEMM, as phase 2 is) each reading one of its rows read one unit, not S."""
    from t2train.bench import byte_account

    def norm_and_gemm_of_a_row(stacked, weight):
        rows = stacked * 2  # a buffer of 4 rows, returned whole so that it is written
        row = rows[1]
        normed = row * torch.rsqrt(row.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return rows, normed.to(row.dtype), rows[2] @ weight

    recorded: list = []
    shape = (4, byte_account.TOKENS, byte_account.HIDDEN)
    stacked = torch.randn(shape, dtype=torch.bfloat16)
    weight = torch.randn(byte_account.HIDDEN, byte_account.HIDDEN, dtype=torch.bfloat16)
    backend = byte_account._accounting_backend(recorded)
    torch.compile(norm_and_gemm_of_a_row, backend=backend)(stacked, weight)
    readers = [k for k in recorded if k.written and k.read < 4]
    assert sorted((k.kind == "ExternKernel", k.read) for k in readers) == [
        (False, 1.0),
        (True, 1.0),
    ], recorded
