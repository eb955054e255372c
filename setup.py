from pathlib import Path

from setuptools import find_namespace_packages, setup

about: dict = {}
exec(Path("hydra_plugins/hydra_torchrun_launcher/__init__.py").read_text(), about)

setup(
    name="hydra-torchrun-launcher",
    version=about["__version__"],
    description="Hydra launcher plugin that runs every sweep job as a torchrun (torch elastic) job",
    long_description=Path("README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_namespace_packages(include=["hydra_plugins.*"]),
    package_data={"hydra_plugins.hydra_torchrun_launcher": ["py.typed"]},
    python_requires=">=3.9",
    # Hydra 1.4 finds plugins through this group (an editable install of any mode works);
    # Hydra 1.3 scans the hydra_plugins namespace package instead
    entry_points={
        "hydra.plugins": [
            "torchrun = hydra_plugins.hydra_torchrun_launcher.torchrun_launcher:TorchrunLauncher",
            "torchrun_slurm = hydra_plugins.hydra_torchrun_launcher.torchrun_launcher:TorchrunSlurmLauncher",
            "torchrun_ssh = hydra_plugins.hydra_torchrun_launcher.torchrun_launcher:TorchrunSshLauncher",
        ],
        # where a sweep stands, and cancelling its SLURM jobs (README: "torchrun-sweep")
        "console_scripts": [
            "torchrun-sweep = hydra_plugins.hydra_torchrun_launcher._sweep_cli.main:main",
        ],
    },
    install_requires=[
        "hydra-core>=1.3.2,<1.5",
        "omegaconf>=2.3",
        "cloudpickle>=2.0",
        # 2.6: torch.load's weights_only default; older releases lack what the launcher
        # feature-detects (docs/torch-versions.md: the releases the suite ran on)
        "torch>=2.6",
    ],
    extras_require={
        "test": [
            "pytest>=7",
            "pytest-timeout>=2",
            "pytest-xdist>=3.5",  # -n logical
            "psutil>=5",
            "ruff",
            "hydra-optuna-sweeper>=1.2.0",
            "lightning==2.6.6",
        ],
    },
    classifiers=[
        "License :: OSI Approved :: MIT License",
        "Programming Language :: Python :: 3",
        "Operating System :: POSIX :: Linux",
    ],
)
