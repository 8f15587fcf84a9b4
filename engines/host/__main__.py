"""``python -m engines.host``: serve one DP group (``engines/host/process.py``)."""

from engines.host.process import main

main()
