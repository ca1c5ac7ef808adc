"""The mosaicml-streaming patches: they still name what streaming has, and they are scoped.

That each is still needed is shown where the fault is: ``tests/data/test_data_loader.py``
(descriptors left open without the probe patch) and ``tests/data/test_data_shm.py`` (two
leaders collide without the lock; a reader that searches for itself, after the host's
segments changed, takes a prefix its leader never registered).
"""

import importlib
import inspect

import pytest

from t2train.compat import streaming_prefix

PATCHES = {
    "SharedMemory": streaming_prefix.prefix_probes_closed_when_dropped,
    "get_shm_prefix": streaming_prefix.prefix_chosen_by_the_leader,
}


@pytest.mark.parametrize("module,name", streaming_prefix.PATCHED)
def test_each_patched_name_still_exists_with_the_arguments_used(module, name):
    target = getattr(importlib.import_module(module), name)
    parameters = list(inspect.signature(target).parameters)
    expected = {
        "SharedMemory": ["name", "create", "size", "auto_cleanup"],
        "get_shm_prefix": ["streams_local", "streams_remote", "world"],
    }[name]
    assert parameters[: len(expected)] == expected, (
        f"{module}.{name}{parameters}: revisit the patch"
    )


@pytest.mark.parametrize("name", sorted(streaming_prefix.PRIVATE))
def test_each_helper_of_the_prefix_choice_still_exists_with_the_arguments_used(name):
    prefix = importlib.import_module("streaming.base.shared.prefix")
    parameters = list(inspect.signature(getattr(prefix, name)).parameters)
    expected = streaming_prefix.PRIVATE[name]
    assert parameters[: len(expected)] == expected, f"prefix.{name}{parameters}: revisit"


def test_the_prefix_search_still_attaches_through_the_patched_names():
    """The probes go through ``prefix.SharedMemory`` and the dataset calls its module's
    ``get_shm_prefix``: a patch of a name streaming no longer calls would do nothing."""
    prefix = importlib.import_module("streaming.base.shared.prefix")
    assert "SharedMemory(" in inspect.getsource(prefix.get_shm_prefix)
    dataset = importlib.import_module("streaming.base.dataset")
    assert "get_shm_prefix(" in inspect.getsource(dataset.StreamingDataset.__init__)


@pytest.mark.parametrize("module,name", streaming_prefix.PATCHED)
def test_a_patch_holds_only_inside_its_block_and_is_undone_by_an_error(module, name):
    owner = importlib.import_module(module)
    original = getattr(owner, name)
    with pytest.raises(KeyError), PATCHES[name]():
        assert getattr(owner, name) is not original
        raise KeyError("made the dataset fail")
    assert getattr(owner, name) is original


def test_streaming_still_reads_a_loaded_position_back_through_the_overridden_method():
    """``ResumeFromObject`` answers ``_resume``: it must still exist with these arguments, and
    be what a pass's start and ``state_dict`` call to learn the position (else the position
    would again come from the shared segment another process can remove)."""
    from streaming import StreamingDataset

    from t2train.compat.streaming_resume import RESUME_READER

    name, arguments = RESUME_READER
    reader = getattr(StreamingDataset, name)
    assert list(inspect.signature(reader).parameters)[1:] == arguments
    assert "_get_path(self._shm_prefix_int, RESUME)" in inspect.getsource(reader)
    for caller in (StreamingDataset._resume_incr_epoch, StreamingDataset.state_dict):
        assert f"self.{name}(" in inspect.getsource(caller), caller.__name__
    assert list(inspect.signature(StreamingDataset.load_state_dict).parameters) == ["self", "obj"]
