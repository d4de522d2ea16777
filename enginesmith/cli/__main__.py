"""`python -m enginesmith.cli`: the same as the `enginesmith` command."""

from enginesmith.cli import run

run()
