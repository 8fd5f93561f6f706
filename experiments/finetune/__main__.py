"""``python -m experiments.finetune``."""

from experiments.finetune.experiment import main

raise SystemExit(main())
