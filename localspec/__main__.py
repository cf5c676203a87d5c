"""``python -m localspec`` runs the command line, as the ``localspec`` command does."""

from localspec.cli import main

main()
