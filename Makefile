# `make demo` trains the embedded tiny default; `make test` runs the whole suite.
# Both create .venv and install requirements.txt on first use (unless a virtualenv is active).
ifdef VIRTUAL_ENV
PYTHON := $(VIRTUAL_ENV)/bin/python
STAMP := $(VIRTUAL_ENV)/.lora-trainer-installed
else
PYTHON := .venv/bin/python
STAMP := .venv/.lora-trainer-installed
endif

.PHONY: install demo test
install: $(STAMP)

$(STAMP): requirements.txt
	@test -x $(PYTHON) || python3 -m venv .venv
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	@touch $(STAMP)

demo: $(STAMP)
	$(PYTHON) tools/llm_quickstart.py --output_dir out/quickstart

test: $(STAMP)
	$(PYTHON) -m pytest
