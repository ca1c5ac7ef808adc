"""The mutation catalog still applies to the source: every edit's text occurs exactly once
in its file and the edited file compiles (so ``python -m tests.mutations`` can run)."""

import pytest

from mutations.catalog import MUTATIONS, module_of


def test_names_are_unique():
    assert len({m.name for m in MUTATIONS}) == len(MUTATIONS)


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_mutation_applies_and_compiles(mutation):
    for path, text in mutation.mutated_sources().items():
        compile(text, path, "exec")
        assert module_of(path).startswith("t2train.")
