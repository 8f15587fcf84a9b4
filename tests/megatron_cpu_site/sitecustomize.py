"""With this folder on PYTHONPATH, every Python process runs Megatron-Core on CPU (tests only).

For processes the product starts itself (engine hosts under a test's flow). Lazy: this only
registers an import hook; torch and Megatron are touched when, and if, the process imports
Megatron, so the Prefect server and other processes pay nothing.
"""

import importlib.util
import os
import sys

if "megatron_cpu" not in sys.modules:  # one shim per process, whichever way it was reached
    _spec = importlib.util.spec_from_file_location(
        "megatron_cpu", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron_cpu.py")
    )
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["megatron_cpu"] = _module
    _spec.loader.exec_module(_module)
sys.modules["megatron_cpu"].install()
