"""``python -m localspec`` runs the command line, as the ``localspec`` command does."""

from localspec.resident.client import main

main()
