"""python -m ds4ref.convert: the command of ds4ref/convert/to_gguf.py."""
from .to_gguf import main

main()
