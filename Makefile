# `make demo` runs the main job, `make test` the tests; each builds .venv from requirements.txt first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo demo-lora demo-agent bench-agents test test-stress lint mutants bench-batching clean sglang-site

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

test: $(VENV)/.installed lint sglang-site
	$(PY) -m pytest -q --durations=15

# the chaos, recovery, standby and async-loop tests 5 rounds in a row, fault seeds varied, every core
# kept busy beside them (scripts/stress_tests.py); not part of `make test`: run it before a change to
# fleet/, train/ or the engine's runtime/ lands
test-stress: $(VENV)/.installed sglang-site
	$(PY) scripts/stress_tests.py --rounds 5

# SGLang's own code for tests/test_sglang_contract.py (pure Python for its weight-update path, no GPU
# toolchain): a folder on PYTHONPATH of the test's subprocess only. A failed install (no registry)
# leaves no folder, and the contract test skips saying so.
# Another release: install it the same way into DIR and run
#   ROLLFLEET_SGLANG_SITE=DIR pytest tests/test_sglang_contract.py
sglang-site: .sglang-site/.installed
.sglang-site/.installed: requirements-sglang.txt $(VENV)/.installed
	rm -rf .sglang-site
	$(PY) -m pip install -q --no-deps --target .sglang-site -r requirements-sglang.txt || rm -rf .sglang-site
	test ! -d .sglang-site || touch $@

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check rollfleet tests scripts examples
	$(VENV)/bin/ruff format --check rollfleet tests scripts examples

# each claimed invariant broken on purpose in a copy of the tree; its tests must fail (slow: minutes)
mutants: $(VENV)/.installed
	$(PY) tests/mutation/check.py

demo: $(VENV)/.installed
	$(PY) -m rollfleet.demo

# the same task as a LoRA run: only the adapter trains and moves (examples/cpu-demo-lora.yaml)
demo-lora: $(VENV)/.installed
	$(PY) -m rollfleet.demo examples/cpu-demo-lora.yaml

# multi-turn episodes: the tiny model learns to call a calculator tool (examples/cpu-agent.yaml)
demo-agent: $(VENV)/.installed
	$(PY) -m rollfleet.demo examples/cpu-agent.yaml

bench-agents: $(VENV)/.installed
	$(PY) -m rollfleet bench agents

bench-batching: $(VENV)/.installed
	$(PY) -m rollfleet bench batching

clean:
	rm -rf $(VENV) .pytest_cache .sglang-site
