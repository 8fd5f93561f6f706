"""Forward of an old command: ``python -m loaders.bench``.

The command is now ``python -m benchmarks.loader``. Run as a command, this module runs it
with the same arguments (same output, same JSON keys), then prints one line on stderr
naming it; bad input (exit status 2) is the new command's one error line alone, which
names the new command itself. It goes in a later release. loaders is a library and never
imports the benchmarks: the new module is run by name, from the repository root, only
when this one runs as a command.
"""

if __name__ == "__main__":
    import importlib.util
    import runpy
    import sys

    if importlib.util.find_spec("benchmarks") is None:
        sys.exit(
            "loaders.bench: cannot find the benchmarks package; run `python -m benchmarks.loader` "
            "from the repository root"
        )
    try:
        runpy.run_module("benchmarks.loader", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code
    if code != 2:  # an error line stays one line: it names `python -m benchmarks.loader`
        print(
            "note: `python -m loaders.bench` has moved to `python -m benchmarks.loader`; "
            "the old name goes in a later release",
            file=sys.stderr,
            flush=True,
        )
    sys.exit(code)
