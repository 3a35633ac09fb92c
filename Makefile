# p2ptrain — the two commands of the README:
#   make demo   install into .venv and run a 4-node local SGP cluster (report in runs/demo)
#   make test   install into .venv, lint (ruff), build the docs (strict) and run the test suite (what CI runs)
#   make docs   build the documentation site (mkdocs, strict) into build/site; preview: .venv/bin/mkdocs serve
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP_FLAGS ?= -q
DEMO_ARGS ?= --nodes 4 --algorithm sgp --topology exponential --peers-per-step 1 --overlap 1 \
             --steps 300 --model mlp --dataset synthetic --out runs/demo

.PHONY: install demo test lint docs test-all bench bench-algorithms bench-peers reproduce proto clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) --upgrade pip
	$(PY) -m pip install $(PIP_FLAGS) -c constraints.txt -e '.[dev]'
	touch $@

demo: install
	$(VENV)/bin/p2ptrain launch $(DEMO_ARGS)

test: install lint docs
	$(PY) -m pytest

lint: install
	$(PY) -m ruff check .

# quiet: the log is shown only when the build fails (not `mkdocs --quiet`, which hides the warnings --strict counts)
docs: install
	@mkdir -p build
	@NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site >build/mkdocs.log 2>&1 \
		|| { cat build/mkdocs.log; echo "make docs: mkdocs build --strict failed" >&2; exit 1; }
	@echo "docs: build/site ($$(tail -n 1 build/mkdocs.log | sed 's/^INFO *- *//'))"

test-all: install
	$(PY) -m pytest -m ''

bench: install
	$(VENV)/bin/p2ptrain bench transport --size-mb 64 --reps 10

bench-algorithms: install
	$(VENV)/bin/p2ptrain bench algorithms --nodes 8 --bandwidth 200mbit --latency 5ms

bench-peers: install
	$(VENV)/bin/p2ptrain bench peers --nodes 4 --steps 200

reproduce: install
	$(VENV)/bin/p2ptrain reproduce relaysgd

proto: install
	$(PY) scripts/gen_proto.py

clean:
	rm -rf $(VENV) runs .pytest_cache build/site
