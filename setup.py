"""megatron_dynbatch: dynamic token-budget micro-batching for Megatron-Core pipelines."""

import pathlib
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).resolve().parent
#: What the Megatron-LM entry needs at run time from outside the package (patches/, the scripts
#: that apply them), copied into the wheel under megatron_dynbatch/integrations/megatron_lm/shipped/
#: so an installed package trains without a checkout (integrations/megatron_lm/launch.py).
SHIPPED = ["patches/*.patch", "launch/apply_patches.sh", "launch/patch_series.sh"]


class BuildWithShippedFiles(build_py):
    """build_py, plus the Megatron-LM patches and their scripts as package data."""

    def run(self):
        super().run()
        target = pathlib.Path(self.build_lib) / "megatron_dynbatch/integrations/megatron_lm/shipped"
        for pattern in SHIPPED:
            for source in sorted(HERE.glob(pattern)):
                destination = target / source.relative_to(HERE)
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, destination)


setup(
    name="megatron_dynbatch",
    version="0.1.0",
    description="Dynamic, token-budget micro-batching for Megatron-Core (pipeline-parallel RL/LLM)",
    packages=find_packages(include=["megatron_dynbatch", "megatron_dynbatch.*"]),
    package_data={"megatron_dynbatch": ["data/*.json"]},
    python_requires=">=3.10",
    # The planner is pure Python. torch and megatron-core are deliberately not listed: pip must never
    # resolve a torch on its own (on CPU machines only the pinned 2.13.0 wheel is local; on GPU
    # clusters the user's CUDA torch must stay). scripts/bootstrap.sh installs the pinned set.
    install_requires=["pyyaml"],
    extras_require={
        "cpu": ["torch==2.13.0", "numpy", "packaging>=24.2"],
        # GPU clusters: install the cluster's CUDA torch first, then
        # `pip install --no-build-isolation ".[gpu]"`. Both requirements below accept any
        # torch >= 2.6 (megatron-core) / any torch (transformer-engine-torch), so pip keeps the
        # installed one; --no-build-isolation stops transformer-engine's build from fetching a
        # torch of its own. NVIDIA apex is not on PyPI (the PyPI "apex" is unrelated): build it
        # from its repository where wanted; megatron-core runs without it.
        "gpu": ["megatron-core==0.19.2", "transformer-engine[pytorch]>=2.0", "numpy"],
    },
    entry_points={"console_scripts": ["megatron-dynbatch=megatron_dynbatch.tools.cli:main"]},
    cmdclass={"build_py": BuildWithShippedFiles},
)
