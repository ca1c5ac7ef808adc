"""``t2train train`` whose save of one step stops just before it is published.

Usage: ``hang_before_publish.py STEP MARKER -- <t2train train arguments>``. Every shard of
``step_STEP`` is written to its staging directory, then the process writes ``MARKER`` and
sleeps instead of publishing, so a test can SIGKILL it at exactly that point (the last moment
a crash can leave a complete-looking but unpublished checkpoint), however fast the machine.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from t2train import cli
from t2train.checkpoint import store


def main() -> int:
    step, marker, separator, *train_args = sys.argv[1:]
    assert separator == "--", "usage: hang_before_publish.py STEP MARKER -- ARGS"
    hang_at = store.step_dir_name(int(step))
    publish = store.publish_checkpoint

    def publish_unless_hanging(root, staging, final, on_published):
        if final.name == hang_at:
            Path(marker).write_text(str(staging))
            while True:
                time.sleep(60)
        publish(root, staging, final, on_published)

    store.publish_checkpoint = publish_unless_hanging
    return cli.main(["train", *train_args])


if __name__ == "__main__":
    sys.exit(main())
