"""CLI subcommands, one module each (see `decoderlm.cli`)."""
