"""gspo_jax: critic-free RL (GRPO, DAPO, GSPO, ...) for sparse-MoE language models in JAX."""

from pathlib import Path

from setuptools import find_packages, setup

TRACKERS = ["wandb>=0.31.0", "mlflow-skinny>=3.17.2", "sqlalchemy>=2.1.9", "alembic>=1.20.1"]

setup(
    name="gspo_jax",
    version="0.1.0",
    description="GRPO / DAPO / GSPO and relatives for sparse-MoE policies in JAX/Flax",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",  # jax 0.10.2, the lower bound, needs 3.11
    packages=find_packages(include=["gspo_jax", "gspo_jax.*"]),
    include_package_data=True,
    package_data={"gspo_jax": ["**/*.json", "**/*.jsonl"]},
    # Lower bounds are the versions CI tests with (.ci/run pins each one on Python 3.11); the newest
    # releases are tested on Python 3.12.
    install_requires=[
        "jax>=0.10.2",
        "flax>=0.12.8",
        "optax>=0.2.8",
        "orbax-checkpoint>=0.12.8",
        "chex>=0.1.92",
        "transformers>=5.23.0",
        "ml_collections>=1.1.0",
        "math-verify>=0.9.0",  # dataset-task rewards (GSM8K-style answers)
        "pyarrow>=16.0",  # dataset tasks read Parquet files (16: the first with numpy 2)
        "safetensors>=0.8.0",  # Hugging Face checkpoints, read and written without torch
        "ml_dtypes>=0.6.0",
        "absl-py>=2.5.1",  # scripts/train.py: flags and config overrides
        "tensorboardX>=2.6.5",  # TensorBoard events without TensorFlow
        "matplotlib>=3.11.2",  # PNG plots at the end of a run
        "tqdm>=4.70.1",
        "numpy>=2.0",
    ],
    extras_require={
        # Weights & Biases and MLflow (with the SQLite store), beside JSONL and TensorBoard: gspo_jax/trackers.py
        "trackers": TRACKERS,
        "dev": ["pytest>=9.0", "pytest-xdist>=3.8", "hypothesis>=6.155", "ruff>=0.17.6", *TRACKERS],
        "tpu": ["jax[tpu]>=0.10.2"],
    },
)
