"""`python -m ds4ref.diff`: where another engine's forward pass leaves ds4ref's, layer by layer and
op by op (docs/diff.md). One GGUF dump file a step of named intermediates (names.py, dumpfile.py);
ds4ref writes them through the reference's tap (recorder.py), llama.cpp through its graph eval
callback (llama_cpp.py); compare.py aligns two dumps by position and reports the first divergence."""
