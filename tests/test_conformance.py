"""Hydra's own launcher conformance suites, run on this launcher with 1 and 2 ranks per job."""

from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher
from hydra.test_utils.launcher_common_tests import IntegrationTestSuite, LauncherTestSuite
from pytest import mark

from hydra_plugins.hydra_torchrun_launcher.torchrun_launcher import TorchrunLauncher


def test_discovery() -> None:
    assert TorchrunLauncher.__name__ in [x.__name__ for x in Plugins.instance().discover(Launcher)]


@mark.parametrize(
    "launcher_name, overrides",
    [
        ("torchrun", ["hydra.launcher.nproc_per_node=1"]),
        ("torchrun", ["hydra.launcher.nproc_per_node=2"]),
    ],
)
class TestTorchrunLauncher(LauncherTestSuite):
    pass


@mark.parametrize(
    "task_launcher_cfg, extra_flags",
    [
        (
            {
                "defaults": [{"override hydra/launcher": "torchrun"}],
                "hydra": {"launcher": {"nproc_per_node": n}},
            },
            ["-m"],
        )
        for n in (1, 2)
    ],
    ids=["nproc1", "nproc2"],
)
class TestTorchrunLauncherIntegration(IntegrationTestSuite):
    pass
