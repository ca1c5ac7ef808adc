"""Float8 GEMMs at TP=2 (run on 2 ranks), with and without sequence parallelism.

The same weights (same seed) build a Megatron model and one converted with every cast off
(torchao's matmul then multiplies in high precision): equal losses and gradients show the
converted linears communicate as Megatron's do. A third copy runs emulated tensorwise float8.
"""

from __future__ import annotations

from dataclasses import replace

from common import finish, fixed_batch, parse_args, use_layout, write_result
from torchao.float8 import CastConfig, Float8LinearConfig, ScalingType

from t2train.config.loader import load_config
from t2train.model.build import build_model_chunks, transformer_config
from t2train.nn.float8 import convert_to_float8, recipe_config
from t2train.parallel.init import init_distributed, set_seed

VOCAB = 256
OFF = CastConfig(scaling_type=ScalingType.DISABLED)


def run(overrides: list[str], float8: Float8LinearConfig | None) -> tuple[float, dict, int]:
    topology = use_layout(2, 1, 1)
    set_seed(7, topology)
    config = load_config("tiny", overrides=["data.path=unused", "model.num_layers=2", *overrides])
    [model] = build_model_chunks(config, transformer_config(config), VOCAB)
    converted = [] if float8 is None else convert_to_float8(model, float8)
    tokens, labels, positions = fixed_batch(VOCAB, 2, config.model.seq_length)
    loss = model(tokens, positions, None, labels=labels).mean()
    loss.backward()
    return float(loss), {n: p.grad for n, p in model.named_parameters()}, len(converted)


def main() -> None:
    args = parse_args()
    init_distributed()
    result = {}
    for layout, overrides in (
        ("tp2", ["parallel.tensor=2"]),
        ("tp2_sp", ["parallel.tensor=2", "parallel.sequence_parallel=true"]),
    ):
        loss, grads, _ = run(overrides, None)
        plain_loss, plain_grads, converted = run(
            overrides,
            Float8LinearConfig(
                cast_config_input=OFF, cast_config_weight=OFF, cast_config_grad_output=OFF
            ),
        )
        float8_loss, _, _ = run(overrides, replace(recipe_config("tensorwise"), emulate=True))
        result[layout] = {
            "plain_loss_diff": abs(plain_loss - loss),
            "plain_grad_diff": max(
                float((plain_grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12))
                for n, g in grads.items()
            ),
            "float8_loss_rel": abs(float8_loss - loss) / loss,
            "converted": converted,
        }
    write_result(args.out, result)


if __name__ == "__main__":
    main()
    finish()
