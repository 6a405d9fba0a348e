"""``python -m higgs_talker``: the ``higgs-talker`` command."""

from .cli import command

command()
