"""megatron_dynbatch: dynamic token-budget micro-batching for Megatron-Core pipelines."""

from setuptools import find_packages, setup

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
    extras_require={"cpu": ["torch==2.13.0", "numpy", "packaging>=24.2"]},
    entry_points={"console_scripts": ["megatron-dynbatch=megatron_dynbatch.tools.cli:main"]},
)
