.PHONY: demo test test-fast setup bench lint wheel

demo:
	bash scripts/demo.sh

test:
	bash scripts/test.sh

test-fast:
	bash scripts/test.sh --fast

setup:
	bash scripts/setup.sh

bench:
	bash scripts/bench.sh

lint:
	.venv/bin/ruff check . && .venv/bin/ruff format --check . && MYPY=.venv/bin/mypy scripts/typecheck.sh && LINT_IMPORTS=$(CURDIR)/.venv/bin/lint-imports scripts/contracts.sh

wheel:
	.venv/bin/python -m pip wheel --no-deps -w dist .
