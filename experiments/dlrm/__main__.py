"""``python -m experiments.dlrm``."""

from experiments.dlrm.experiment import main

raise SystemExit(main())
