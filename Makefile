# The two commands a reader needs are `make book` and `make test`; both set everything up.
# On an offline GPU runner: `make gpu-test WHEELHOUSE=dir` (see book/setup.md).

PYTHON     ?= python3
VENV       ?= .venv
NB         ?= $(sort $(wildcard notebooks/*.ipynb))
WHEELHOUSE ?=
WHEELHOUSE_PYTHON ?= 3.12
# The notebooks under `make gpu-test`: on the GPU at the small size (full: at the size `make
# execute` runs them, which on one GPU takes far longer than a test should).
GPU_PROFILE ?= smoke

ifneq ($(strip $(WHEELHOUSE)),)
# Offline runner: use its python3 and its torch; notebook tooling comes from the wheelhouse.
PY    := $(PYTHON)
SETUP := .nbdeps/.installed
export PYTHONPATH := $(CURDIR)/.nbdeps:$(CURDIR)/src$(if $(PYTHONPATH),:$(PYTHONPATH))
else
PY    := $(VENV)/bin/python
SETUP := $(VENV)/.installed
endif

NBVAL = $(PY) -m pytest -q -p no:cacheprovider --nbval-lax --nbval-current-env
JB    = $(VENV)/bin/jupyter-book

.PHONY: book serve test check-book browser gpu-test gpu-pytest gpu-notebooks execute wheelhouse clean

# The rendered book's check (scripts/check_book.py): with Chromium it also screenshots every page.
CHECK_BOOK = $(PY) scripts/check_book.py _build/html $$(command -v chromium >/dev/null \
	  && echo --screenshots _build/screenshots || echo --no-browser)

$(VENV)/.installed: requirements.txt pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q -r requirements.txt
	$(VENV)/bin/python -m pip install -q --no-deps -e .
	touch $@

.nbdeps/.installed: $(wildcard $(WHEELHOUSE)/*.whl)
	rm -rf .nbdeps
	$(PY) -m pip install -q --no-index --no-deps --no-compile --target .nbdeps $(WHEELHOUSE)/*.whl
	touch $@

book: $(VENV)/.installed
	$(JB) build . --warningiserror --keep-going
	@echo "book: file://$(CURDIR)/_build/html/index.html"

serve: book
	$(PY) -m http.server --directory _build/html 8000

test: $(VENV)/.installed browser
	$(PY) -m ruff check src tests scripts lab
	$(PY) -m pytest -q tests lab/tests
	TUTORIAL_PROFILE=smoke $(NBVAL) --nbval-cell-timeout=600 $(NB)
	$(PY) -m tutorial_utils.nbtools check $(NB)
	$(JB) build . --all --warningiserror --keep-going
	$(CHECK_BOOK)

# After `make book`: links, images, figures, stored outputs and maths of every page.
check-book: browser
	$(CHECK_BOOK)

# Chromium for the screenshots: installed with apt-get when missing and we are root (a fresh
# Debian CI machine, about 20 s); otherwise the check runs without it and says so.
browser:
	@command -v chromium >/dev/null && exit 0; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "browser: installing chromium with apt-get"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null \
	    || echo "browser: apt-get could not install chromium; the book check runs with --no-browser"; \
	else echo "browser: no chromium and not root; the book check runs with --no-browser"; fi

# `make gpu-test` is both halves; each can run alone (`gpu-pytest`, `gpu-notebooks`), for a
# runner whose jobs have a time limit, and `gpu-pytest PART=1/2` (then 2/2) runs half the test
# files: on one H200 the whole suite outlasts a ten-minute job.
gpu-test: gpu-pytest gpu-notebooks
NEED_GPU = $(PY) -c "import torch, sys; torch.cuda.is_available() or sys.exit('make gpu-test \
	needs a CUDA GPU; on a CPU machine run make test')"

gpu-pytest: $(SETUP)
	@$(NEED_GPU)
	$(PY) -m pytest -q -p no:cacheprovider --durations=10 $(if $(PART),--part=$(PART)) tests

gpu-notebooks: $(SETUP)
	@$(NEED_GPU)
	TUTORIAL_PROFILE=$(GPU_PROFILE) $(NBVAL) --nbval-cell-timeout=1800 $(NB)

execute: $(SETUP)
	$(PY) -m tutorial_utils.nbtools execute $(if $(FORCE),--force) $(NB)

wheelhouse:
	$(PYTHON) -m pip download -q --only-binary=:all: --python-version $(WHEELHOUSE_PYTHON) \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d $(or $(WHEELHOUSE),.wheelhouse) -r requirements-notebook.txt
	# `from myst_nb import glue` needs myst_nb and docutils, not the rest of the Sphinx stack.
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: -d $(or $(WHEELHOUSE),.wheelhouse) \
	  $$(grep -E '^(myst-nb|docutils)==' requirements.txt)
	@echo "wheelhouse: $$(ls $(or $(WHEELHOUSE),.wheelhouse) | wc -l) wheels in $(or $(WHEELHOUSE),.wheelhouse)"

clean:
	rm -rf _build .nbdeps .pytest_cache
