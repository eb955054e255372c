"""Imported by node_app's task, in the rank (the launcher never imports it): what a module
imported in a rank sees of RANK/WORLD_SIZE while its body runs (as Lightning's does)."""

import os

AT_IMPORT = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")}
