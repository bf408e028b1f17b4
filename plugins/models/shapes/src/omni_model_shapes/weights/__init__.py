"""The shipped, trained ``shapes`` model (a diffusers-style folder: ``model_index.json`` + safetensors).

Reproduce it with ``python -m omni_model_shapes.train --seed 0 --out <this folder>``.
"""

import os


def model_path() -> str:
    return os.path.dirname(os.path.abspath(__file__))
