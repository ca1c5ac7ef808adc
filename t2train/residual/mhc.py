"""`mhc`: Manifold-Constrained Hyper-Connections (Xie et al., DeepSeek-AI, arXiv 2512.24880).

The stream is n copies of the hidden state as in `hc` (``model.mhc.expansion_rate``, default
4): per token x_l in R^{n x h}, stored as [n, s, b, h]. Every sublayer F (attention, the MLP
and, with the local mixer on, the ShortSWA sublayer) has its own mappings, predicted from the
whole stream flattened, x~ = vec(x_l) in R^{nh} (the paper's parameterization):

    x~'    = x~ / sqrt(mean(x~^2) + eps)                    RMSNorm without a learned weight
    H~pre  = a_pre  (x~' phi_pre)       + b_pre             phi_pre, phi_post in R^{nh x n}
    H~post = a_post (x~' phi_post)      + b_post
    H~res  = a_res  mat(x~' phi_res)    + b_res             phi_res in R^{nh x n^2}
    H_pre = sigmoid(H~pre),  H_post = 2 sigmoid(H~post),  H_res = SK(H~res)

    x_{l+1} = H_res x_l + H_post^T F(Norm(H_pre x_l))        (F applies its pre-norm)

i.e. the sublayer reads sum_j H_pre[j] x_j and stream i becomes
sum_j H_res[i, j] x_j + H_post[i] F(...). SK is Sinkhorn-Knopp as the paper's Eq. 9 writes
it, with t_max = ``model.mhc.sinkhorn_iterations`` (default 20): M(0) = exp(H~res),
M(t) = T_r(T_c(M(t-1))) (T_c divides each column by its sum, then T_r each row),
H_res = M(t_max). Its rows sum to 1 exactly, so every new stream is a convex combination of
the old ones (the forward gain is exact, and equal streams stay equal); its columns sum to 1
up to the iterations' convergence: within 1e-6 for logits spread over about 2 (tested), more
slowly for wider spreads (noted by mHC-lite, arXiv 2601.05732), so the streams' mean, which
the final norm reads, is kept to that accuracy. exp is taken after subtracting the matrix's
largest logit, a common factor every normalisation cancels.

Choices the paper leaves open:

- phi is initialised with the model's init method (normal, std ``model.init_method_std``);
  the gates a_pre = a_post = a_res start at ``model.mhc.gate_init`` (the paper's 0.01);
- the static biases start so that equal streams give `standard`: b_pre = logit(1/n)
  (H_pre sums to 1, the read is the streams' mean; n = 1: 0, the gate starts at 1/2, since a
  sigmoid cannot reach 1), b_post = 0 (H_post = 1: every stream gets the whole output),
  b_res = 0 (H_res uniform, which maps equal streams to themselves);
- the embedding enters as n copies and the final norm reads the mean of the streams (the
  paper does not say);
- hidden dropout (``model.dropout``) is the layer's, applied once to F's output before the
  write, as for every design;
- mappings, Sinkhorn and the stream update run in at least fp32; the state keeps the
  activation dtype.

What holds at initialisation: the streams are n copies of the embedding and H_res (doubly
stochastic) maps equal streams to themselves exactly, so they stay equal; the read is
(sum_j H_pre[j]) h and each stream gains H_post[i] F, where H_pre and H_post differ from 1/n
and 1 by O(a |x~' phi|) (a = gate_init; about a * 0.02 sqrt(nh) per logit with the default
init). With ``model.mhc.gate_init=0`` the model computes `standard`'s logits (up to b_pre's
rounding in the parameter dtype; tested), and the gates still get gradients. With n = 1,
H_res = 1 and the design is a gated `standard` residual:
x' = x + 2 sigmoid(H~post) F(Norm(sigmoid(H~pre) x)).

Memory (``model.mhc.recompute_streams``, off by default): as the paper recomputes its
mappings' intermediates in the backward (Sec. 4.3), the n streams between a layer's sublayers
can be dropped after the forward and rebuilt by their write when the backward needs them
(``_DroppedStates``: saved-tensor hooks around this design's own reads and writes); only the
stream entering each layer is kept. Values are unchanged (the same kernel on the same
inputs); it saves one n x [s, b, h] state per layer, two with the local mixer.

The read (H_pre) and the write (Sinkhorn, H_res and H_post) are one fused Triton pass each
over the stream on CUDA (``kernels/stream_mix.py``, chosen by ``T2_KERNELS``); the
projection stays a PyTorch matmul. Hops carry n units of [s, b, h] (unit ids None); all is
per token, so sequence parallelism applies; parameters are replicated across tensor ranks.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

from t2train.errors import require
from t2train.kernels import dispatch
from t2train.nn.precision import at_least_fp32
from t2train.residual import sublayer_names
from t2train.residual.base import ResidualDesign, mark_replicated
from t2train.residual.hc import (
    StreamCopies,
    StreamMixResidual,
    diagnostics_for,
    record_weights,
    sublayers,
)


@dataclass
class MHCOptions:
    """``model.mhc``: n streams; per sublayer a sigmoid read, a sigmoid write and a
    doubly-stochastic (Sinkhorn-Knopp) stream mixing, predicted from the whole stream."""

    expansion_rate: int = 4  # n: copies of the hidden state in the stream
    sinkhorn_iterations: int = 20  # t_max: column-then-row normalisations of exp(H~res)
    gate_init: float = 0.01  # a_pre, a_post, a_res at initialisation
    eps: float = 1e-6  # of the RMSNorm over the flattened stream
    # Keep the n streams for the backward only where a layer starts; the states between its
    # sublayers are recomputed from there in the backward (one stream write per dropped
    # state: mHC's recomputation, Sec. 4.3, at the granularity of a layer). False, the
    # default: keep every state (no recomputation).
    recompute_streams: bool = False
    # A resumed run may change these (initial values, recomputation).
    not_architecture: ClassVar[tuple] = ("gate_init", "recompute_streams")

    def validate(self, prefix: str) -> None:
        require(
            self.expansion_rate >= 1,
            f"{prefix}.expansion_rate",
            self.expansion_rate,
            "must be >= 1 (the number of hidden-state copies in the stream)",
        )
        require(
            self.sinkhorn_iterations >= 1,
            f"{prefix}.sinkhorn_iterations",
            self.sinkhorn_iterations,
            "must be >= 1 (column-then-row normalisations that make H_res doubly stochastic)",
        )
        require(
            self.gate_init >= 0,
            f"{prefix}.gate_init",
            self.gate_init,
            "must be >= 0 (0 starts exactly as standard)",
        )
        require(self.eps > 0, f"{prefix}.eps", self.eps, "must be > 0")
        require(
            isinstance(self.recompute_streams, bool),
            f"{prefix}.recompute_streams",
            self.recompute_streams,
            "must be true or false",
        )


class _NormedProjection(torch.autograd.Function):
    """RMSNorm(vec x) phi^T in fp32, saving the stream as it came (no fp32 copy of the n
    streams stays alive for the backward: the read and write kernels save the same tensor).

    Each stream is a contiguous [tokens, h] slab, so the projection is one batched matmul
    over the streams (no permuted copy of the stream), summed over them; the RMS divides the
    result (the norm is weight-free, so RMSNorm(x~) phi = (x~ phi) rsqrt(mean(x~^2) + eps)).
    Backward, with g the incoming gradient, r the rsqrt and y = x~ phi^T:
    dx~ = (g r) phi - x~ r^3 sum_k(g_k y_k) / (n h),  dphi = (g r)^T x~."""

    @staticmethod
    def forward(ctx, state: Tensor, projection: Tensor, eps: float) -> Tensor:
        n, h = state.shape[0], state.shape[-1]
        with torch.autocast(state.device.type, enabled=False):
            x = at_least_fp32(state).reshape(n, -1, h)  # a temporary, freed after the forward
            phi = at_least_fp32(projection).view(-1, n, h).permute(1, 2, 0)  # [n, h, outputs]
            inv_rms = torch.rsqrt(x.pow(2).sum((0, 2)) / (n * h) + eps)  # [tokens]
            y = torch.bmm(x, phi).sum(0)  # [tokens, outputs]
        ctx.save_for_backward(state, projection, y, inv_rms)
        return (y * inv_rms[:, None]).view(*state.shape[1:-1], -1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        state, projection, y, inv_rms = ctx.saved_tensors
        n, h = state.shape[0], state.shape[-1]
        with torch.autocast(state.device.type, enabled=False):
            x = at_least_fp32(state).reshape(n, -1, h)
            phi = at_least_fp32(projection).view(-1, n, h).transpose(0, 1)  # [n, outputs, h]
            g = grad.reshape(-1, grad.shape[-1]).to(y.dtype)
            g_y = g * inv_rms[:, None]
            coef = -(g * y).sum(-1) * inv_rms.pow(3) / (n * h)  # [tokens]
            d_state = torch.baddbmm(x * coef[:, None], g_y.expand(n, *g_y.shape), phi)
            d_phi = torch.bmm(g_y.T.expand(n, *g_y.T.shape), x)  # [n, outputs, h]
        return (
            d_state.view(state.shape).to(state.dtype),
            d_phi.transpose(0, 1).reshape(projection.shape).to(projection.dtype),
            None,
        )


def normed_projection(state: Tensor, projection: Tensor, eps: float) -> Tensor:
    """RMSNorm(vec x) phi^T [s, b, outputs] in fp32: state [n, s, b, h], projection
    [outputs, n h] (stream after stream), the RMSNorm weight-free over all n h."""
    return _NormedProjection.apply(state, projection, eps)


def sinkhorn(logits: Tensor, iterations: int) -> Tensor:
    """Sinkhorn-Knopp on [..., n, n] logits (Eq. 9): exp, then ``iterations`` times columns,
    then rows, divided by their sums."""
    m = torch.exp(logits - logits.amax((-2, -1), keepdim=True))
    for _ in range(iterations):
        m = m / m.sum(-2, keepdim=True)
        m = m / m.sum(-1, keepdim=True)
    return m


def stream_read(state: Tensor, pre_logit: Tensor) -> Tensor:
    """The sublayer's input sum_j sigmoid(pre_logit[..., j]) x_j.

    state [n, s, b, h]; pre_logit [s, b, n]. Computed in (at least) fp32, returned in the
    state's dtype.
    """
    x = at_least_fp32(state)
    weights = torch.sigmoid(pre_logit.to(x.dtype))
    return torch.einsum("sbj,jsbh->sbh", weights, x).to(state.dtype)


def stream_write(
    state: Tensor, out: Tensor, post_logit: Tensor, res_logit: Tensor, iterations: int
) -> Tensor:
    """Stream i <- sum_j SK(res_logit)[i, j] x_j + 2 sigmoid(post_logit[i]) out.

    state [n, s, b, h]; out [s, b, h]; post_logit [s, b, n]; res_logit [s, b, n, n].
    """
    x = at_least_fp32(state)
    mixing = sinkhorn(res_logit.to(x.dtype), iterations)
    post = 2 * torch.sigmoid(post_logit.to(x.dtype))
    y = torch.einsum("sbij,jsbh->isbh", mixing, x) + torch.einsum(
        "sbi,sbh->isbh", post, at_least_fp32(out)
    )
    return y.to(state.dtype)


def read_streams(state: Tensor, pre_logit: Tensor) -> Tensor:
    """``stream_read``, through the fused Triton kernel where ``T2_KERNELS`` routes it."""
    return dispatch.route(STREAM_READ, state, pre_logit)(state, pre_logit)


def write_streams(
    state: Tensor, out: Tensor, post_logit: Tensor, res_logit: Tensor, iterations: int
) -> Tensor:
    """``stream_write``, through the fused Triton kernel where ``T2_KERNELS`` routes it."""
    write = dispatch.route(STREAM_WRITE, state, out, post_logit, res_logit)
    return write(state, out, post_logit, res_logit, iterations)


STREAM_READ = dispatch.Kernel("stream_read", "t2train.kernels.stream_mix:stream_read", stream_read)
STREAM_WRITE = dispatch.Kernel(
    "stream_write", "t2train.kernels.stream_mix:stream_write", stream_write
)


class _Recomputed:
    """A stream state dropped after the forward: rebuilt in the backward by the write that
    made it, from the state before (kept, or itself a ``_Recomputed``), the sublayer's
    output and its mappings' logits (saved for the backward anyway). Rebuilt once; the
    backward nodes that saved the state share it."""

    def __init__(self, before, out: Tensor, post: Tensor, res: Tensor, iterations: int):
        self.inputs = (before, out.detach(), post.detach(), res.detach())
        self.iterations = iterations
        self.value: Optional[Tensor] = None

    def materialise(self) -> Tensor:
        if self.value is None:
            before, out, post, res = self.inputs
            if isinstance(before, _Recomputed):
                before = before.materialise()
            with torch.no_grad():
                self.value = write_streams(before, out, post, res, self.iterations)
        return self.value


class _DroppedStates:
    """``saved_tensors_hooks`` that store a registered state as its ``_Recomputed`` recipe."""

    def __init__(self):
        self.recipes = WeakTensorKeyDictionary()  # state -> _Recomputed

    def pack(self, t: Tensor):
        return self.recipes.get(t, t)

    @staticmethod
    def unpack(saved):
        return saved.materialise() if isinstance(saved, _Recomputed) else saved

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def register(
        self, state: Tensor, before: Tensor, out: Tensor, post: Tensor, res: Tensor, iterations: int
    ) -> None:
        before = self.recipes.get(before, before)  # a chain within the layer: never a tensor
        self.recipes[state] = _Recomputed(before, out, post, res, iterations)


# One registry for every sublayer: a state is registered by the write that makes it and
# saved by the next sublayer's read and write (keys are weak: a state gone is forgotten).
DROPPED_STATES = _DroppedStates()


class ManifoldHyperConnection(StreamMixResidual):
    def __init__(self, config, layer_number: int = 1, position: int = 0):
        super().__init__(config, layer_number, position)
        options = config.t2_model.mhc
        n, h, dtype = options.expansion_rate, config.hidden_size, config.params_dtype
        self.n, self.eps, self.iterations = n, options.eps, options.sinkhorn_iterations
        # with recompute_streams: the states between this layer's sublayers are dropped
        # (the last sublayer's output, the next layer's input, is kept)
        last = position == len(sublayer_names(config.t2_model)) - 1
        self.dropped = DROPPED_STATES if options.recompute_streams else None
        self.drops_its_output = options.recompute_streams and not last
        outputs = n * n + 2 * n  # H~pre, H~post, H~res (row-major)
        self.projection = torch.nn.Parameter(torch.empty(outputs, n * h, dtype=dtype))
        config.init_method(self.projection)
        bias = torch.zeros(outputs, dtype=dtype)
        bias[:n] = -math.log(n - 1) if n > 1 else 0.0  # logit(1/n): H_pre sums to 1
        self.bias = torch.nn.Parameter(bias)
        self.gates = torch.nn.Parameter(torch.full((3,), options.gate_init, dtype=dtype))
        mark_replicated(self, config)

    def logits(self, state: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """H~pre [s, b, n], H~post [s, b, n], H~res [s, b, n, n] from the flattened stream."""
        n = self.n
        raw = normed_projection(state, self.projection, self.eps)
        gates, bias = at_least_fp32(self.gates), at_least_fp32(self.bias)
        pre = gates[0] * raw[..., :n] + bias[:n]
        post = gates[1] * raw[..., n : 2 * n] + bias[n : 2 * n]
        res = (gates[2] * raw[..., 2 * n :] + bias[2 * n :]).unflatten(-1, (n, n))
        return pre, post, res

    def width_connection(self, state: Tensor) -> tuple[Tensor, tuple]:
        with self._saving():
            pre, post, res = self.logits(state)
            record_weights(
                "mhc",
                (self.layer_number, self.position),
                torch.sigmoid(pre),
                2 * torch.sigmoid(post),
                lambda: sinkhorn(res, self.iterations),
            )
            return read_streams(state, pre), (post, res)

    def depth_connection(self, state: Tensor, pending: tuple, out: Tensor) -> Tensor:
        post, res = pending
        with self._saving():
            new = write_streams(state, out, post, res, self.iterations)
        if self.drops_its_output and self.dropped is not None and torch.is_grad_enabled():
            self.dropped.register(new, state, out, post, res, self.iterations)
        return new

    def _saving(self):
        """Where the states this sublayer saves may be recipes (``recompute_streams``)."""
        return self.dropped.hooks() if self.dropped is not None else contextlib.nullcontext()


class ManifoldStreamCopies(StreamCopies):
    section = "mhc"


def extra_parameters(model) -> int:
    """Per sublayer: phi (nh x (n^2 + 2n)), the biases b (n^2 + 2n) and three gates."""
    n, h = model.mhc.expansion_rate, model.hidden_size
    outputs = n * n + 2 * n
    return sublayers(model) * (n * h * outputs + outputs + 3)


def extra_flops_per_token(model) -> int:
    """Per sublayer: the RMS over nh 2nh, the projection 2nh(n^2 + 2n), the read 2nh, the
    mixing 2n^2 h and the write 2nh. The final mean 2nh. (Terms in h only: the O(n^2)
    sigmoids and the Sinkhorn iterations per token are left out.)"""
    n, h = model.mhc.expansion_rate, model.hidden_size
    per_sublayer = 2 * n * h * (n * n + 2 * n) + 2 * n * n * h + 6 * n * h
    return sublayers(model) * per_sublayer + 2 * n * h


DESIGN = ResidualDesign(
    name="mhc",
    stream=ManifoldStreamCopies,
    sublayer=ManifoldHyperConnection,
    reference="Manifold-Constrained Hyper-Connections, Xie et al., DeepSeek-AI, arXiv 2512.24880",
    extra_parameters=extra_parameters,
    extra_flops_per_token=extra_flops_per_token,
    section="mhc",
    options=MHCOptions,
    write_diagnostics=diagnostics_for("mhc"),
)
