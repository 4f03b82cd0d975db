"""Convert a SetDLM Hugging Face directory to a packed_ss_jax checkpoint.

    python -m convert.convert_setdlm /models/SetDLM /models/setdlm-jax --dtype bfloat16 \
        --base-config /models/Qwen3/config.json

`packed-ss convert` with the source checked to be a SetDLM checkpoint.
"""

import sys

from packed_ss_jax.cli import convert_main

if __name__ == "__main__":
    sys.exit(convert_main(prog="python -m convert.convert_setdlm", family="setdlm"))
