"""Convert a Nemotron-Labs-Diffusion Hugging Face directory to a packed_ss_jax checkpoint.

    python -m convert.convert_nemotron /models/Nemotron-Labs-Diffusion-8B /models/nld-8b-jax \
        --dtype bfloat16

`packed-ss convert` with the source checked to be a Nemotron-Labs-Diffusion checkpoint.
"""

import sys

from packed_ss_jax.cli import convert_main

if __name__ == "__main__":
    sys.exit(convert_main(prog="python -m convert.convert_nemotron", family="nemotron"))
