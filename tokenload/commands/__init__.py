"""The `tokenload` subcommands, one module each: `HELP`, `configure(parser)`, `run(args) -> int`.

The top of the house: each command wires the packages below it together and
turns their results into text, files and exit codes.
"""
