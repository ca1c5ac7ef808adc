"""The console: rank 0 prints, other ranks only with ``log.all_ranks``."""

import logging
import warnings

from t2train.monitor.metrics import Monitor, quiet_other_ranks


def test_only_a_monitor_with_a_run_directory_prints_by_default(tmp_path, capsys):
    Monitor(tmp_path, total_steps=10, tensorboard=False).print("from rank 0")
    Monitor(None, total_steps=10).print("from rank 1")
    assert capsys.readouterr().out == "from rank 0\n"


def test_all_ranks_prefixes_each_line_with_the_rank(capsys):
    monitor = Monitor(None, total_steps=10, console=True, prefix="[rank 3] ")
    monitor.progress(step=5, loss=2.0, lr=1e-3, tokens_per_sec=100.0, steps_done_here=5)
    assert capsys.readouterr().out.startswith("[rank 3] step      5/10 | loss  2.0000")


def test_other_ranks_drop_python_warnings_and_library_logs(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            quiet_other_ranks(all_ranks=False)
            warnings.warn("from a library", stacklevel=1)
            assert logging.getLogger("megatron").isEnabledFor(logging.WARNING) is False
        finally:
            logging.disable(logging.NOTSET)
    assert caught == []


def test_all_ranks_keeps_warnings(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_other_ranks(all_ranks=True)
        warnings.warn("from a library", stacklevel=1)
    assert len(caught) == 1
