"""``python -m tokenward.proxy ...`` is the ``tokenward`` command."""

from tokenward.proxy.cli import main

main()
