"""`python -m enginesmith.cli`: the same as the `enginesmith` command."""

from enginesmith.cli import run

if __name__ == "__main__":  # not when a spawned process (the front door's workers) imports the main module
    run()
