"""CLI subcommands. Each module defines ``COMMANDS``, a tuple of click commands that
``localspec.cli`` adds to the root group."""
