"""``python -m experiments.mnli``."""

from experiments.mnli.experiment import main

raise SystemExit(main())
