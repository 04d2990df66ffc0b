"""The ``loca`` command: ``main`` (parser, logging, signals), ``args`` (flags and configuration
precedence) and one ``<name>_command`` module per subcommand."""
