"""Forward of an old command: ``python -m experiments.dlrm.prep_bench``.

The command is now ``python -m benchmarks.dlrm_prep``.
Run as a command, this module prints one line on stderr naming it, then runs it with the
same arguments (:func:`experiments.moved.forward`). It goes in a later release.
"""

if __name__ == "__main__":
    from experiments.moved import forward

    raise SystemExit(forward("experiments.dlrm.prep_bench", "benchmarks.dlrm_prep"))
