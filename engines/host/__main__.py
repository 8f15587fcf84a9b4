"""``python -m engines.host``: serve one DP group (``engines/host/process.py``)."""

from engines.host.lifeline import exit_with_parent

exit_with_parent()  # before the imports that take seconds: a run that dies meanwhile takes its host with it

from engines.host.process import main

main()
