"""A Hydra app whose task function cannot be pickled: it holds a lock."""

import threading

import hydra
from hydra.core.config_store import ConfigStore

# Hydra 1.4 warns when version_base is given, Hydra 1.3 when it is not
VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}

ConfigStore.instance().store(
    name="config",
    node={"hydra": {"callbacks": {"recorder": {"_target_": "recorder.Recorder"}}}},
)


def make_task():
    lock = threading.Lock()

    def task(cfg):
        with lock:
            return 1

    return task


if __name__ == "__main__":
    hydra.main(**VERSION_BASE, config_name="config")(make_task())()
