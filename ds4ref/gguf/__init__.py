"""The model file: the config and metadata keys (`config`, `metadata`), tensor names and shapes
(`tensors`), the block quant codes (`quant_codes`), the GGUF reader and writer (`file`), weights
as the reference reads them (`weights`), the tokenizer stored in the file (`tokenizer`) and the
embedded tiny model (`tiny`). Every other layer reads models through here; this layer imports
nothing of the package above it.
"""
