"""Forward of an old command: ``python -m experiments.codebert.bench``.

The command is now ``python -m benchmarks.codebert_step``.
Run as a command, this module prints one line on stderr naming it, then runs it with the
same arguments (:func:`experiments.moved.forward`). It goes in a later release.
"""

if __name__ == "__main__":
    from experiments.moved import forward

    raise SystemExit(forward("experiments.codebert.bench", "benchmarks.codebert_step"))
