"""One module per ``mplug`` command: ``register(subparsers)`` adds its parser, ``run(args)`` runs it."""
