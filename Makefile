# The two README commands: `make demo` (set up + run the warm-started MoE RL demo) and `make test`.
VENV ?= $(or $(MOE_RL_VENV),$(CURDIR)/.venv)
PY := $(VENV)/bin/python
export MOE_RL_VENV := $(VENV)

.PHONY: install demo test lint bench gpu-check math-example agent-example
install:
	bash scripts/install.sh

# A fresh run directory each time (a second `make demo` trains again; the warm start is cached).
demo: install
	$(VENV)/bin/moe-rl train configs/demo.yaml train.output_dir=runs/demo/$$(date +%Y%m%d-%H%M%S)

# The real-data example (configs/math_cpu.yaml): a word-problem dataset (committed), a tiny Qwen3-MoE
# with its own BPE tokenizer and chat template given a short SFT (built once into examples/math/model),
# then RL with the math reward and held-out pass@k.
math-example: install
	[ -f examples/math/model/config.json ] || $(PY) scripts/make_math_example.py model
	$(VENV)/bin/moe-rl train configs/math_cpu.yaml train.output_dir=runs/math_cpu/$$(date +%Y%m%d-%H%M%S)

# The multi-turn example (configs/agent_cpu.yaml): a box-lookup task whose answer only a tool knows, a tiny
# Qwen3-MoE with a tool-calling chat template given a short SFT on tool-call traces (built once into
# examples/agent/model), then RL with the built-in tool loop and held-out success.
agent-example: install
	[ -f examples/agent/model/config.json ] || $(PY) scripts/make_agent_example.py model
	$(VENV)/bin/moe-rl train configs/agent_cpu.yaml train.output_dir=runs/agent_cpu/$$(date +%Y%m%d-%H%M%S)

test: install
	$(PY) -m pytest -q tests

# The formatter, the linter (defaults + sorted imports + imports at top) and the import contracts of moe_rl/'s
# floor plan (pyproject.toml [tool.importlinter], docs/architecture.md); .ci/run runs it before the tests.
lint: install
	$(VENV)/bin/ruff format --check moe_rl tests bench scripts
	$(VENV)/bin/ruff check moe_rl tests bench scripts
	$(VENV)/bin/lint-imports

bench: install
	for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# On a CUDA machine without internet: WHEELS=<folder(s) of the requirements/gpu-check.txt wheels>.
# Uses $(PYTHON) (default python3, the interpreter with CUDA torch), not the CPU venv.
gpu-check:
	PYTHON=$(or $(PYTHON),python3) bash scripts/gpu_check.sh $(foreach w,$(WHEELS),--wheels $(w))
