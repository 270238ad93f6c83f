"""Skip reasons shared by several test files."""

# The reason every GPU test gives when skipped; tests/conftest.py prints the details once at the end.
NO_GPU = "no GPU runtime (details at the end of the run)"
