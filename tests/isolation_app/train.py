"""A training script run by the launcher's script mode (`hydra.launcher.training_script`)."""

import os
import sys
from pathlib import Path

Path(f"script_rank{os.environ['RANK']}.txt").write_text(" ".join(sys.argv[1:]))
