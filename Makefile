# Parallelism Lab. Two commands on a fresh machine:
#   make lab    create .venv, install, open the course in JupyterLab
#   make test   install if needed, run the library tests and every chapter under nbval
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.labkit-installed
# torch is pinned: a plain `pip install torch` can pull a multi-GB CUDA build.
TORCH  := torch==2.13.0
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)
CELL_TIMEOUT ?= 120

.PHONY: FORCE install lab book slides test lint test-lib test-notebooks bench doctor images clean-notebooks clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

lab: install
	$(BIN)/jupyter lab $(ROOT_FLAG) --ServerApp.root_dir="$(CURDIR)" \
		--ServerApp.default_url=/lab/tree/notebooks/00_lab_tour.ipynb

# Chapters executed as under nbval (same per-cell limit); widgets keep their state,
# the figure each one shows included, so the pages show them.
NBCONVERT := $(BIN)/jupyter nbconvert --execute \
	--ExecutePreprocessor.timeout=$(CELL_TIMEOUT) \
	--ExecutePreprocessor.store_widget_state=True

CHAPTERS := $(wildcard notebooks/*.ipynb)
JOBS ?= 2  # chapters executed at once (each page is its own kernel and ranks)

book: install
	$(MAKE) --no-print-directory -j$(JOBS) $(CHAPTERS:notebooks/%.ipynb=_build/book/%.html)
	mkdir -p _build/images && cp images/*.svg _build/images/  # chapters link ../images

slides: install
	$(MAKE) --no-print-directory -j$(JOBS) \
		$(CHAPTERS:notebooks/%.ipynb=_build/slides/%.slides.html)
	mkdir -p _build/images && cp images/*.svg _build/images/

# every page is executed afresh each time (labkit may have changed, not the chapter)
_build/book/%.html: notebooks/%.ipynb FORCE
	$(NBCONVERT) --to html --output-dir _build/book $<

_build/slides/%.slides.html: notebooks/%.ipynb FORCE
	$(NBCONVERT) --to slides --output-dir _build/slides \
		--SlidesExporter.reveal_scroll=True $<

FORCE:

test: lint test-lib test-notebooks

lint: install
	$(BIN)/ruff check labkit tests

test-lib: install
	$(BIN)/python -m pytest tests -q

test-notebooks: install
	$(BIN)/python -m pytest -q -p no:cacheprovider --nbval-lax --nbval-current-env \
		--nbval-cell-timeout=$(CELL_TIMEOUT) notebooks/

doctor: install
	$(BIN)/python -m labkit doctor

# every benchmark runs; make fails at the end if any figure fell short of its target
bench: install
	status=0; for b in cluster ring strategies; do \
		$(BIN)/python -m labkit bench $$b || status=1; done; exit $$status

images: install
	$(BIN)/python -m labkit images

clean-notebooks: install
	$(BIN)/python -m labkit clean-notebooks notebooks/*.ipynb

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
