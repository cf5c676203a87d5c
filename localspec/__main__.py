"""``python -m localspec`` runs the command line."""

from localspec.cli import main

main()
