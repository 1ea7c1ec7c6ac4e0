"""Subcommands of the ``microbatch`` command line; see microbatch.cli.

May import every layer: each command is a thin argparse shell over the public API.
"""
