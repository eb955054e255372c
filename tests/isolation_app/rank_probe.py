"""A module of the app that reads torchrun's variables when it is imported, as Lightning does.

The task uses it, so every rank imports it; what it saw at import is what a library that
decides the rank at import time would see.
"""

import os

KEYS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "JOB_TAG",
    "FROM_CALLBACK",
    "FROM_LAUNCHER",
    "ONLY_ONE_JOB",
    "CUDA_VISIBLE_DEVICES",
)
AT_IMPORT = {key: os.environ.get(key) for key in KEYS}
CWD_AT_IMPORT = os.getcwd()
