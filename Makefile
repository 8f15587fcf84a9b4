# Two commands a new user needs: `make demo` and `make test`. Each installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export PREFECT_SERVER_ANALYTICS_ENABLED = false
export HF_HUB_OFFLINE = 1

.PHONY: install demo test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

# A real RLHF run on the embedded defaults: local Prefect, ./yattflow-data as object storage,
# tiny models built and SFT'd locally. Prints held-out accuracy before and after RL.
demo: install
	$(VENV)/bin/yattflow demo -c deployments/demo.yaml

test: install
	$(PY) -m pytest -q -rs

clean:
	rm -rf yattflow-data
