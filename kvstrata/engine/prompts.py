"""Prompt files for ``kvstrata generate``: one prompt per line, JSON.

    [1, 15043, 29892]                     token ids
    {"prompt_token_ids": [1, 15043]}      token ids
    {"prompt": "Hello"}                   text, tokenized with the checkpoint's tokenizer

Blank lines are skipped. A line that is none of these is an error naming the
file and line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvstrata.system.files import NotRegular, read_bounded
from kvstrata.errors import ConfigError

__all__ = ["read_prompts", "load_tokenizer", "MAX_PROMPT_FILE_BYTES"]

MAX_PROMPT_FILE_BYTES = 256 * 1024**2  # prompts of a few million tokens


def read_prompts(path: str | Path, model_dir: str | Path) -> list[list[int]]:
    """The prompts of ``path`` as token ids (text through ``model_dir``'s tokenizer)."""
    try:
        lines = read_bounded(path, MAX_PROMPT_FILE_BYTES).decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise ConfigError(f"--prompt-file: {path}: not UTF-8 text") from None
    except NotRegular as e:
        raise ConfigError(f"--prompt-file: {e}") from None
    except OSError as e:
        raise ConfigError(f"--prompt-file: {path}: {e.strerror or e}") from None
    prompts: list[list[int]] = []
    tokenizer: Any = None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except RecursionError:
            raise ConfigError(f"{where}: JSON nested too deeply") from None
        except ValueError as exc:
            raise ConfigError(f"{where}: not JSON ({getattr(exc, 'msg', exc)})") from None
        if isinstance(item, dict) and isinstance(item.get("prompt"), str):
            if tokenizer is None:
                tokenizer = load_tokenizer(model_dir)
                if tokenizer is None:
                    raise ConfigError(f"{where}: a text prompt needs the checkpoint's tokenizer, and {model_dir} "
                                      "has none; give token ids instead")
            prompts.append(list(tokenizer(item["prompt"])["input_ids"]))
            continue
        ids = item.get("prompt_token_ids") if isinstance(item, dict) else item
        if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
            raise ConfigError(f"{where}: expected a non-empty list of token ids, {{\"prompt_token_ids\": [...]}} "
                              "or {\"prompt\": \"text\"}")
        prompts.append(ids)
    if not prompts:
        raise ConfigError(f"--prompt-file: {path} holds no prompt")
    return prompts


def load_tokenizer(model_dir: str | Path) -> Any:
    """The checkpoint's tokenizer, or None when it has none."""
    root = Path(model_dir).expanduser()
    if not any((root / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(root))
