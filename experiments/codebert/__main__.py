"""``python -m experiments.codebert``."""

from experiments.codebert.experiment import main

raise SystemExit(main())
