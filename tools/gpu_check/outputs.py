"""GPU check (--stack), outputs: what a GPU run leaves for people and other tools.

One run of ``stack.outputs`` (targets.yaml) trains here in bf16 with TensorBoard on and
diagnostics, then:

* TensorBoard: its event files, read back with TensorBoard's own reader, hold every tag of
  ``tags`` (and of ``gpu_tags`` on a GPU: MFU, CUDA memory) with finite values, and the
  diagnostics' picture;
* export: its last checkpoint exported to a transformers folder (``t2train export hf``);
  transformers' greedy ``generate`` from that folder gives the same text as ``t2train
  generate`` on the checkpoint, both on this device in the precision the checkpoint stores
  (bf16: were two logits nearly tied, the two attention implementations could order them
  differently; the report then gives the first character that differs).
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

from tools.gpu_check.correctness import REPO, child_env
from tools.gpu_check.plan import Plan
from tools.gpu_check.runs import run_spec, train_run


def tensorboard_item(run_dir: Path, expected: list[str]) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    tags = events.Tags()
    missing = sorted(set(expected) - set(tags["scalars"]))
    not_finite = sorted(
        tag
        for tag in tags["scalars"]
        if not all(math.isfinite(e.value) for e in events.Scalars(tag))
    )
    ok = not missing and not not_finite and tags["images"]
    return {
        "check": "tensorboard",
        "status": "pass" if ok else "fail",
        "scalars": len(tags["scalars"]),
        "images": sorted(tags["images"]),
        "expected": expected,
        "missing": missing,
        "not_finite": not_finite,
    }


def _cli(*args: str) -> str:
    """``t2train ARGS`` in a child process (the check's bench layer does not import the
    export layer: it runs what a user runs); its standard output."""
    proc = subprocess.run(
        [sys.executable, "-m", "t2train.cli", *args],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"t2train {' '.join(args[:2])} failed ({proc.returncode}): "
            f"{proc.stderr.strip()[-1000:]}"
        )
    return proc.stdout


def export_item(checkpoint: Path, out: Path, prompt: str, max_new_tokens: int) -> dict:
    """``t2train export hf``, then transformers' greedy generation from the folder against
    ``t2train generate``'s on the checkpoint, both on this device in the stored precision."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    started = time.monotonic()
    _cli("export", "hf", str(checkpoint), str(out))
    exported = time.monotonic() - started
    remote_code = (out / "modeling_t2train.py").exists()
    tokenizer = AutoTokenizer.from_pretrained(out)
    hf = (
        AutoModelForCausalLM.from_pretrained(out, trust_remote_code=remote_code, dtype="auto")
        .to(device)  # type: ignore[arg-type]  # transformers' stubs type `to` as unbound
        .eval()
    )
    ids = tokenizer(prompt).input_ids
    # Within the context: beyond it `t2train generate` slides its window, transformers does not.
    max_new_tokens = min(max_new_tokens, hf.config.max_position_embeddings - len(ids))
    with torch.no_grad():  # both stop after the end-of-text token
        generated = hf.generate(
            torch.tensor([ids], device=device), do_sample=False, max_new_tokens=max_new_tokens
        )
    theirs = prompt + tokenizer.decode(
        generated[0, len(ids) :], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    ours = _cli(
        "generate",
        str(checkpoint),
        "--prompt",
        prompt,
        "--max-new-tokens",
        str(max_new_tokens),
        "--device",
        device,
    ).removesuffix("\n")
    first_difference = next(
        (i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
        None if len(ours) == len(theirs) else min(len(ours), len(theirs)),
    )
    return {
        "check": "export",
        "status": "pass" if ours == theirs else "fail",
        "architecture": hf.config.architectures[0],
        "export_s": exported,
        "device": device,
        "dtype": str(hf.dtype).removeprefix("torch."),
        "new_tokens": max_new_tokens,
        "t2train_generate": ours,
        "transformers_generate": theirs,
        "first_difference": first_difference,
    }


def run(section, plan: Plan) -> None:
    settings = plan.settings.stack["outputs"]
    preset, overrides = plan.stack_run("outputs")
    variant = settings["variant"]
    section.data.update(variant=variant, overrides=overrides, steps=settings["steps"])
    started = time.monotonic()
    result = train_run(
        run_spec(
            variant,
            preset,
            variant,
            [
                f"data.path={plan.data}",
                *overrides,
                f"train.steps={settings['steps']}",
                "log.tensorboard=true",
                "checkpoint.resume=none",
                f"log.run_dir={section.scratch / 'run'}",
            ],
        )
    )
    section.data.update(train_s=time.monotonic() - started, losses=result["losses"])
    run_dir = Path(result["run_dir"])
    expected = settings["tags"] + (settings["gpu_tags"] if result["device"] == "cuda" else [])
    for check, make in (
        ("tensorboard", lambda: tensorboard_item(run_dir, expected)),
        (
            "export",
            lambda: export_item(
                run_dir / "checkpoints",
                section.scratch / "hf",
                settings["prompt"],
                settings["max_new_tokens"],
            ),
        ),
    ):
        started = time.monotonic()
        try:
            item = make()
        except Exception as err:  # reported; the other check still runs
            item = dict(section.error(err), check=check)
        section.add(dict(item, seconds=time.monotonic() - started))
