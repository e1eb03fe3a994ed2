"""`python -m pipeline.cli`: the same as the `dgpipe` console script."""

from pipeline.cli import main

main()
