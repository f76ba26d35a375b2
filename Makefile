# Parallelism Lab. Two commands on a fresh machine:
#   make lab    create .venv, install, open the course in JupyterLab
#   make test   install if needed, run the library tests and every chapter under nbval
#               (and the chapters in a real browser where Chromium is installed)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.labkit-installed
# torch is pinned: a plain `pip install torch` can pull a multi-GB CUDA build.
TORCH  := torch==2.13.0
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)
CELL_TIMEOUT ?= 120
# the system's Chromium drives the browser test (Debian/Ubuntu: apt-get install
# chromium fonts-wqy-microhei); never a browser downloaded by `playwright install`
CHROMIUM ?= /usr/bin/chromium

.PHONY: FORCE executed install newest test-newest test-torch lock test-cpus check lab book slides student nbgrader test lint test-lib test-notebooks \
	browser-test bench doctor images clean-notebooks clean vendor two-hosts

install: $(STAMP)

# Every package at the version CI last tested: requirements.lock pins them all
# (a constraints file: a package a platform needs that the lock lacks, such as
# macOS's appnope, still installs). `make lock` refreshes it.
LOCK   := requirements.lock
# pip byte-compiles what it installs one file at a time; compileall does the same
# on every core (a file that does not compile, such as torch's Python 3.12 test
# file, is left as pip leaves it: hence the || true), and for labkit, which an
# editable install leaves uncompiled: where PYTHONDONTWRITEBYTECODE is set, every
# kernel and command would otherwise compile it again on import.
$(STAMP): pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c $(LOCK) pip
	$(BIN)/python -m pip install --quiet --no-compile "$(TORCH)"
	$(BIN)/python -m pip install --quiet --no-compile -c $(LOCK) -e ".[dev]"
	$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib labkit || true
	touch $(STAMP)

# The newest releases pyproject's ranges allow, as a plain `pip install` gives
# them, in a second environment kept outside the clone (labkit/cli/newest.py: made
# once per pyproject.toml, then upgraded in place when its last refresh is over
# NEWEST_HOURS old): `make test-newest` runs the fast tests there (CI too), so the
# next release that breaks us is caught by us first.
NEWEST ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/labkit/venv-newest
NEWEST_HOURS ?= 12
newest:
	$(PYTHON) -m labkit.cli.newest "$(NEWEST)" --torch "$(TORCH)" \
		--refresh-hours $(NEWEST_HOURS)
	@PYTHONPATH="$(CURDIR)" "$(NEWEST)/bin/python" -m labkit.cli.lock diff $(LOCK)

# the fast tests: those that start no process, and the runtime's (cloudpickle,
# ipykernel and jupyter_client carry ranks and kernels); not the notebooks (slow)
# and not the comparisons with one process (numerics: torch, pinned, computes them
# the same either way). With the portable start (LABKIT_START=portable, what
# macOS gets: no fork after importing torch), the runtime's tests and chapters
# 00-02 too, so that path runs on every CI run; make test runs the fork start.
PORTABLE_CHAPTERS ?= $(wildcard notebooks/0[0-2]_*.ipynb)
test-newest: newest
	LABKIT_ENV=newest LABKIT_START=portable PYTHONPATH="$(CURDIR)" \
		"$(NEWEST)/bin/python" -m pytest tests $(PORTABLE_CHAPTERS) \
		-q -p no:cacheprovider --ignore=tests/browser -n $(TEST_JOBS) --dist loadfile \
		--no-loadscope-reorder --nbval-lax --nbval-current-env \
		--nbval-cell-timeout=$(CELL_TIMEOUT) \
		-m "not slow and not numerics and (not ranks or runtime)"

# The other end of the torch range pyproject allows (the lock keeps 2.13.0 for CI):
# `make test-torch` makes an environment with TORCH_OTHER and the newest of the
# rest (as `make newest`, kept outside the clone), then runs the fast tests and
# chapters 00-05 there. Not part of CI: torch 2.14.1 is a CUDA build, with about
# 3 GB of CUDA libraries to install once.
TORCH_OTHER ?= torch==2.14.1
TORCH_VENV ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/labkit/venv-torch
TORCH_CHAPTERS ?= $(wildcard notebooks/0[0-5]_*.ipynb)
test-torch:
	$(PYTHON) -m labkit.cli.newest "$(TORCH_VENV)" --torch "$(TORCH_OTHER)" \
		--refresh-hours $(NEWEST_HOURS)
	LABKIT_ENV=torch PYTHONPATH="$(CURDIR)" "$(TORCH_VENV)/bin/python" -m pytest \
		tests $(TORCH_CHAPTERS) -q -p no:cacheprovider --ignore=tests/browser \
		-n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder --nbval-lax \
		--nbval-current-env --nbval-cell-timeout=$(CELL_TIMEOUT) \
		-m "not slow and not numerics and (not ranks or runtime)"

# Refresh the lock from the newest releases; then run `make test` (it reinstalls
# .venv from the new lock) and commit requirements.lock if it passes.
lock: newest
	PYTHONPATH="$(CURDIR)" "$(NEWEST)/bin/python" -m labkit.cli.lock write $(LOCK)

lab: install
	$(BIN)/jupyter lab $(ROOT_FLAG) --ServerApp.root_dir="$(CURDIR)" \
		--ServerApp.default_url=/lab/tree/notebooks/00_lab_tour.ipynb

# The chapters as they ran: `make test-notebooks` keeps each chapter nbval executed,
# outputs and widgets' state included, in _build/executed/ (labkit/cli/executed.py);
# `executed` executes only those whose copy is missing or older than the chapter
# or labkit, JOBS at once, with nbval's per-cell limit.
CHAPTERS := $(wildcard notebooks/*.ipynb)
JOBS ?= 2  # chapters executed at once (each is its own kernel and ranks)
EXECUTED := _build/executed

executed: install
	$(BIN)/python -m labkit.cli.executed --jobs $(JOBS) --timeout $(CELL_TIMEOUT) \
		$(EXECUTED) $(CHAPTERS)

# The site and the decks come from an edition of the executed chapters
# (labkit/cli/editions.py): public (no solutions; the default) or lecturer
# (`make book EDITION=lecturer`: everything, each solution labelled).
EDITION ?= public
EDITION_DIR := _build/edition-$(EDITION)
SLIDES_DIR := _build/slides$(if $(filter lecturer,$(EDITION)),-lecturer)
BOOK_DIR := _build/book$(if $(filter lecturer,$(EDITION)),-lecturer)

# one site (labkit/cli/site.py): index, contents, previous/next, search, widgets,
# a page for lecturers and a glossary
book: executed vendor
	$(BIN)/python -m labkit.cli.site $(EXECUTED) $(BOOK_DIR) _build/vendor $(EDITION)

slides: executed vendor
	$(BIN)/python -m labkit.cli.editions $(EXECUTED) $(EDITION_DIR) $(EDITION)
	$(MAKE) --no-print-directory -j$(JOBS) \
		$(CHAPTERS:notebooks/%.ipynb=$(SLIDES_DIR)/%.slides.html)
	mkdir -p _build/images && cp images/*.svg _build/images/

$(SLIDES_DIR)/%.slides.html: FORCE
	$(BIN)/jupyter nbconvert $(OFFLINE) --to slides --output-dir $(SLIDES_DIR) \
		--SlidesExporter.reveal_scroll=True $(EDITION_DIR)/$*.ipynb

FORCE:

# The pages work without a network: every script and style sheet they load sits in
# _build/vendor/ (labkit/cli/vendor.py fetches it from npm once, at build time), and
# nbconvert's URLs point there, relative to _build/slides/ (the book's site copies
# them into its _static/).
OFFLINE = $(shell $(BIN)/python -m labkit.cli.vendor --flags ../vendor _build/vendor)

vendor: install
	$(BIN)/python -m labkit.cli.vendor _build/vendor

# the student edition: solutions out, outputs cleared, images beside the chapters
student: install
	$(BIN)/python -m labkit student --out dist/student

# every chapter with exercises as an nbgrader assignment: a course folder in
# dist/nbgrader/ (README, For lecturers); `make student` stays the self-study edition
nbgrader: install
	$(BIN)/python -m labkit nbgrader --out dist/nbgrader

# each step's time is printed at the end, beside the last run's (labkit/cli/steps.py)
TEST_STEPS := install lint test-lib test-notebooks $(if $(wildcard $(CHROMIUM)),browser-test)
test:
	@$(PYTHON) -m labkit.cli.steps $(TEST_STEPS)

lint: install
	$(BIN)/ruff check labkit tests examples
	$(BIN)/ruff check --line-length 79 --select E501 notebooks  # chapters' code fits a projector
	$(BIN)/lint-imports --no-cache  # the layers contract in pyproject.toml

# the browser test runs as its own step (below), after the chapters pass under nbval.
# Two workers (pytest-xdist), a test file each at a time: on 2 cores most tests wait
# on ranks, sockets or timeouts, and a file's tests share its module's cluster.
# Files with slow tests go first (tests/conftest.py orders them; xdist keeps that
# order), so the longest does not run alone at the end.
TEST_JOBS ?= 2
test-lib: install
	$(BIN)/python -m pytest tests -q --ignore=tests/browser -n $(TEST_JOBS) --dist loadfile \
		--no-loadscope-reorder

# Other CPUs' kernels (labkit/cli/cpus.py): the numerics tests and chapters 05-08
# again under each corner this CPU supports and that is new on it (one whose kernels
# make test or an earlier corner ran is skipped, said), with the largest measured/allowed
# error per chapter and test file. CPU_CORNERS picks (avx2, avx512, compatible).
# (Chapter 04 compares only bytes, which no kernel changes: it is left out.)
CPU_CORNERS ?= avx2,avx512,compatible
CPU_CHAPTERS ?= $(wildcard notebooks/0[5-8]_*.ipynb)
test-cpus: install
	$(BIN)/python -m labkit.cli.cpus --corners $(CPU_CORNERS) --jobs $(TEST_JOBS) \
		--cell-timeout $(CELL_TIMEOUT) --chapters $(CPU_CHAPTERS)

# the developer's fast inner loop: lint and the tests that start no process (tests/conftest.py
# marks the others "ranks"); `make test` runs everything
check: lint
	$(BIN)/python -m pytest tests -q -p no:cacheprovider --ignore=tests/browser \
		-m "not slow and not ranks"

# the chapters under nbval, TEST_JOBS at once (a chapter's cells in order on one
# worker), each kept as it ran in _build/executed/ (labkit/cli/executed.py). A
# chapter's timings may show the other's load: they are printed, never asserted.
test-notebooks: install
	$(BIN)/python -m pytest -q -p no:cacheprovider --nbval-lax --nbval-current-env \
		--nbval-cell-timeout=$(CELL_TIMEOUT) -n $(TEST_JOBS) --dist loadfile \
		-p labkit.cli.executed --executed-to $(EXECUTED) notebooks/

# widget chapters in JupyterLab in headless Chromium; screenshots in _build/browser/.
# TEST_JOBS workers, a test file each at a time (each worker its own JupyterLab), in
# the order tests/browser/conftest.py gives them
browser-test: install
	@test -x "$(CHROMIUM)" || { echo "make browser-test needs Chromium at $(CHROMIUM)" \
		"(Debian/Ubuntu: apt-get install chromium fonts-wqy-microhei)"; exit 1; }
	LABKIT_CHROMIUM="$(CHROMIUM)" $(BIN)/python -m pytest tests/browser -q \
		-n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder

doctor: install
	$(BIN)/python -m labkit doctor

# chapters 05 and 07 under torchrun on two "hosts" (network namespaces joined by a
# veth pair; needs root): what a two-node run sets, printed as it goes
two-hosts: install
	$(BIN)/python examples/two_hosts.py

# every benchmark runs; make fails at the end if any figure fell short of its target
bench: install
	status=0; for b in cluster ring strategies model-parallel expert; do \
		$(BIN)/python -m labkit bench $$b || status=1; done; exit $$status

images: install
	$(BIN)/python -m labkit images

clean-notebooks: install
	$(BIN)/python -m labkit clean-notebooks notebooks/*.ipynb

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
