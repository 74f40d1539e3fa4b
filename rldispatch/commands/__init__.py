"""The ``rldispatch`` subcommands; each module has ``main(argv) -> exit code`` and a thin wrapper in ``scripts/``."""
