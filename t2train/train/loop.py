"""``train(config)``: a training run from start to finish, the entry every caller uses.

It quiets the other ranks' library warnings, opens what guards the whole run (the stop
guard, the hang watchdog, the rank-failure channel) and runs the ``Trainer``
(``trainer.py``): inputs checked, ranks set up, resume, train, evaluate, checkpoint, log.
"""

from __future__ import annotations

from t2train.config.schema import Config
from t2train.errors import RankFailure
from t2train.monitor.metrics import quiet_other_ranks
from t2train.processes import die_with_launcher, forked_children_die_with_this_process
from t2train.signals import parse_signals
from t2train.train.summary import RunSummary


def train(config: Config) -> RunSummary:
    """Run to ``train.steps``, or stop early with a checkpoint (``RunSummary.stopped``)."""
    config = config.with_absolute_paths()  # as the run records them: usable from anywhere
    die_with_launcher()
    forked_children_die_with_this_process()
    quiet_other_ranks(config.log.all_ranks)
    # Deferred until the other ranks are quiet: the trainer imports the data and export
    # libraries (mosaicml-streaming, torchvision, transformers, matplotlib), whose
    # import-time warnings would otherwise print once per rank.
    from t2train.train.preemption import StopGuard
    from t2train.train.rank_failures import RankFailures
    from t2train.train.trainer import Trainer
    from t2train.train.watchdog import Watchdog

    with (
        StopGuard(
            parse_signals(config.train.exit_signals), config.train.exit_duration_mins
        ) as guard,
        Watchdog(config.parallel.collective_timeout_mins) as watchdog,
        RankFailures() as failures,
    ):
        try:
            with Trainer(config, guard, watchdog) as trainer:
                return trainer.run()
        except RankFailure as failure:
            failures.end_all(str(failure))
            raise
