"""Load exported model folders with whatever transformers this process imports, and record
what each computes: ``python load_exports.py ROOT OUT``.

Every folder under ROOT is one export. For each: the logits of three prompts (9, 5 and 2
tokens) padded on the left, run whole without a cache, and the greedy continuation of 6
tokens through ``generate`` with its cache. Written to OUT (``torch.save``) with the version
of transformers that made them. Imports only torch and transformers, as a user's process
would: an export must not need t2train.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

PROMPT_LENGTHS = (9, 5, 2)
NEW_TOKENS = 6


def padded_prompts(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of tokens 1.. (0 is the padding and the end of text), padded left."""
    generator = torch.Generator().manual_seed(3)
    longest = max(PROMPT_LENGTHS)
    ids = torch.zeros(len(PROMPT_LENGTHS), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(PROMPT_LENGTHS):
        ids[row, longest - length :] = torch.randint(1, vocab, (length,), generator=generator)
        mask[row, longest - length :] = 1
    return ids, mask


@torch.no_grad()
def run(folder: Path) -> dict:
    model = AutoModelForCausalLM.from_pretrained(
        folder, trust_remote_code=True, dtype=torch.float32
    ).eval()
    ids, mask = padded_prompts(model.config.vocab_size)
    generated = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
    )
    return {
        "logits": model(input_ids=ids, attention_mask=mask, use_cache=False).logits,
        "generated": generated[:, ids.shape[1] :],
    }


def main() -> None:
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    results = {folder.name: run(folder) for folder in sorted(root.iterdir()) if folder.is_dir()}
    torch.save({"transformers": transformers.__version__, "models": results}, out)


if __name__ == "__main__":
    main()
