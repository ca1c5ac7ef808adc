"""Generated English-ish text for the data tests (no network, no fixtures)."""

import random

WORDS = (
    "the king queen lord lady castle night day sword crown love war peace heart "
    "speak hear see go come stand fall rise good noble false true old young and but "
    "or of to in with by upon thy thou thee my his her our their is was shall will "
    "not never ever now then here there fair foul sweet bitter gentle cruel"
).split()


def english_ish(seed: int, paragraphs: int) -> str:
    """Deterministic sentences of common words, paragraphs separated by blank lines."""
    rng = random.Random(seed)
    out = []
    for _ in range(paragraphs):
        sentences = [
            " ".join(rng.choices(WORDS, k=rng.randint(4, 12))).capitalize() + "."
            for _ in range(rng.randint(2, 6))
        ]
        out.append("\n".join(sentences))
    return "\n\n".join(out) + "\n"
