"""``python -m t2train.launch ...`` is ``t2train launch ...``."""

import sys

from t2train.cli import main

sys.exit(main(["launch", *sys.argv[1:]]))
