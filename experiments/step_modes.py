"""Forward of an old command: ``python -m experiments.step_modes``.

The command is now ``python -m benchmarks.step_modes``.
Run as a command, this module prints one line on stderr naming it, then runs it with the
same arguments (:func:`experiments.moved.forward`). It goes in a later release.
"""

if __name__ == "__main__":
    from experiments.moved import forward

    raise SystemExit(forward("experiments.step_modes", "benchmarks.step_modes"))
