# The two commands of the README. Everything else is in scripts/.
.PHONY: serve test setup
setup:
	scripts/bootstrap.sh
serve: setup
	.venv/bin/kvstack serve
test:
	scripts/test.sh
