"""kvstrata's lab: the benchmark (`bench`), the tuner, the evidence commands behind docs/results, the
serve-bench load harness and the V4.1 reference-model training. It imports the library; the
library imports nothing from it (tests/test_architecture.py checks). Installed from `lab/` as the
`kvstrata-lab` distribution, which adds its subcommands to `kvstrata` (entry-point group
`kvstrata.commands`)."""
