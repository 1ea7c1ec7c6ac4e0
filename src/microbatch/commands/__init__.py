"""Subcommands of the ``microbatch`` command line; see microbatch.cli."""
