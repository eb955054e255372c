"""An installed package that reads torchrun's and the job's variables at import, as many do."""

import os

RANK_AT_IMPORT = os.environ.get("RANK")
LOCAL_RANK_AT_IMPORT = os.environ.get("LOCAL_RANK")
JOB_VAR_AT_IMPORT = os.environ.get("PARITY_JOB_VAR")
