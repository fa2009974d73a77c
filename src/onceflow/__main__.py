"""``python -m onceflow`` is the ``onceflow`` command."""

from onceflow.cli.main import main

main()
