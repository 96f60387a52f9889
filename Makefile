# The two commands a reader needs are `make book` and `make test`; both set everything up.
# On an offline GPU runner: `make gpu-test WHEELHOUSE=dir` (see book/setup.md).

PYTHON     ?= python3
VENV       ?= .venv
NB         ?= $(sort $(wildcard notebooks/*.ipynb)) book/records.ipynb
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

.PHONY: book serve test check-book browser gpu-test gpu-pytest gpu-notebooks execute records \
	wheelhouse clean

# The rendered book's check (tools/check_book.py): with Chromium it also screenshots every page.
CHECK_BOOK = $(PY) tools/check_book.py _build/html $$(command -v chromium >/dev/null \
	  && echo --screenshots _build/screenshots || echo --no-browser)

$(VENV)/.installed: requirements.txt pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	@$(VENV)/bin/python -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else \
	  f"make: $(VENV) has Python {sys.version.split()[0]}; the book needs 3.11 or newer: " \
	  "rm -rf $(VENV), then make PYTHON=python3.12 ...")'
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

# The tests and the notebooks run in TEST_WORKERS processes (pytest-xdist), a file's tests (a
# notebook's cells) together in one of them: most tests wait on processes they start, so two
# overlap well even on two cores.
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadfile

# Compute threads per test process: the cores shared by the TEST_WORKERS processes (one each
# on two cores), unless OMP_NUM_THREADS is set already. By default each process would take
# one thread per core, and two small CPU training steps side by side then oversubscribe them.
TEST_THREADS := $(shell n=$$(( $$(nproc 2>/dev/null || echo 2) / $(TEST_WORKERS) )); \
	echo $$(( n > 0 ? n : 1 )))
test: export OMP_NUM_THREADS ?= $(TEST_THREADS)
test: $(VENV)/.installed browser
	$(PY) -m ruff check src tests tools
	$(PY) -m pytest -q $(XDIST) --durations=20 tests
	TUTORIAL_PROFILE=smoke $(NBVAL) $(XDIST) --durations=10 --nbval-cell-timeout=600 $(NB)
	$(PY) tools/nbtools.py check $(NB)
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

# `make gpu-test` runs what only a GPU can check, in two halves that can also run alone: the
# tests marked gpu or multigpu (`gpu-pytest`; the rest of the suite runs in `make test`), and
# every notebook with TUTORIAL_MEASURE=1, so that each measures on the GPU instead of reading its
# records (`gpu-notebooks`).
gpu-test: gpu-pytest gpu-notebooks
NEED_GPU = $(PY) -c "import torch, sys; torch.cuda.is_available() or sys.exit('make $@ \
	needs a CUDA GPU; on a CPU machine run make test')"

gpu-pytest: $(SETUP)
	@$(NEED_GPU)
	$(PY) -m pytest -q -p no:cacheprovider --durations=10 -m "gpu or multigpu" tests

# The notebooks share the GPU, GPU_TEST_WORKERS at a time: what they check is that each path
# runs, not how fast (their timings are not kept).
GPU_TEST_WORKERS ?= 4
gpu-notebooks: $(SETUP)
	@$(NEED_GPU)
	TUTORIAL_MEASURE=1 TUTORIAL_PROFILE=$(GPU_PROFILE) $(NBVAL) -n $(GPU_TEST_WORKERS) \
	  --dist loadfile --durations=15 --nbval-cell-timeout=1800 $(NB)

# Re-run every chapter in place and stamp it, on any machine: GPU numbers come from records.
execute: $(SETUP)
	$(PY) tools/nbtools.py execute $(NB)

# Every number the book measured on GPUs is a dated record in book/data, which the chapters read
# on any machine (book/setup.md). `make records` remakes those this machine's GPUs can make:
# the one-GPU records on one GPU, and with GPUS=N (N >= 2, default: every GPU here) the N-GPU
# ones too; `make records RECORDS="02 05c"` for some. A record names the GPUs it needs, and is
# refused, old record kept, on fewer. 5d, 5e and 5e-bn are long sweeps that can be made in parts
# adding up to one record (`make records RECORDS=05e ONLY=0-2`, then 3-5); 05-200ep trains for
# about half an hour.
GPUS       ?= $(shell $(PY) -c "import torch; print(torch.cuda.device_count())" 2>/dev/null)
RECORDS_1  = 02 05c 05-loaders 05b-knobs-1 06-nccl-1 06-sharding-1 07-gpt 05d 05e 05e-bn 05-200ep
RECORDS_N  = 03 03b 04 05 05b 05b-trace 05b-knobs 06 06-nccl 07 08-context
RECORDS_ALL = $(RECORDS_1) $(RECORDS_N)
RECORDS    ?= $(if $(filter 0 1,$(or $(GPUS),0)),$(RECORDS_1),$(RECORDS_ALL))
REC_02        = tutorial_utils.bench.one_gpu
REC_05c       = tutorial_utils.bench.memory
REC_05-loaders = tutorial_utils.bench.experiment --plan 05-loaders --data $(DATA)
REC_05b-knobs-1 = tutorial_utils.bench.ddp_knobs --nproc 1
REC_06-nccl-1 = tutorial_utils.bench.nccl --gpus 1
REC_06-sharding-1 = tutorial_utils.bench.sharding --nproc 1
REC_07-gpt    = tutorial_utils.bench.transformer
REC_05d = tutorial_utils.bench.experiment --plan 05d --data $(DATA) $(if $(ONLY),--only $(ONLY))
REC_05e = tutorial_utils.bench.experiment --plan 05e --data $(DATA) $(if $(ONLY),--only $(ONLY))
REC_05e-bn = tutorial_utils.bench.experiment --plan 05e-bn --data $(DATA) \
	$(if $(ONLY),--only $(ONLY))
REC_05-200ep  = tutorial_utils.bench.experiment --plan 05-200ep --data $(DATA)
REC_03        = tutorial_utils.bench.model_parallel --devices $(GPUS) --schedules
REC_03b       = tutorial_utils.bench.collectives --nproc $(GPUS)
REC_04        = tutorial_utils.bench.data_parallel --gpus $(GPUS)
REC_05        = tutorial_utils.bench.experiment --plan 05 --gpus $(GPUS) --data $(DATA)
REC_05b       = tutorial_utils.bench.scaling --gpus $(GPUS)
REC_05b-trace = tutorial_utils.bench.scaling --trace
REC_05b-knobs = tutorial_utils.bench.ddp_knobs --nproc $(GPUS)
REC_06        = tutorial_utils.bench.sharding --nproc $(GPUS)
REC_06-nccl   = tutorial_utils.bench.nccl --gpus $(GPUS)
REC_07        = tutorial_utils.bench.transformer --gpus $(GPUS)
REC_08-context = tutorial_utils.bench.context --gpus $(GPUS)
DATA    ?= $(or $(TUTORIAL_CIFAR10),auto)
records: $(SETUP)
	@$(NEED_GPU)
	@for c in $(RECORDS); do case " $(RECORDS_ALL) " in *" $$c "*) ;; *) \
	  echo "make records: no record is made by $$c; use some of: $(RECORDS_ALL)"; \
	  exit 2;; esac; done
	$(foreach c,$(RECORDS),$(PY) -m $(REC_$(c)) --record &&) true

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
