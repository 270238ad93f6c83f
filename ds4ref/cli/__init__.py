"""Command-line tools on top of the package: `python -m ds4ref.cli.generate` (token ids from a
model) and `python -m ds4ref.cli.bench` (a load test against a running server)."""
